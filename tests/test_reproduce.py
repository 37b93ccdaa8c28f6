"""reproduce.py: both studies at the smoke scale, interrupted (SIGKILL to the driver, SIGTERM to the driver) and
resumed; another command refused on a finished experiment; one-line errors; the dry runs' command counts."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, SHARED_DATA, need

CORPUS = SHARED_DATA / "corpus" / "e3c_en_clinical_cases.jsonl"
TASKS = [SHARED_DATA / "tasks" / t for t in ("ncbi_disease", "chemprot", "pubmedqa")]


def reproduce(*args, **kwargs):
    return subprocess.Popen([sys.executable, str(ROOT / "reproduce.py"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def finished(proc):
    out, _ = proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    return out


def refused(*args):
    """A command expected to fail: (its one stderr line, its stdout)."""
    result = subprocess.run([sys.executable, str(ROOT / "reproduce.py"), *map(str, args)], capture_output=True,
                            text=True)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr, result.stdout


def stage_finished(out, name):
    path = out / "stages" / f"{name}.json"
    try:
        return json.loads(path.read_text()).get("finished", False)
    except (OSError, ValueError):  # not there yet, or being replaced
        return False


def stage_processes(out):
    """Live processes whose command line names the experiment directory (every stage's does)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(out).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:  # it ended meanwhile
            pass
    return found


def interrupted(args, out, stage, sig, group=False):
    """Run reproduce.py until `stage` has finished and another stage is running, then send `sig` to the driver
    (to its process group with group=True, as a terminal's Ctrl-C would); returns its output and exit status."""
    first = reproduce(*args, start_new_session=True)
    while not (stage_finished(out, stage) and len(stage_processes(out)) > 1) and first.poll() is None:
        time.sleep(0.05)
    if first.poll() is None:
        (os.killpg if group else os.kill)(first.pid, sig)
    text, _ = first.communicate()
    return text, first.returncode


def local_inputs(tmp):
    """Copies of the corpus and the task folders that a test may change (the shared ones are read-only)."""
    corpus = tmp / "corpus.jsonl"
    shutil.copyfile(CORPUS, corpus)
    tasks = [tmp / "tasks" / t.name for t in TASKS]
    for src, dst in zip(TASKS, tasks):
        shutil.copytree(src, dst)
    return corpus, tasks


def without_times(report):
    return {k: v for k, v in report.items() if k != "time"}


def finite_numbers(obj):
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in finite_numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in finite_numbers(v)]
    return [obj] if isinstance(obj, (int, float)) and not isinstance(obj, bool) else []


@pytest.fixture(scope="module")
def detour(tmp_path_factory):
    """The detour study at the smoke scale on copies of its inputs, its driver killed outright (SIGKILL to its
    process group) once a training arm has finished, then run again to the end, and a third time.
    Returns (out, args, the output of the kill, of the second and the third invocation)."""
    need(CORPUS)
    tmp = tmp_path_factory.mktemp("detour")
    corpus, tasks = local_inputs(tmp)
    out = tmp / "exp"
    args = ["--scale=smoke", f"--out={out}", "--jobs=2", f"--corpus={corpus}", "--tasks", *map(str, tasks)]
    text, status = interrupted(args, out, "mlm", signal.SIGKILL, group=True)
    assert status == -signal.SIGKILL, "the smoke run finished before it could be interrupted"
    deadline = time.time() + 10
    while stage_processes(out) and time.time() < deadline:  # the kernel ends them as their driver dies
        time.sleep(0.1)
    assert stage_processes(out) == [], "a stage outlived its driver"
    second = finished(reproduce(*args))
    third = finished(reproduce(*args))
    return out, args, text, second, third


@pytest.fixture(scope="module")
def biphasic_stopped(tmp_path_factory):
    """The biphasic study at the smoke scale, SIGTERM to the driver alone once the CLM 25% phase has finished.
    Returns (out, args, the stopped driver's output and exit status, the stage processes left right after)."""
    need(CORPUS)
    out = tmp_path_factory.mktemp("biphasic") / "exp"
    args = ["--study=biphasic", "--scale=smoke", f"--out={out}", "--jobs=2"]
    text, status = interrupted(args, out, "clm25", signal.SIGTERM)
    return out, args, text, status, stage_processes(out)


@pytest.fixture(scope="module")
def biphasic(biphasic_stopped):
    """The stopped biphasic study run again to the end (its 24 fine-tunings take minutes: slow tests only).
    Returns (out, args, that invocation's output)."""
    out, args = biphasic_stopped[:2]
    return out, args, finished(reproduce(*args))


