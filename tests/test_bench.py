"""bench.py runs on a CPU (tiny preset), so CI exercises the code that produces the GPU table; gpu-report's
markdown is built here from a real pytest JUnit file and real bench rows (only the GPU itself is a double)."""
import argparse
import contextlib
import importlib.util
import io
import json
import re
import subprocess
import sys

import pytest
import torch

import bench
from conftest import ROOT
from machinery.cli import InputError, run

pytest.importorskip("transformers")

# micro-tokens 2**45: a batch no allocator gives (256 TiB of ids), an OOM row among the measured ones
TINY = ["--device=cpu", "--warmup=1", "--steps=1", "--presets=tiny", "--seq_lens=160", f"--micro_tokens=320,{2**45}"]
OOM_MICRO = 2**45 // 160
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
def train_bench(tmp_path_factory):
    """`bench.py train` on the tiny preset on the CPU, once: (what it printed, the rows it wrote with --json)."""
    rows = tmp_path_factory.mktemp("train") / "rows.json"
    threads = torch.get_num_threads()  # the bench sets its own; the tests after this one keep theirs
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        bench.main(["train", *TINY, f"--json={rows}"])
    torch.set_num_threads(threads)
    return stdout.getvalue(), json.loads(rows.read_text())


# gpu-report's training rows on a CPU: the tiny preset, a lever against today's step, a row against transformers
CPU_TODAY = bench.Setting("tiny", "mlm", 160, 2, "sdpa", compile="none", peer=False)
CPU_LEVERS = [("today's step", CPU_TODAY),
              ("a bf16 residual stream", bench.dataclasses.replace(CPU_TODAY, residual="bf16")),
              ("against transformers", bench.dataclasses.replace(CPU_TODAY, phase="clm", peer=True))]


def suite_folder(tmp):
    """A small pytest suite (pass, fail, skip, error) standing in for the gpu suite, with the hook that records each
    result (tests/conftest.py's, which a suite outside tests/ does not load). Returns its command."""
    (tmp / "test_suite.py").write_text(SUITE)
    (tmp / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                                     "from machinery.gpureport import record as pytest_runtest_logreport\n")
    (tmp / "pytest.ini").write_text("[pytest]\n")
    return f"python -m pytest {tmp / 'test_suite.py'} -c {tmp / 'pytest.ini'} -p no:cacheprovider"


def cpu_gpu_report(tmp, **patches):
    """gpu-report on a CPU with doubles for the GPU's parts: the small suite, CPU_LEVERS, a small attention layer.
    Returns (exit status, what it printed, the markdown, the suite's command)."""
    suite = suite_folder(tmp)
    threads = torch.get_num_threads()
    args = bench.parser().parse_args(["gpu-report", f"--out={tmp / 'report.md'}", "--threads=1", "--minutes=5"])
    args.device, args.workers = torch.device("cpu"), 1
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as stdout:
        for name, value in {**dict(SUITE=suite, LEVERS=CPU_LEVERS, ATTENTION=dict(B=1, T=64, H=2, D=16)),
                            **patches}.items():
            mp.setattr(bench, name, value)
        mp.setattr(bench.gpureport, "environment", lambda device: [("GPU", f"none: {device} | a test double")])
        status = bench.gpu_report(args)
    torch.set_num_threads(threads)
    return status, stdout.getvalue(), (tmp / "report.md").read_text(), suite


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return cpu_gpu_report(tmp_path_factory.mktemp("report"))


