"""bench.py gpu-report's plumbing: the GPU suite run in a process of its own within a time limit, each test's result
as it ends, the machine and versions, and the markdown sections. A reader of the recipe may skip this file."""
import contextlib
import datetime
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from machinery.cli import source_digest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "GPU_REPORT_RESULTS"  # where tests/conftest.py appends each test's result as it ends (one JSON a line)


def run_suite(command, results, seconds):
    """Runs `command` (the gpu suite) in a session of its own for at most `seconds`, each test's result appended to
    the file `results` as it ends: a suite stopped at its limit still says what ran. Returns (exit status or None
    where it was stopped, seconds it ran)."""
    start = time.monotonic()
    # inductor's compile workers: a couple per test process, so that the processes share the cores
    # a pytest session of its own: an xdist worker's variables, where a test runs this, would make the suite's
    # controller think itself a worker, which records nothing (record)
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "2", **outer, RESULTS: str(results)}
    words = command.split()
    words[0] = sys.executable if words[0] == "python" else words[0]  # this interpreter, whatever PATH says
    process = subprocess.Popen(words, cwd=ROOT, env=env, start_new_session=True)
    try:
        return process.wait(timeout=max(1.0, seconds)), time.monotonic() - start
    except subprocess.TimeoutExpired:
        # torchrun starts its workers in sessions of their own, beyond the group's signals: a training left running
        # would share the GPU with the benchmarks that follow
        below = descendants(process.pid)
        for sig, grace in ((signal.SIGINT, 20), (signal.SIGKILL, 20)):  # pytest ends on SIGINT, workers too
            os.killpg(process.pid, sig)
            try:
                process.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return None, time.monotonic() - start


def children(pid):
    """The processes whose parent is `pid` (Linux /proc: the 4th field of /proc/N/stat, after the name)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def descendants(pid):
    """Every process below `pid`: its children, theirs, and so on."""
    found = children(pid)
    for child in list(found):
        found += descendants(child)
    return found


def record(report):
    """tests/conftest.py's hook: one test's outcome as a JSON line, where RESULTS names a file (the controller of an
    xdist run reports every worker's tests; the workers themselves write nothing)."""
    path = os.environ.get(RESULTS)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when == "call":
        outcome = report.outcome  # passed, failed, or skipped inside the test
    elif report.failed:
        outcome = "error"  # in a fixture, before or after the test
    elif report.skipped and report.when == "setup":
        outcome = "skipped"
    else:
        return
    note = ""
    if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: reason")
        note = report.longrepr[2].removeprefix("Skipped: ")
    elif report.failed:
        text = report.longreprtext.strip().splitlines()
        note = next((line[1:].strip() for line in text if line.startswith("E ")), text[-1] if text else "")
    line = dict(test=report.nodeid, outcome=outcome, seconds=report.duration, note=note,
                properties=dict(report.user_properties))
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def suite_results(path):
    """[(test, outcome, seconds, note)] read back from the results file; outcome passed, failed, error or skipped;
    note the skip reason, the failure's first line, or the properties a test recorded."""
    results = []
    if not Path(path).is_file():
        return results
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        module, name = r["test"].split("::", 1) if "::" in r["test"] else ("", r["test"])
        note = r["note"] or ", ".join(f"{k}: {v}" for k, v in r["properties"].items())
        results.append((f"{Path(module).stem}::{name}", r["outcome"], r["seconds"], note))
    return results


def cell(text, limit=200):
    """Text that stays inside one markdown table cell."""
    text = " ".join(str(text).split())
    return (text[:limit - 3] + "..." if len(text) > limit else text).replace("|", "\\|")


def suite_section(results, command, seconds, stopped):
    counts = {k: sum(r[1] == k for r in results) for k in ("passed", "failed", "error", "skipped")}
    ended = ("; stopped at its time limit: the tests not listed did not run" if stopped else "")
    lines = [f"## `{command}`: " + ", ".join(f"{n} {k}" for k, n in counts.items()) + f" in {seconds / 60:.1f} min"
             + ended, "", "| test | result | seconds | note |", "|---|---|---:|---|"]
    lines += [f"| {cell(t)} | {o} | {s:.1f} | {cell(n)} |" for t, o, s, n in results]
    if not results:
        lines.append("| (no result: the suite ended before its first test did) | - | - | - |")
    return "\n".join(lines) + "\n"


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def code_line():
    """The code that ran: its git commit as the copy's metadata says it, and the digest of the files themselves
    (cli.source_digest: every script and machinery/), which holds where a copy's git metadata is stale or absent:
    compare it with `python -c "from machinery.cli import source_digest; print(source_digest()[:16])"`."""
    commit = git("rev-parse", "--short", "HEAD") or "no git commit"
    dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"{commit}{dirty}; source digest {source_digest()[:16]}"


def environment(device):
    """What ran the report: GPU, driver, versions and the code's commit, as (name, value) pairs."""
    import torch
    p = torch.cuda.get_device_properties(device)
    try:  # the clocks and power limit as found: the report measures the card as it is
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        smi = "nvidia-smi did not answer"
    return [("GPU", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}, "
                    f"{p.multi_processor_count} SMs"),
            ("driver, max SM and memory clocks, power limit", smi),
            ("PyTorch", f"{torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})"),
            ("Triton", version("triton")), ("transformers", version("transformers")),
            ("flash-attn", version("flash-attn")), ("Python", sys.version.split()[0]), ("code", code_line())]


def header(started, command, minutes, limit, env):
    return "\n".join([f"# GPU acceptance, {started:%Y-%m-%d %H:%M} UTC", "",
                      f"`{command}`: {minutes:.1f} minutes in all (its limit: {limit:g}).", "", "| | |", "|---|---|"]
                     + [f"| {k} | {cell(v)} |" for k, v in env]) + "\n"


def now():
    return datetime.datetime.now(datetime.timezone.utc)