@pytest.mark.slow  # the detour's smoke run: about a minute
def test_detour_report_opens_with_what_was_run_and_holds_every_table(detour):
    out, _, _, second, _ = detour
    assert "[skip]   mlm: finished" in second  # what the killed invocation finished is not run again
    report = json.loads((out / "report.json").read_text())
    assert set(report["cka"]) == {"before", "after"} and all(len(r["layers"]) == 4 for r in report["cka"].values())
    final = ["mlm-decay", "clm-decay", "clm-freeze-low-decay", "clm-freeze-mid-decay", "clm-decay-freeze-low"]
    assert list(report["finetune"]) == final
    for arm in final:
        (tasks,) = report["finetune"][arm].values()  # one fine-tuning lr
        assert set(tasks) == {"ncbi_disease", "chemprot", "pubmedqa"}
        assert all(len(t["seeds"]) == 5 and 0 <= t["baseline"] <= 1 for t in tasks.values())
    assert {"start", "clm", "mlm", "mlm-seed18", "clm-decay", "mlm-decay"} <= set(report["runs"])
    assert all(len(report["runs"][arm]["val"]) >= 5 for arm in ("clm", "mlm"))  # every eval: 10 steps, one per 2
    numbers = finite_numbers(without_times(report))
    assert len(numbers) > 300 and all(math.isfinite(x) for x in numbers)
    text = (out / "report.md").read_text()
    lines = text.splitlines()
    assert lines[2].startswith("**Smoke scale") and "test the pipeline only" in lines[2]
    assert lines[4] == "## What was run" and "4 blocks x 128 wide" in text and "5 seeds (42, 43, 44, 45, 46)" in text
    assert "Layer-wise CKA before the decay" in text and "outside the band" in text
    assert text.count("majority baseline") >= 2 and "Wall time:" in text and "Summed stage time:" in text
    assert report["time"]["wall"] <= report["time"]["summed"] + 1e-6  # stages ran side by side


@pytest.mark.slow  # the detour's smoke run: about a minute
def test_a_third_invocation_skips_every_finished_stage(detour):
    out, _, _, _, third = detour
    assert "[run]" not in third and "[resume]" not in third
    assert third.count("[skip]") == len(list((out / "stages").glob("*.json"))) == 26


