"""bench.py runs on a CPU (tiny preset), so CI exercises the code that produces the GPU table."""
import subprocess
import sys

import pytest

import bench
from conftest import ROOT

pytest.importorskip("transformers")


def test_bench_train_prints_the_table_and_the_losses_agree():
    result = subprocess.run([sys.executable, str(ROOT / "bench.py"), "train", "--device=cpu", "--warmup=1", "--steps=1",
                             "--presets=tiny", "--seq_lens=160", "--micro_tokens=320", "--threads=1"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("tiny")]
    assert [r[0].split()[1] for r in rows] == ["clm", "mlm"]
    for row in rows:
        assert row[-2].strip().endswith("x")  # the ratio to the peer
        ours, peer = map(float, row[-1].split())
        assert abs(ours - peer) <= 1e-4 * abs(peer)  # the same computation: same loss on the same batch
    assert "1 threads" in result.stdout.splitlines()[0]
    prediction = [line for line in result.stdout.splitlines() if line.startswith("PREDICTION")]
    assert len(prediction) == 2 and all("base" in line and "4 x 8192" in line for line in prediction)


BAD_FLAGS = [  # (arguments, what the one-line error must name)
    (["train", "--presets=tiny,foo"], "--presets"),
    (["train", "--steps=0"], "--steps"),
    (["train", "--warmup=-1"], "--warmup"),
    (["train", "--phases=xyz"], "--phases"),
    (["train", "--seq_lens=0"], "--seq_lens"),
    (["train", "--seq_lens=a,b"], "--seq_lens"),
    (["train", "--micro_tokens=-5"], "--micro_tokens"),
    (["train", "--device=foo"], "--device"),
    (["train", "--device=cuda"], "--device"),  # this test machine has no CUDA (skipped where it does)
    (["train", "--backend=flash"], "--backend"),
    (["train", "--backend=xla"], "--backend"),
    (["train", "--peer_attention=magic"], "--peer_attention"),
    (["train", "--compile=maybe"], "--compile"),
    (["train", "--threads=0"], "--threads"),
    (["train", "--json=/nonexistent/dir/rows.json"], "--json"),
    (["data", "--corpus=/nonexistent.jsonl"], "--corpus"),
    (["data", f"--corpus={ROOT / 'bench.py'}", f"--tokenizer={ROOT / 'bench.py'}"], "--tokenizer"),
    (["data", f"--corpus={ROOT / 'bench.py'}", "--tokenizer=/nonexistent/tokenizer.json"], "--tokenizer"),
    (["data", "--repeats=0"], "--repeats"),
]


@pytest.mark.parametrize("argv, flag", BAD_FLAGS)
def test_bad_flags_are_one_line_errors(monkeypatch, capsys, argv, flag):
    import torch
    if "--device=cuda" in argv and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    with pytest.raises(SystemExit) as exit:
        bench.main()
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and flag in err and "Traceback" not in err

