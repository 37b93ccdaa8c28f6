"""bench.py runs on a CPU (tiny preset), so CI exercises the code that produces the GPU table."""
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("transformers")


def test_bench_train_prints_the_table_and_the_losses_agree():
    result = subprocess.run([sys.executable, str(ROOT / "bench.py"), "train", "--device=cpu", "--warmup=1", "--steps=1",
                             "--seq_lens=160", "--micro_tokens=320"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("tiny")]
    assert [r[0].split()[1] for r in rows] == ["clm", "mlm"]
    for row in rows:
        assert row[-2].strip().endswith("x")  # the ratio to the peer
        ours, peer = map(float, row[-1].split())
        assert abs(ours - peer) <= 1e-4 * abs(peer)  # the same computation: same loss on the same batch