@pytest.mark.slow  # the tiny preset trained on the CPU by bench.py: about 10 s
def test_bench_train_prints_the_table_and_the_losses_agree(train_bench):
    stdout, rows = train_bench
    lines = [line.split("|") for line in stdout.splitlines() if line.startswith("tiny")]
    assert [line[0].split()[1] for line in lines] == [r["phase"] for r in rows] == ["clm", "clm", "mlm", "mlm"]
    assert [r["micro"] for r in rows] == [2, OOM_MICRO] * 2 and [r["ours"] == "OOM" for r in rows] == [False, True] * 2
    assert f"note: out of memory on cpu in 2 of 4 rows (tiny clm {OOM_MICRO} x 160, tiny mlm {OOM_MICRO} x 160 " \
        "tokens): lower --micro_tokens or --seq_lens, or choose smaller --presets" in stdout
    assert all(line[1].split()[0] == "OOM" and line[-1].split() == ["-", "-"] for line in lines[1::2])
    for line, row in zip(lines[::2], rows[::2]):
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
    (["train", f"--json={ROOT}"], "--json"),  # a folder: found before the bench, not when it writes the rows
    (["train", "--json=/proc/rows.json"], "--json"),  # a folder nothing can be created in
    (["train", "--seq_lens=2"], "--seq_lens"),  # a CLM row of 2 tokens may label none
    (["data", "--corpus=/nonexistent.jsonl"], "--corpus"),
    (["data", f"--corpus={ROOT / 'bench.py'}", f"--tokenizer={ROOT / 'bench.py'}"], "--tokenizer"),
    (["data", f"--corpus={ROOT / 'bench.py'}", "--tokenizer=/nonexistent/tokenizer.json"], "--tokenizer"),
    (["data", "--repeats=0"], "--repeats"),
    (["data", f"--corpus={ROOT / 'bench.py'}", "--tokenizer=bytes"], "--tokenizer"),  # the peer reads a file
    (["data", f"--corpus={ROOT / 'bench.py'}", f"--tokenizer={ROOT}"], "--tokenizer"),
    (["gpu-report", "--out=/nonexistent/dir/report.md"], "--out"),  # before the suite, even before CUDA
    (["gpu-report", f"--out={ROOT}"], "--out"),
    (["gpu-report", "--workers=0"], "--workers"),
]
if not torch.cuda.is_available():  # FlexAttention runs forward on a CPU, but has no backward there
    BAD_FLAGS.append((["train", "--device=cpu", "--backend=flex"], "--backend=flex"))


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


def test_a_bench_where_no_row_fits_is_one_line(capsys):
    """Every row too large for memory (256 TiB of ids): one error line naming the sizes and what to lower, exit 2."""
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as exit:
        run(bench.main, ["train", "--device=cpu", "--presets=tiny", "--phases=clm", "--seq_lens=64",
                         f"--micro_tokens={2**45}", "--threads=1"])
    torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and err.startswith(
        f"error: out of memory on cpu in 1 of 1 rows (tiny clm {2**39} x 64 tokens): lower --micro_tokens or "
        f"--seq_lens, or choose smaller --presets")


def test_gpu_report_without_cuda_is_one_error_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = subprocess.run([sys.executable, str(ROOT / "bench.py"), "gpu-report", f"--out={tmp_path / 'r.md'}"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: gpu-report needs a CUDA device") and result.stderr.count("\n") == 1
    assert not (tmp_path / "r.md").exists()



def test_gpu_report_shares_the_gpu_among_test_processes(monkeypatch, tmp_path):
    """The suite runs in half the cores' test processes, at most 8, where pytest-xdist is installed, and the
    report names the command it ran; without pytest-xdist it runs in one, and --workers=2 is one error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    out = f"--out={tmp_path / 'r.md'}"
    for cores, want in ((1, 1), (2, 1), (16, 8), (64, 8)):
        monkeypatch.setattr(bench, "usable_cores", lambda: cores)
        args = bench.parser().parse_args(["gpu-report", out])
        bench.resolve(args)
        assert args.workers == want, cores
    assert args.device == torch.device("cuda:0")
    ran, resolve, ends = [], bench.resolve, [5]  # the suite's exit status, None where it was stopped
    monkeypatch.setattr(bench.gpureport, "run_suite",
                        lambda cmd, results, seconds: ran.append((cmd, seconds)) or (ends[0], 0.0))
    monkeypatch.setattr(bench.gpureport, "environment", lambda device: [])
    monkeypatch.setattr(bench, "attention_rows", lambda device, **shape: [])
    monkeypatch.setattr(bench, "LEVERS", [])
    args.threads, args.device = 1, torch.device("cpu")
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.gpu_report(args) == 0  # nothing failed, nothing left out
    assert ran == [("python -m pytest -m gpu -rA -n 8", pytest.approx(9 * 60 / 2))]  # half of --minutes=9
    assert "## `python -m pytest -m gpu -rA -n 8`: 0 passed, 0 failed, 0 error, 0 skipped in 0.0 min\n" in (
        tmp_path / "r.md").read_text()
    ends[0] = None
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.gpu_report(args) == 1  # the suite stopped at its limit: the report is incomplete
    assert "0 skipped in 0.0 min; stopped at its time limit: the tests not listed did not run" in (
        tmp_path / "r.md").read_text()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xdist" else real(name, *a))
    args = bench.parser().parse_args(["gpu-report", out])
    resolve(args)
    assert args.workers == 1
    with pytest.raises(InputError, match="^--workers=2: needs pytest-xdist"):
        resolve(bench.parser().parse_args(["gpu-report", out, "--workers=2"]))


def test_under_xdist_the_training_files_come_first_each_whole(monkeypatch):
    """conftest.py moves the files of the longest tests (conftest.FIRST) to the front under pytest-xdist, so that
    none of their seconds-long tests is left queued on one process at the end; each file stays whole (its module
    fixtures are made once) and the rest keeps pytest's order. One process keeps pytest's order."""
    import conftest
    Item = type("Item", (), {"get_closest_marker": lambda self, name: None})
    names = ["test_a.py::x", "test_a.py::y", "test_train.py::z", "test_b.py::w", "test_train_inputs.py::v"]
    for processes, expected in (("1", names), ("2", [names[2], names[4], names[0], names[1], names[3]])):
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", processes)
        items = [Item() for _ in names]
        for item, name in zip(items, names):
            item.nodeid = f"tests/{name}"
        conftest.pytest_collection_modifyitems(None, items)
        assert [item.nodeid.removeprefix("tests/") for item in items] == expected


@pytest.mark.parametrize("processes, tests, long", [(12, 116, 11), (8, 116, 11), (4, 30, 3)])
def test_the_gpu_suite_starts_each_torchrun_test_first_in_a_process_of_its_own(processes, tests, long, monkeypatch):
    """xdist's own load scheduling (the oracle) over the tests as conftest.py orders them under `-n processes`:
    no first hand holds two tests marked torchrun, and each process's first test is one while they last."""
    xdist_load = pytest.importorskip("xdist.scheduler.load")
    import conftest

    class Item:
        def __init__(self, i):
            self.nodeid, self.torchrun = f"t{i}", i % 7 == 3 and i < 7 * long  # spread out, as collected

        def get_closest_marker(self, name):
            return name == "torchrun" and self.torchrun or None

    class Config:
        def getoption(self, name):
            return None  # --maxschedchunk not given

        def getvalue(self, name):
            return [f"{processes}*popen"]  # what -n gives

    class Node:
        gateway = type("Gateway", (), {"id": "gw"})  # named where collections would differ

        def send_runtest_some(self, indices):
            self.hand = indices

        def shutdown(self):
            pass

    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(processes))
    items = [Item(i) for i in range(tests)]
    conftest.pytest_collection_modifyitems(None, items)
    assert sorted(item.nodeid for item in items) == sorted(f"t{i}" for i in range(tests))  # reordered, all kept
    scheduler, nodes = xdist_load.LoadScheduling(Config()), [Node() for _ in range(processes)]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, [item.nodeid for item in items])
    scheduler.schedule()
    hands = [[items[i] for i in node.hand] for node in nodes]
    assert all(sum(item.torchrun for item in hand) <= 1 for hand in hands)
    assert sum(hand[0].torchrun for hand in hands) == min(long, processes)


