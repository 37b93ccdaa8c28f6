"""bench.py runs on a CPU (tiny preset), so CI exercises the code that produces the GPU table; gpu-report's
markdown is built here from a real pytest JUnit file and real bench rows (only the GPU itself is a double)."""
import contextlib
import io
import json
import re
import subprocess
import sys

import pytest
import torch

import bench
from conftest import ROOT
from machinery.cli import run

pytest.importorskip("transformers")

TINY = ["--device=cpu", "--warmup=1", "--steps=1", "--presets=tiny", "--seq_lens=160", "--micro_tokens=320"]
SUITE = '''
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 1 + 1 == 3, "arithmetic | broke"

@pytest.mark.skip(reason="needs a CUDA device")
def test_skipped():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1

@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")

def test_errors(broken):
    pass
'''
OUTCOMES = {"test_suite::test_passes": "passed", "test_suite::test_fails": "failed",
            "test_suite::test_skipped": "skipped", "test_suite::test_param[1]": "passed",
            "test_suite::test_param[2]": "failed", "test_suite::test_errors": "error"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """gpu-report, run once on a CPU with two doubles: a small pytest suite (pass, fail, skip, error) for the gpu
    suite, and `bench.py train` on the tiny preset on the CPU for the GPU bench. Returns (exit status, what it
    printed, the markdown file, the bench rows it wrote with --json, the two commands)."""
    tmp = tmp_path_factory.mktemp("report")
    (tmp / "test_suite.py").write_text(SUITE)
    (tmp / "pytest.ini").write_text("[pytest]\n")
    threads = torch.get_num_threads()  # the bench sets its own; the tests after this one keep theirs
    suite = f"python -m pytest {tmp / 'test_suite.py'} -c {tmp / 'pytest.ini'} -p no:cacheprovider"
    train = "python bench.py train " + " ".join(TINY) + f" --json={tmp / 'rows.json'}"
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as stdout:
        mp.setattr(bench, "SUITE", suite)
        mp.setattr(bench, "BENCH", train)
        mp.setattr(bench, "environment", lambda device: [("GPU", f"none: {device} | a test double")])
        status = bench.gpu_report(bench.parser().parse_args(["gpu-report", f"--out={tmp / 'report.md'}",
                                                             "--threads=1"]))
    torch.set_num_threads(threads)
    rows = json.loads((tmp / "rows.json").read_text())
    return status, stdout.getvalue(), (tmp / "report.md").read_text(), rows, suite, train


def test_bench_train_prints_the_table_and_the_losses_agree(report):
    _, stdout, _, rows, *_ = report
    lines = [line.split("|") for line in stdout.splitlines() if line.startswith("tiny")]
    assert [line[0].split()[1] for line in lines] == [r["phase"] for r in rows] == ["clm", "mlm"]
    for line, row in zip(lines, rows):
        ratio = row["ours"]["tokens_per_s"] / row["peer"]["tokens_per_s"]
        assert line[-2].strip() == f"{ratio:.2f}x"  # the ratio to the peer, as the JSON has it
        ours, peer = map(float, line[-1].split())
        assert abs(ours - peer) <= 1e-4 * abs(peer)  # the same computation: same loss on the same batch
        assert row["ours"]["memory_gb"] is None and row["ours"]["mfu"] is None  # no allocator, no peak on a CPU
    assert "1 threads" in stdout.splitlines()[0]
    prediction = [line for line in stdout.splitlines() if line.startswith("PREDICTION")]
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
    (["train", "--steps=2", "--steps=3"], "--steps"),
    (["train", "--json=/nonexistent/dir/rows.json"], "--json"),
    (["data", "--corpus=/nonexistent.jsonl"], "--corpus"),
    (["data", f"--corpus={ROOT / 'bench.py'}", f"--tokenizer={ROOT / 'bench.py'}"], "--tokenizer"),
    (["data", f"--corpus={ROOT / 'bench.py'}", "--tokenizer=/nonexistent/tokenizer.json"], "--tokenizer"),
    (["data", "--repeats=0"], "--repeats"),
    (["gpu-report", "--out=/nonexistent/dir/report.md"], "CUDA"),  # no CUDA is the first thing it says here
]


@pytest.mark.parametrize("argv, flag", BAD_FLAGS)
def test_bad_flags_are_one_line_errors(capsys, argv, flag):
    if flag == "CUDA" or "--device=cuda" in argv:
        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit) as exit:
        run(bench.main, argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and flag in err and "Traceback" not in err


def test_gpu_report_without_cuda_is_one_error_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = subprocess.run([sys.executable, str(ROOT / "bench.py"), "gpu-report", f"--out={tmp_path / 'r.md'}"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: gpu-report needs a CUDA device") and result.stderr.count("\n") == 1
    assert not (tmp_path / "r.md").exists()



def table_rows(markdown, first_cell):
    """The cells of the markdown table rows whose first cell starts with first_cell ('\\|' stays in its cell)."""
    rows = [re.split(r"(?<!\\)\|", line)[1:-1] for line in markdown.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r] for r in rows if r[0].strip().startswith(first_cell)]


def test_gpu_report_writes_the_suite_and_the_bench_in_one_file(report):
    status, _, markdown, rows, suite, train = report
    assert status == 1  # a test failed
    assert markdown.startswith("# GPU acceptance, 20") and "| GPU | none: cpu \\| a test double |" in markdown
    assert f"## `{suite}`: 2 passed, 2 failed, 1 error, 1 skipped in " in markdown
    tests = {row[0]: row for row in table_rows(markdown, "test_suite::")}
    assert {name: row[1] for name, row in tests.items()} == OUTCOMES
    assert tests["test_suite::test_skipped"][3] == "needs a CUDA device"
    assert "arithmetic \\| broke" in tests["test_suite::test_fails"][3]
    assert "the fixture broke" in tests["test_suite::test_errors"][3]
    assert all(float(row[2]) >= 0 for row in tests.values())

    assert f"## `{train}`: ours against transformers" in markdown
    cells = table_rows(markdown, "tiny")
    assert len(cells) == 2 and all(len(row) == 13 for row in cells)
    for row, (_, phase, seq, attn, ours, mfu, gib, peer_attn, peer, *_, ratio, losses) in zip(rows, cells):
        assert (phase, seq, attn, peer_attn, mfu, gib) == (row["phase"], "160 x 2", "sdpa", "sdpa", "-", "-")
        assert ours == f"{row['ours']['tokens_per_s']:,.0f}" and peer == f"{row['peer']['tokens_per_s']:,.0f}"
        ours_loss, peer_loss = map(float, losses.split(" / "))
        assert ours_loss == pytest.approx(row["loss_ours"], abs=1e-4) and abs(ours_loss - peer_loss) <= 1e-3
        assert ratio == f"{row['ours']['tokens_per_s'] / row['peer']['tokens_per_s']:.2f}x"
