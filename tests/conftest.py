"""Shared test helpers: the repository root on sys.path, where the real data lives, and the few objects
every test file builds: a tiny model, the torch.optim.AdamW oracle, and a prepared byte-level corpus."""
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Under `pytest -n N` (pytest-xdist) the N workers share the cores: each takes its share of threads, and so do the
# processes its tests start. Left at one thread per core each, their spinning thread pools fight when another job
# holds a core (2 workers on 2 cores with one core busy: 502 s with a thread per core each, 319 s with one each).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    SHARE = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(SHARE)
    os.environ.setdefault("OMP_NUM_THREADS", str(SHARE))

# Real data is never copied into the repository: tests read it from ../shared beside the checkout.
SHARED = ROOT.parent / "shared"
SHARED_DATA = SHARED / "data"
MODERNBERT_TOKENIZER = SHARED / "tokenizers" / "modernbert" / "tokenizer.json"

# The byte tokenizer's special ids ([CLS] [SEP] [PAD] [MASK] follow the 256 bytes), vocab padded to 320.
BYTE_IDS = dict(vocab_size=320, cls_token_id=256, sep_token_id=257, pad_token_id=258, mask_token_id=259)


def need(path: Path) -> Path:
    """Return `path`, or skip the test with a reason that names the missing file."""
    if not path.exists():
        pytest.skip(f"needs {path} (real data lives in ../shared beside the checkout; absent here)")
    return path


def source_copy(folder, edit=None):
    """folder: a copy of the repository's code as cli.source_digest reads it (the scripts and machinery/*.py);
    `edit`, a path in it such as "machinery/metrics.py", gets a line added: code edited, the repository untouched."""
    import shutil
    (folder / "machinery").mkdir(parents=True)
    for path in [*ROOT.glob("*.py"), *ROOT.glob("machinery/*.py")]:
        shutil.copyfile(path, folder / path.relative_to(ROOT))
    if edit:
        with open(folder / edit, "a") as f:
            f.write("# an edit\n")
    return folder


def tiny_model(seed=0, **config):
    """A random `tiny` ModernBERT (4 blocks, 128 wide) over the byte tokenizer's ids, seeded."""
    from model import ModernBERT, ModernBERTConfig
    torch.manual_seed(seed)
    return ModernBERT(ModernBERTConfig.from_preset("tiny", **{**BYTE_IDS, **config}))


def torch_adamw_oracle(model, peak_lr, weight_decay, betas=(0.9, 0.98), eps=1e-6):
    """The oracle for train.AdamW: torch.optim.AdamW whose coupled decay lr * wd / peak equals our decoupled
    (lr / peak) * wd, with our two parameter groups (matrices decay, ndim <= 1 does not)."""
    groups = model.param_groups()
    return torch.optim.AdamW([{"params": [p for _, p in groups["decay"]], "weight_decay": weight_decay / peak_lr},
                              {"params": [p for _, p in groups["no_decay"]], "weight_decay": 0.0}],
                             lr=peak_lr, betas=betas, eps=eps)


def made_up_texts(path, count, shortest, longest):
    """path: a JSONL of `count` made-up biomedical-sounding texts of shortest to longest - 1 words, the same at
    every call (texts for CKA and the needle that no model has seen)."""
    import json

    import numpy as np
    rng = np.random.default_rng(0)
    words = "the cell protein binds a receptor in mice while dose and risk of tumour rose".split()
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(shortest, longest)))}) + "\n"
                            for _ in range(count)))
    return path


FIRST = ("test_train.py", "test_train_inputs.py")  # under pytest-xdist, the files of the longest tests


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (gpu-report's suite), each test marked `torchrun` (a training of a minute or more) goes
    first in a hand of its own. xdist's load scheduling first hands every test process max(2, tests // processes //
    4) consecutive tests, which run one after another: two such trainings in one hand ran back to back while other
    processes sat idle, past the half of --minutes the suite has. Every process collects, so the order is the same."""
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if processes < 2:
        return
    # The files of trainings first (each file kept whole: a module's fixtures are made once): at the end of the
    # collection, their seconds-long tests queued on one process left the other idle for up to 27 s.
    items.sort(key=lambda item: os.path.basename(item.nodeid.split("::")[0]) not in FIRST)  # stable: the rest as is
    long = [item for item in items if item.get_closest_marker("torchrun")]
    if not long:
        return
    hand = max(2, len(items) // processes // 4)
    short = [item for item in items if not item.get_closest_marker("torchrun")]
    ordered = []
    for item in long:
        ordered += [item] + short[:hand - 1]
        short = short[hand - 1:]
    items[:] = ordered + short


def pytest_runtest_logreport(report):
    """Under `bench.py gpu-report`, each test's result written as it ends (machinery/gpureport.py)."""
    from machinery import gpureport
    gpureport.record(report)


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory):
    """The embedded demo corpus (stdlib docstrings, its own small BPE), prepared once per test session."""
    import data
    from machinery import datacli
    out = tmp_path_factory.mktemp("data") / "demo"
    datacli.prepare_demo(data.prepare, str(out))
    return str(out)


@pytest.fixture
def small_disk(tmp_path):
    """mount(size, name, options) -> a folder on a real tmpfs of `size` (e.g. "1m"; `options` such as "ro"):
    a disk that really fills up, unmounted after the test. Skips, saying why, where it cannot mount one."""
    import shutil
    import subprocess
    mounted = []

    def mount(size, name="disk", options=""):
        folder = tmp_path / name
        folder.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(filter(None, [f"size={size}", options])),
                                 "tmpfs", str(folder)],
                                capture_output=True, text=True) if shutil.which("mount") else None
        if result is None or result.returncode:
            pytest.skip(f"cannot mount a {size} tmpfs here, so no real full disk "
                        f"({result.stderr.strip()[:100] if result else 'no mount command'})")
        mounted.append(folder)
        return folder
    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)