def byte_tokenizer(tmp_path):
    from machinery.tokenizer import bytes_config
    (tmp_path / "bytes.json").write_text(json.dumps(bytes_config()))
    return tmp_path / "bytes.json"


DOCUMENT = "A clinical case: the patient was admitted with fever, and treated. " * 3
BENCH_CORPORA = [  # (case, file name, its bytes, the words of the one error line; None: it runs)
    (".txt, blank-line separated", "c.txt", "".join(f"{DOCUMENT}Case {i}.\n\n" for i in range(150)), None),
    pytest.param(".jsonl with blank lines", "c.jsonl",
                 "".join(json.dumps({"text": f"{DOCUMENT}Case {i}."}) + "\n\n" for i in range(150)), None,
                 marks=pytest.mark.slow),
    (".jsonl with a broken line", "c.jsonl", '{"text": "a"}\n{"text": \n', ["c.jsonl:2", "JSON object"]),
    (".jsonl without the text field", "c.jsonl", '{"body": "a"}\n', ["c.jsonl:1", "'text'"]),
    (".jsonl not UTF-8", "c.jsonl", '{"text": "caf\udce9"}\n', ["c.jsonl:1", "invalid UTF-8"]),
    (".csv", "c.csv", "text\na\n", ["c.csv", ".jsonl, .txt or .parquet"]),
    ("blank lines only", "c.txt", "\n\n\n", ["--corpus=", "c.txt: no documents"]),
    ("one document", "c.txt", DOCUMENT, ["--corpus=", "validation split is empty"]),
    ("fewer tokens than a loader sequence", "c.txt", "".join(f"{DOCUMENT}Case {i}.\n\n" for i in range(20)),
     ["--corpus=", "fewer than one 8,192"]),
    ("every document the same text", "c.txt", (DOCUMENT + "\n\n") * 20, ["--corpus=", "copy of a validation one"]),
]


@pytest.mark.parametrize("case, name, content, expected", BENCH_CORPORA,
                         ids=[getattr(c, "values", c)[0] for c in BENCH_CORPORA])