@pytest.mark.slow  # needs the detour's finished smoke run: about a minute
@pytest.mark.parametrize("change, cause", [
    (["--scale=cpu"], "start (its command)"),
    (["--gpus=2"], "start (its command)"),
    (["--study=biphasic"], "clm (its command), mlm (its command), clm25 (not in that command)"),
    (["corpus"], "data-corpus (the content of"),
    (["task"], "finetune-mlm-decay-lr0.001 (the content of"),
])
def test_another_command_on_a_finished_experiment_is_refused_naming_the_stages(detour, change, cause):
    """A changed scale, flag, study, corpus content or task file: refused (with --dry_run and without), one
    line naming the stages that differ; OUT is left as it was."""
    out, args, _, _, _ = detour
    corpus = Path(args[3].split("=", 1)[1])
    edited = {"corpus": corpus, "task": Path(args[6]) / "test.jsonl"}.get(change[0])  # args[6]: chemprot
    before = sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*"))
    original = edited.read_bytes() if edited else None
    try:
        if edited:  # the same size and name, one character changed
            text = original.decode()
            i = text.index("e", len(text) // 2)
            edited.write_bytes((text[:i] + "a" + text[i + 1:]).encode())
        if not edited:  # the flag replaced, or added
            args = [a for a in args if a.split("=")[0] != change[0].split("=")[0]] + change
        line, _ = refused(*args, "--dry_run")
        assert line.startswith(f"error: --out={out} holds the results of another command (detour at scale smoke")
        assert cause in line and "choose a new --out" in line
        assert refused(*args)[0] == line
    finally:
        if edited:
            edited.write_bytes(original)
    assert sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*")) == before


@pytest.mark.slow  # the detour's smoke run: about a minute
def test_the_same_command_dry_run_lists_every_stage_finished(detour):
    out, args, _, _, _ = detour
    text = finished(reproduce(*args, "--dry_run"))
    assert text.splitlines()[-1] == f"26 stages (26 finished in {out}); inputs checked; nothing was run (--dry_run)"


def test_sigterm_to_the_driver_ends_every_stage(biphasic_stopped):
    out, _, text, status, left = biphasic_stopped
    assert status == 128 + signal.SIGTERM and "stopped by SIGTERM" in text.splitlines()[-1] and left == []
    records = [json.loads(p.read_text()) for p in (out / "stages").glob("*.json")]
    assert any(not r["finished"] for r in records), "no stage was running when the driver was stopped"
    assert not (out / "report.md").exists()


@pytest.mark.slow
def test_a_rerun_after_sigterm_finishes(biphasic):
    out, _, second = biphasic
    assert "[skip]   clm25: finished" in second and (out / "report.md").exists()


@pytest.mark.slow
def test_biphasic_arms_share_steps_and_one_wsd_schedule_across_the_switch(biphasic):
    """MLM alone and CLM 25%/50% then MLM: the same steps, and the same learning rate at every token (one
    warmup, one decay at the end of the budget), read from their logs."""
    out = biphasic[0]
    report = json.loads((out / "report.json").read_text())
    runs = report["runs"]
    B = runs["mlm"]["tokens"]
    assert B == 16 * 1024
    alone = {t: lr for t, lr in runs["mlm"]["lr"]}
    # CLM is trained once, handed off at 25% and 50% of B; the MLM phases branch off those hand-offs
    assert [runs[n]["continues"] for n in ("clm25", "clm50", "clm", "clm25-mlm", "clm50-mlm")] == \
        ["", "clm25", "clm50", "clm25", "clm50"]
    for arm, shares in (("clm25-mlm", [25, 75]), ("clm50-mlm", [25, 25, 50]), ("clm", [25, 25, 50])):
        chain, lrs, offset = [arm], {}, 0
        while runs[chain[-1]]["continues"]:
            chain.append(runs[chain[-1]]["continues"])
        assert [runs[n]["tokens"] for n in reversed(chain)] == [B * share // 100 for share in shares]
        for name in reversed(chain):
            lrs |= {t + offset: lr for t, lr in runs[name]["lr"]}
            offset += runs[name]["tokens"]
        assert lrs == pytest.approx(alone, rel=1e-9), arm
    lrs = [lr for _, lr in runs["mlm"]["lr"]]
    assert lrs[-2] == max(lrs) > lrs[-1]  # the peak held to the last 10% of B, decayed in its last step only
    E = runs["cpt-from-mlm"]["tokens"]
    assert E == 12 * 1024 == runs["cpt-from-clm"]["tokens"] == runs["decoder-clm"]["tokens"]
    assert runs["decoder-detour"]["tokens"] + runs["decoder-detour-clm"]["tokens"] == E
    assert runs["clm25-mlm"]["how"] == "mlm 40% masked, wsd" and runs["clm25"]["how"] == "clm, wsd"


@pytest.mark.slow
def test_biphasic_report_has_every_model_at_three_lrs_with_baselines(biphasic):
    out = biphasic[0]
    report = json.loads((out / "report.json").read_text())
    final = ["mlm", "clm25-mlm", "clm50-mlm", "clm", "cpt-from-mlm", "cpt-from-clm", "decoder-detour-clm",
             "decoder-clm"]
    assert list(report["finetune"]) == final
    assert all(list(report["finetune"][arm]) == ["0.0003", "0.001", "0.003"] for arm in final)
    assert all(len(t["seeds"]) == 2 for arm in final for lr in report["finetune"][arm].values() for t in lr.values())
    val = {name: len(run["val"]) for name, run in report["runs"].items()}  # every eval: 16 steps, one per 2
    assert val["mlm"] >= 8 and val["clm25"] + val["clm50"] + val["clm"] >= 8
    text = (out / "report.md").read_text()
    assert text.startswith("# CLM then MLM against MLM alone, from scratch at one budget, scale `smoke`")
    assert "test the pipeline only" in text and "B = 16,384 (16 steps)" in text
    tables = text.count("| task (metric) | arm | seeds | majority baseline |")
    assert tables == 9  # three comparisons at three lrs
    assert "## Stability across fine-tuning learning rates" in text and "| majority baseline |" in text
    assert "## Decoder control" in text and "Wall time:" in text and "Summed stage time:" in text
    assert (out / "report.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.parametrize("which", ["detour", "biphasic"])
def test_an_interrupted_run_gives_the_same_report(which, request, tmp_path):
    """The interrupted and resumed smoke run's numbers equal an uninterrupted run's (times aside)."""
    out, args = request.getfixturevalue(which)[:2]
    straight = [a for a in args if not a.startswith("--out=")] + [f"--out={tmp_path / 'straight'}"]
    finished(reproduce(*straight))
    report = json.loads((tmp_path / "straight" / "report.json").read_text())
    assert without_times(report) == without_times(json.loads((out / "report.json").read_text()))


@pytest.mark.parametrize("study, scale, count", [("detour", "paper", 23), ("biphasic", "paper", 36),
                                                 ("detour", "cpu", 27), ("biphasic", "cpu", 37)])
def test_dry_run_prints_every_command_and_writes_nothing(tmp_path, study, scale, count):
    need(CORPUS)
    out = tmp_path / "exp"
    text = finished(reproduce(f"--study={study}", f"--scale={scale}", f"--out={out}", "--gpus=4", "--dry_run"))
    lines = text.splitlines()
    assert lines[-1] == f"{count} stages (0 finished in {out}); inputs checked; nothing was run (--dry_run)"
    assert not out.exists()
    command = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in lines if ": python" in line}
    assert len(command) == count
    if study == "detour":
        assert "--nproc_per_node=4" in command["clm"] and f"--recipe={scale}" in command["clm"]
        assert scale != "paper" or "--init_from=answerdotai/ModernBERT-base" in command["clm"]
        return
    step = {"paper": 8192 * 384, "cpu": 256 * 32}[scale]
    B, E = {"paper": (12_000, 12_000), "cpu": (200, 60)}[scale]
    assert f"--tokens={B // 4 * 3 * step} --schedule_tokens={B * step}" in command["clm25-mlm"]
    assert f"--init_from={out / 'runs' / 'clm25'} --out_dir" in command["clm25-mlm"]  # a hand-off
    assert "--phase=mlm --mask_rate=0.4 --schedule=wsd" in command["clm25-mlm"]
    assert f"--tokens={E * step} --schedule_tokens={E * step} --init_from={out / 'runs' / 'clm'} --weights_only" \
        in command["cpt-from-clm"]
    assert scale != "paper" or f"--decay_tokens={2000 * step}" in command["mlm"]
    assert sum(name.startswith("finetune-") for name in command) == 24


def test_bad_flags_are_one_line_each(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("mine")
    (tmp_path / "file").write_text("x")
    (tmp_path / "corpus.csv").write_text("x")
    (tmp_path / "badplan").mkdir()
    (tmp_path / "badplan" / "plan.json").write_text("{")
    out = f"--out={tmp_path / 'exp'}"
    cases = [
        (["--scale=huge", out], "invalid choice: 'huge'"),
        (["--scale=smoke", "--study=both", out], "invalid choice: 'both'"),
        (["--scale=smoke", out, "--jobs=0"], "expected at least 1"),
        (["--scale=smoke", out, "--jobs=two"], "expected an integer"),
        (["--scale=smoke", out, "--gpus=-4"], "--gpus: expected at least 1, got -4"),
        (["--scale=smoke", out, "--gpus=0"], "--gpus: expected at least 1, got 0"),
        (["--scale=smoke", out, "--start=/nonexistent", "--dry_run"], "--start=/nonexistent: not found"),
        (["--scale=smoke", out, f"--start={tmp_path / 'empty'}"], "not a model directory (no config.json"),
        (["--scale=smoke", "--study=biphasic", out, f"--start={tmp_path / 'empty'}"], "trains from scratch"),
        (["--scale=smoke", out, f"--corpus={tmp_path / 'none.jsonl'}"], "none.jsonl: not found"),
        (["--scale=smoke", out, f"--corpus={tmp_path / 'empty'}"], "empty: not a file"),
        (["--scale=smoke", out, f"--corpus={tmp_path / 'corpus.csv'}"], "expected a .jsonl, .txt or .parquet"),
        (["--scale=smoke", out, "--corpus", CORPUS, CORPUS], "given twice"),
        (["--scale=smoke", out, "--tasks", tmp_path / "empty"], "expected a folder with train, dev and test"),
        (["--scale=smoke", f"--out={tmp_path / 'file'}", "--dry_run"], "a file; expected a directory"),
        (["--scale=smoke", f"--out={tmp_path / 'notes'}"], "holds no plan.json"),
        (["--scale=smoke", f"--out={tmp_path / 'badplan'}"], "not valid JSON"),
        (["--scale=smoke", "--scale=cpu", out], "--scale is given twice"),
        (["--scale=smoke", out, "--epochs=3"], "unrecognized arguments: --epochs=3"),
        (["--scale=smoke"], "the following arguments are required: --out"),
    ]
    for args, message in cases:
        line, stdout = refused(*args)
        assert message in line and stdout == "", (args, line)
    assert not (tmp_path / "exp").exists() and os.listdir(tmp_path / "notes") == ["README.md"]
