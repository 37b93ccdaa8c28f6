"""train.py with its blocks compiled on a CPU too: `python tests/compiled_train.py BACKEND --flag=value ...` is
`python train.py --flag=value ...` with torch.compile's BACKEND for the CPU (aot_eager: dynamo's graphs and
AOTAutograd's forward and backward graphs, run by PyTorch's own kernels, with no code generated). What
tests/test_compile.py starts under torchrun to train compiled blocks under DDP over gloo."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from machinery import cli  # noqa: E402

if __name__ == "__main__":
    train.COMPILERS["cpu"] = sys.argv.pop(1)
    cli.run(train.main)