def test_bench_data_reads_a_corpus_as_prepare_does(tmp_path, capsys, case, name, content, expected):
    """`bench.py data` takes what `data.py prepare` takes, with prepare's reader and checks: one error line, exit 2,
    before any timing, or the three measurements (in a process of their own: the loader's bench pins its core)."""
    (tmp_path / name).write_bytes(content.encode("utf-8", "surrogateescape"))
    argv = ["data", f"--corpus={tmp_path / name}", f"--tokenizer={byte_tokenizer(tmp_path)}", "--repeats=1",
            "--threads=1", "--workers=1,2"]
    if expected is None:
        result = subprocess.run([sys.executable, str(ROOT / "bench.py"), *argv], capture_output=True, text=True)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
        out = result.stdout
        tokens = sum(len(f"{DOCUMENT}Case {i}.") + 2 for i in range(150))  # a byte a token, [CLS] and [SEP]
        assert "identical ids 150/150" in out and f"{tokens:,} tokens" in out, out
        rows = {line.split("|")[0].strip(): line for line in out.splitlines() if line.count("|") >= 3}
        assert {"1", "2", "mlm 30%", "clm"} <= rows.keys() and rows["1"].split("|")[2].strip() == "1.00x", out
        assert re.search(r"Amdahl fit T\(n\) = -?[\d.]+ s \+ -?[\d.]+ s / n: serial share", out), out
        assert out.count("PROJECTION (the fit extrapolated, not measured)") == 2, out
        return
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as exit:
        run(bench.main, argv)
    torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    error = err.splitlines()[-1]  # a progress bar of prepare may come before it
    assert exit.value.code == 2 and "Traceback" not in err and err.count("error") == 1, err
    assert error.startswith("error: ") and all(w in error for w in expected), error
    assert "prepare end to end" not in out  # nothing timed


def table_rows(markdown, first_cell):
    """The cells of the markdown table rows whose first cell starts with first_cell ('\\|' stays in its cell)."""
    rows = [re.split(r"(?<!\\)\|", line)[1:-1] for line in markdown.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r] for r in rows if r[0].strip().startswith(first_cell)]


@pytest.mark.slow  # the small suite in a process, and three tiny training rows: about 20 s
def test_gpu_report_writes_the_suite_the_kernels_and_the_levers_in_one_file(report):
    status, _, markdown, suite = report
    assert status == 1  # a test failed
    assert markdown.startswith("# GPU acceptance, 20") and "| GPU | none: cpu \\| a test double |" in markdown
    assert f"## `{suite}`: 2 passed, 2 failed, 1 error, 1 skipped in " in markdown
    tests = {row[0]: row for row in table_rows(markdown, "test_suite::")}
    assert {name: row[1] for name, row in tests.items()} == OUTCOMES
    assert tests["test_suite::test_skipped"][3] == "needs a CUDA device"
    assert "arithmetic \\| broke" in tests["test_suite::test_fails"][3]
    assert "the fixture broke" in tests["test_suite::test_errors"][3]
    assert all(float(row[2]) >= 0 for row in tests.values())

    kernels = table_rows(markdown, "global") + table_rows(markdown, "local")
    assert [(layer, kernel) for layer, kernel, *_ in kernels] == [  # on a CPU: SDPA alone trains
        ("global, bidirectional", "sdpa"), ("global, causal", "sdpa"), ("local, bidirectional", "sdpa"),
        ("local, causal", "sdpa")]
    ms, speed = float(kernels[0][2]), float(kernels[0][3])
    assert speed == pytest.approx(12 * 2 * 16 * 64 * 64 / (ms / 1e3) / 1e12, abs=0.5)  # 12 d per key and token

    rows = {r[0]: r for r in table_rows(markdown, "today") + table_rows(markdown, "a bf16")
            + table_rows(markdown, "against")}
    today, lever, peer = rows["today's step"], rows["a bf16 residual stream"], rows["against transformers"]
    assert today[11] == "-" and float(lever[11].rstrip("x")) == pytest.approx(
        float(lever[8].replace(",", "")) / float(today[8].replace(",", "")), abs=0.01)  # against today's step
    assert lever[7] == "bf16" and today[7] == "fp32" and today[6] == "deterministic" and today[4] == "plain"
    assert peer[12] == "sdpa+causal mask" and peer[14].endswith("x")
    ours_loss, peer_loss = map(float, peer[15].split(" / "))
    assert abs(ours_loss - peer_loss) <= 1e-3  # the same computation on the same batch


def test_the_reports_code_line_names_the_files_themselves(monkeypatch):
    """The report's "code" row: the commit as git says it, and the digest of the files, which still names the code
    where a copy's git metadata is stale (a device machine's copy of a working tree) or absent."""
    from machinery.cli import source_digest
    digest = source_digest()[:16]
    assert bench.gpureport.code_line().endswith(f"; source digest {digest}")
    monkeypatch.setattr(bench.gpureport, "git", lambda *args: "")  # no git at all
    assert bench.gpureport.code_line() == f"no git commit; source digest {digest}"


def test_gpu_report_runs_what_fits_in_its_time(tmp_path):
    """Training rows that would end past --minutes are listed as not run, and the report fails (it is incomplete)."""
    status, stdout, markdown, _ = cpu_gpu_report(tmp_path, ROW_SECONDS=10**9, SUITE="python -c pass")
    assert status == 1 and "today's step: not run (time)" in stdout
    assert len([row for row in table_rows(markdown, "") if "not run: the time limit" in row]) == 3



def test_the_levers_table_compares_each_row_with_todays_step_and_the_peer():
    """levers_section and the train bench's line on rows made up here: a lever's 'vs today's step' is its tok/s over
    today's step's of the same phase and length ('-' for today's step itself, and where no such step ran), the ratio
    is ours over transformers', and rows failed or not run say so."""
    ours = lambda speed, mfu, gib: dict(tokens_per_s=speed, ms=1.0, mfu=mfu, memory_gb=gib)  # noqa: E731
    today = dict(preset="base", phase="mlm", seq_len=8192, micro=4, backend="flex", loss="plain", compile="blocks",
                 deterministic=True, residual="fp32", ours=ours(100_000, 0.4, 30.0), peer_attention="-", peer=None,
                 loss_ours=10.5, loss_peer=None)
    rows = [("today's step", today),
            ("--backend=flex+sdpa", {**today, "backend": "flex+sdpa", "ours": ours(125_000, 0.5, 28.04)}),
            ("a clm lever", {**today, "phase": "clm", "ours": ours(90_000, 0.36, 29.0)}),
            ("against transformers", {**today, "seq_len": 1024, "micro": 32, "peer_attention": "sdpa",
                                      "peer": ours(80_000, 0.32, 20.0), "loss_peer": 10.50013}),
            ("--backend=flash", {**today, "backend": "-", "ours": "failed: RuntimeError"}),
            ("inductor times its kernels", None)]
    table = bench.levers_section(rows, argparse.Namespace(warmup=3, steps=10))
    got = {r[0]: r for r in table_rows(table, "")}
    assert got["today's step"][8:12] == ["100,000", "40.0%", "30.0", "-"]
    assert got["--backend=flex+sdpa"][8:12] == ["125,000", "50.0%", "28.0", "1.25x"]
    assert got["a clm lever"][11] == "-" and got["against transformers"][11] == "-"  # no today's step to compare
    assert got["against transformers"][12:] == ["sdpa", "80,000", "1.25x", "10.5000 / 10.5001"]
    assert got["--backend=flash"][8] == "failed: RuntimeError" and got["--backend=flash"][14] == "-"
    assert "not run: the time limit" in got["inductor times its kernels"]
    line = bench.format_row(rows[3][1]).split("|")
    assert line[1].split() == ["100,000", "40.0%", "30.0"] and line[-2].strip() == "1.25x"
    assert line[2].split() == ["80,000", "32.0%", "20.0", "sdpa"] and line[-1].split() == ["10.5000", "10.5001"]


def test_attention_kernels_count_the_keys_each_query_sees():
    """The TFLOP/s of gpu-report's attention rows, on a CPU at 64 tokens and a window of 8: 12 d FLOPs per key and
    query, forward and backward, over the keys a query sees: all 64 in a global layer, (64 + 1) / 2 on average when
    causal, 2 x 8 + 1 in a local one and 8 + 1 when causal (the edges' shorter windows left out, as
    model.flops_per_token leaves them); a window wider than the sequence, a global layer's keys."""
    B, T, H, D = 1, 64, 2, 16
    keys = {"global, bidirectional": 64, "global, causal": 32.5, "local, bidirectional": 17, "local, causal": 9}
    rows = bench.attention_rows(torch.device("cpu"), B, T, H, D, window=8, warmup=0, repeats=1)
    assert [layer for layer, *_ in rows] == list(keys)  # on a CPU, SDPA alone trains
    for layer, kernel, ms, speed in rows:
        assert speed * 1e12 * ms / 1e3 == pytest.approx(12 * D * H * keys[layer] * B * T, rel=1e-9), layer
    wide = bench.attention_rows(torch.device("cpu"), B, T, H, D, window=40, warmup=0, repeats=1)  # past both ends
    for (layer, kernel, ms, speed), every in zip(wide, (64, 32.5, 64, 32.5)):
        assert speed * 1e12 * ms / 1e3 == pytest.approx(12 * D * H * every * B * T, rel=1e-9), layer


def test_the_bench_rows_count_their_tokens_and_flops(monkeypatch):
    """One timed step of the tiny model per phase on a CPU, MFU against a made-up peak of 1 TFLOP/s: tokens/s is the
    micro-batch's tokens over the median step; MFU is model.flops_per_token (counted by hand in test_model.py) at
    the rate the batch labels (30% for MLM, every position for CLM) times tokens/s, over the peak."""
    import train
    from model import ModernBERT, ModernBERTConfig
    monkeypatch.setattr(train, "peak_flops", lambda device: 1e12)
    cpu = torch.device("cpu")
    args = argparse.Namespace(device=cpu, warmup=0, steps=1, peer_attention="auto")
    x, y = bench.batch(50368, 64, 256, "mlm", cpu)
    assert (y != -100).float().mean().item() == pytest.approx(0.3, abs=0.015) and ((y == x) | (y == -100)).all()
    x, y = bench.batch(50368, 2, 64, "clm", cpu)
    assert torch.equal(y[:, :-1], x[:, 1:]) and (y[:, -1] == -100).all()  # the next token
    for phase, rate in (("mlm", 0.3), ("clm", 1.0)):
        row = bench.measure(args, bench.Setting("tiny", phase, 64, 2, "sdpa", compile="none", peer=False))
        flops = ModernBERT(ModernBERTConfig.from_preset("tiny")).flops_per_token(64, phase == "clm", rate)
        speed = row["ours"]["tokens_per_s"]
        assert row["tokens"] == 128 and speed * row["ours"]["ms"] / 1e3 == pytest.approx(128, rel=1e-9)
        assert row["ours"]["mfu"] == pytest.approx(flops * speed / 1e12, rel=1e-9), phase


def test_transformers_gets_the_causal_masks_our_model_computes():
    """The masks bench.py hands transformers' ModernBERT for CLM (it has no causal mode) are model.py's mask_rule:
    causal in the global layers, causal within the window in the local ones (True: the key is seen)."""
    from model import mask_rule
    T, window = 20, 4
    i = torch.arange(T)
    masks = bench.causal_masks(T, window, torch.device("cpu"))
    for kind, local in (("full_attention", False), ("sliding_attention", True)):
        want = mask_rule(True, window, local)(0, None, i[:, None], i[None, :])
        assert masks[kind].shape == (1, 1, T, T) and torch.equal(masks[kind][0, 0], want), kind


def test_the_loss_rows_time_the_loss_they_name(monkeypatch, capsys):
    """bench.py loss: the row labelled plain timed model.py's cross_entropy and the row labelled fused the chunked
    kernel, each alone, and both computed torch's cross-entropy of the decoder's logits on the same head outputs
    (run in this process at a tiny size: the CPU path's fresh process per pass is replaced by a direct call)."""
    import model
    from machinery import kernels
    ran = []

    def spy(name, real):
        def call(h, weight, bias, targets):
            value = real(h, weight, bias, targets)
            oracle = torch.nn.functional.cross_entropy(h.detach() @ weight.detach().T + bias.detach(), targets)
            ran.append((name, h.shape[0], value.item(), oracle.item()))
            return value
        return call
    monkeypatch.setattr(model, "cross_entropy", spy("plain", model.cross_entropy))
    monkeypatch.setattr(kernels, "linear_cross_entropy", spy("fused", kernels.linear_cross_entropy))
    passes = []

    def loss_pass(loss, *work):  # the CUDA branch's direct call, run on the CPU
        ran.clear()
        result = real_pass(loss, *work[:3], torch.device("cpu"), *work[4:])
        passes.append((loss, {name for name, *_ in ran}))
        full = [(v, o) for _, rows, v, o in ran if rows == 40]  # the timed passes (an 8-row one warms up)
        assert full and all(v == pytest.approx(o, rel=1e-5) for v, o in full), ran
        return result
    real_pass = bench.loss_pass
    monkeypatch.setattr(bench, "loss_pass", loss_pass)
    args = argparse.Namespace(rows=[40], hidden=16, vocab=96, device=argparse.Namespace(type="cuda"), repeats=1,
                              threads=1)
    rows = bench.loss_bench(args)
    assert passes == [("plain", {"plain"}), ("fused", {"fused"})]
    assert [r["loss"] for r in rows] == ["plain", "fused"] and all(r["rows"] == 40 for r in rows)


def test_each_tests_result_is_recorded_as_it_ends(tmp_path, monkeypatch):
    """gpureport.record on pytest's reports (made up here): a test's call gives its outcome, a failure in a fixture
    is an error, a skip at setup is a skip; the note is the skip's reason, the failure's first 'E' line, or the
    properties a test recorded; an xdist worker writes nothing (its controller reports its tests). suite_section
    counts them and keeps each note inside its table cell."""
    from types import SimpleNamespace as Report
    gpureport = bench.gpureport
    monkeypatch.setenv(gpureport.RESULTS, str(tmp_path / "results.jsonl"))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    base = dict(duration=1.5, user_properties=[], longrepr=None, longreprtext="", skipped=False, failed=False)
    reports = [
        dict(nodeid="tests/test_x.py::test_a", when="call", outcome="passed", user_properties=[("tok/s", 123)]),
        dict(nodeid="tests/test_x.py::test_b", when="call", outcome="failed", failed=True,
             longreprtext=">   assert x == 'a|b'\nE   assert 1 == 'a|b'\nE   more"),
        dict(nodeid="tests/test_x.py::test_c", when="setup", outcome="skipped", skipped=True,
             longrepr=("f.py", 3, "Skipped: needs a CUDA device")),
        dict(nodeid="tests/test_x.py::test_d", when="setup", outcome="failed", failed=True,
             longreprtext="E   RuntimeError: the fixture broke"),
        dict(nodeid="tests/test_x.py::test_d", when="teardown", outcome="passed"),
        dict(nodeid="tests/test_x.py::test_e", when="call", outcome="skipped", skipped=True,
             longrepr=("f.py", 9, "Skipped: no flash-attn"))]
    for report in reports:
        gpureport.record(Report(**{**base, **report}))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    gpureport.record(Report(**{**base, **reports[0]}))
    results = gpureport.suite_results(tmp_path / "results.jsonl")
    assert results == [("test_x::test_a", "passed", 1.5, "tok/s: 123"),
                       ("test_x::test_b", "failed", 1.5, "assert 1 == 'a|b'"),
                       ("test_x::test_c", "skipped", 1.5, "needs a CUDA device"),
                       ("test_x::test_d", "error", 1.5, "RuntimeError: the fixture broke"),
                       ("test_x::test_e", "skipped", 1.5, "no flash-attn")]
    section = gpureport.suite_section(results, "cmd", 120, stopped=False)
    assert section.startswith("## `cmd`: 1 passed, 1 failed, 1 error, 2 skipped in 2.0 min\n")
    assert "| test_x::test_b | failed | 1.5 | assert 1 == 'a\\|b' |" in section
    assert gpureport.cell("x" * 300) == "x" * 197 + "..." and gpureport.cell("a\n  b") == "a b"

def test_the_prepare_table_fits_amdahl_and_projects_the_fit(capsys):
    """print_prepare on times that follow T(n) = 2 s + 6 s / n exactly (1,000,000 tokens): the speed-ups, ours over
    the peer's, the fit's two terms and serial share (2 / 8), and the projection of the fit to 32 and 64 cores;
    worker_counts: the powers of two up to the cores, and the cores."""
    bench.print_prepare([1, 2, 4], [8.0, 5.0, 3.5], [4.0, 10.0, 7.0], 1_000_000)
    out = capsys.readouterr().out
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in out.splitlines()
            if line.count("|") == 4}
    assert rows["1"][1:] == ["125,000", "1.00x", "250,000", "0.50x"]
    assert rows["4"][1:] == ["285,714", "2.29x", "142,857", "2.00x"]
    assert "Amdahl fit T(n) = 2.000 s + 6.000 s / n: serial share 25.0% of the one-worker time" in out
    for n in (32, 64):
        rate = 1_000_000 / (2 + 6 / n)
        assert f"{n} cores {rate:,.0f} tokens/s, 10B tokens in {10e9 / rate / 60:.1f} min" in out
    assert [bench.worker_counts(n) for n in (1, 2, 6, 8)] == [[1], [1, 2], [1, 2, 4, 6], [1, 2, 4, 8]]


@pytest.mark.slow  # a pytest process stopped at its limit of 20 s
def test_a_suite_past_its_time_is_stopped_with_what_ran(tmp_path):
    """gpu-report's suite runs in a session of its own: stopped at its limit (SIGINT, then SIGKILL), the results of
    the tests that ended before are kept, and a process the suite started in a session of its own (as torchrun
    starts its workers) is stopped too."""
    suite = suite_folder(tmp_path)
    (tmp_path / "test_suite.py").write_text(
        "import subprocess, time\n\ndef test_quick():\n    pass\n\n"
        "def test_slow():\n    worker = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        f"    open({str(tmp_path / 'worker')!r}, 'w').write(str(worker.pid))\n    time.sleep(600)\n")
    code, seconds = bench.gpureport.run_suite(suite, tmp_path / "results.jsonl", 20)
    assert code is None and seconds < 80
    worker = int((tmp_path / "worker").read_text())
    with contextlib.suppress(FileNotFoundError):  # gone, or a zombie until its new parent reaps it
        assert open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    assert [r[:2] for r in bench.gpureport.suite_results(tmp_path / "results.jsonl")] == [("test_suite::test_quick",
                                                                                          "passed")]


def lever_step(model, bf16):
    """The loss and every gradient of one step of the tiny model on a fixed batch, fp32 or under CPU bf16 autocast."""
    from model import IGNORE_INDEX
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 160), generator=g)
    labels = torch.where(torch.rand(2, 160, generator=g) < 0.3, ids, IGNORE_INDEX)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = model(ids, labels=labels)[1]
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def test_a_bf16_residual_stream_holds_the_fp32_step_within_bf16_rounding():
    """A lever gpu-report times, on a CPU under bf16 autocast against the fp32 step on the same weights and batch,
    within the GPU suite's bf16 tolerance (loss within 1%, each gradient within cosine 0.99 and norm 5%); and the
    stream between the blocks is bf16 (the lever does what it says)."""
    from conftest import tiny_model
    from test_gpu import assert_close_in_bf16
    model, seen = tiny_model().train(), []
    bench.bf16_residual(model)
    model.model.layers[1].register_forward_hook(lambda module, inputs, out: seen.append(out.dtype))
    assert_close_in_bf16(lever_step(model, bf16=True), lever_step(tiny_model().train(), bf16=False), "bf16 residual")
    assert seen == [torch.bfloat16]


@pytest.mark.slow  # dynamo traces the whole encoder: about 20 s
def test_the_whole_encoder_compiled_holds_the_fp32_step_within_bf16_rounding():
    """The lever of one graph for the whole encoder (dynamo's graphs run by aot_eager: the GPU's graphs without C++
    code generation), as above."""
    from conftest import tiny_model
    from test_gpu import assert_close_in_bf16
    model = tiny_model().train()
    bench.compile_encoder(model, backend="aot_eager")
    torch._dynamo.reset()
    try:
        assert_close_in_bf16(lever_step(model, bf16=True), lever_step(tiny_model().train(), bf16=False), "compiled")
    finally:
        torch._dynamo.reset()


def test_the_gpu_figures_in_the_docs_are_the_reports():
    """docs/gpu.md's figures of 2026-11-28 (the attention kernels, the levers, transformers at 1,024 tokens, the
    report's minutes) are read from the report gpu-report wrote, cell by cell, never typed from memory."""
    docs = (ROOT / "docs" / "gpu.md").read_text()
    report = (ROOT / "docs" / "gpu-h200" / "report-2026-11-28.md").read_text()
    section = docs[docs.index("**The step's levers, measured"):docs.index("**Where that leaves the step.**")]
    kernels = {(row[0], row[1]): row[2:] for row in table_rows(report, "global") + table_rows(report, "local")}
    columns = ["flex", "flash", "sdpa", "sdpa: cuDNN", "sdpa: its flash kernel", "sdpa: memory-efficient"]
    for row in table_rows(section, "global") + table_rows(section, "local"):
        for kernel, text in zip(columns, row[1:]):
            if text != "-":  # "9.45 ms, 261.7": the report's ms and TFLOP/s
                ms, speed = re.fullmatch(r"(?:\(dense mask\) )?([\d.]+) ms, ([\d.]+)", text).groups()
                assert [ms, speed] == kernels[row[0], kernel], (row[0], kernel, text)
    levers = {(r[0], r[1]): r for r in table_rows(report, "") if len(r) == 15}
    names = {"--backend=flash (PyTorch's kernel)": "--backend=flash",
             "the whole encoder compiled, not each block": "the whole encoder compiled",
             "inductor times its kernels (no deterministic mode)": "inductor times its kernels"}
    mine = [r for r in table_rows(section, "") if len(r) == 6 and r[0] != "row"]
    assert len(mine) == 8
    for label, phase, speed, mfu, gib, versus in mine:
        want = levers[names.get(label, label), phase]
        assert [speed, mfu, gib, versus] == [want[7], want[8], want[9], want[10]], (label, want)
    for phase, words in (("mlm", "MLM {} against\n{} tokens/s ({})"), ("clm", "CLM {} against {} ({})")):
        want = levers["against transformers", phase]
        assert words.format(want[7], want[12], want[13]) in section, phase
    minutes = re.search(r"`: ([\d.]+) minutes in all", report).group(1)
    suite = re.search(r"-n 12`: .* in ([\d.]+) min", report).group(1)
    assert f"**Measured:** {minutes} minutes on an H200 (16 cores), the\nsuite in {suite} of them" in docs
