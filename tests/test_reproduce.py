"""reproduce.py: both studies at the smoke scale, interrupted (SIGKILL to the driver, SIGTERM to the driver) and
resumed; another command refused on a finished experiment; one-line errors; the dry runs' command counts."""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, SHARED_DATA, need, source_copy

CORPUS = SHARED_DATA / "corpus" / "e3c_en_clinical_cases.jsonl"
TASKS = [SHARED_DATA / "tasks" / t for t in ("ncbi_disease", "chemprot", "pubmedqa")]


def reproduce(*args, **kwargs):
    return subprocess.Popen([sys.executable, str(ROOT / "reproduce.py"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def dry(args):
    """A run's flags as its dry run takes them: --jobs (stages side by side) is a run's alone, refused there."""
    return [a for a in args if not a.startswith("--jobs=")] + ["--dry_run"]


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


def in_process(capsys, *args):
    """reproduce.py's command line in this process, as its script runs it (cli.run): (exit status, stdout, stderr).
    Seconds faster than a subprocess each (torch is imported already); the subprocess path has tests of its own."""
    import reproduce
    from machinery.cli import run
    capsys.readouterr()
    try:
        run(reproduce.main, [str(a) for a in args])
        status = 0
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


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
    text, status = interrupted(args, out, "mlm-r1", signal.SIGKILL, group=True)
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
    """The biphasic study at the smoke scale, SIGTERM to the driver alone once its corpus is prepared and a training
    has started. Returns (out, args, the stopped driver's output and exit status, the stage processes left after)."""
    need(CORPUS)
    out = tmp_path_factory.mktemp("biphasic") / "exp"
    args = ["--study=biphasic", "--scale=smoke", f"--out={out}", "--jobs=2"]
    text, status = interrupted(args, out, "data-corpus", signal.SIGTERM)
    return out, args, text, status, stage_processes(out)


@pytest.fixture(scope="module")
def biphasic(biphasic_stopped):
    """The stopped biphasic study run again to the end (its 24 fine-tunings take minutes: slow tests only).
    Returns (out, args, that invocation's output)."""
    out, args = biphasic_stopped[:2]
    return out, args, finished(reproduce(*args))


@pytest.mark.slow  # the detour's smoke run: about two minutes
def test_detour_report_opens_with_what_was_run_and_holds_every_table(detour):
    out, _, _, second, _ = detour
    assert "[skip]   mlm-r1: finished" in second  # what the killed invocation finished is not run again
    report = json.loads((out / "report.json").read_text())
    assert report["replicates"] == 2
    assert set(report["cka"]) == {"before", "after"}
    assert all(len(r["layers"]) == 4 and r["replicates"] == 2 and r["controls"]["k"] == 2
               for r in report["cka"].values())  # MLM replicate r against its seed control: two that share no run
    pairs = report["cka"]["after"]["args"]["control_pairs"]
    assert pairs[1] == ["OUT/runs/mlm-decay-r2", "OUT/runs/mlm-control-decay-r2"]
    assert [report["runs"][f"mlm-control-r{r}"]["seed"] for r in (1, 2)] == [117, 118]
    assert [report["runs"][f"mlm-control-r{r}"]["data_seed"] for r in (1, 2)] == [42, 43]
    final = ["mlm-decay", "clm-decay", "clm-freeze-low-decay", "clm-freeze-mid-decay", "clm-decay-freeze-low"]
    (comparison,) = report["finetune"].values()
    assert set(comparison["tasks"]) == {"ncbi_disease", "chemprot", "pubmedqa"} and comparison["left_out"] == {}
    assert comparison["tasks"]["pubmedqa"]["dev_split"] == {"own": 50, "carved_from_train": 10, "dev_min": 60}
    for t in comparison["tasks"].values():
        assert list(t["arms"]) == final and t["replicates"] == 2
        assert t["seeds"] == [["42", "43", "44"], ["45", "46", "47"]]  # each replicate's own
        assert all(row["runs"] == 6 and row["setting"] == "0.001" for row in t["arms"].values())
    assert list(report["losses"]["the decayed models"]) == final
    runs = set(report["runs"])
    assert {"start", "clm-r1", "clm-r2", "mlm-r1", "mlm-r2", "clm-decay-r2", "mlm-decay-r1"} <= runs
    assert [report["runs"][f"mlm-r{r}"]["seed"] for r in (1, 2)] == [17, 18]
    assert [report["runs"][f"clm-decay-r{r}"]["data_seed"] for r in (1, 2)] == [42, 43]  # a hand-off inherits
    assert all(len(report["runs"][run]["val"]) >= 5 for run in ("clm-r1", "mlm-r2"))  # every eval: 10 steps
    numbers = finite_numbers(without_times(report))
    assert len(numbers) > 300 and all(math.isfinite(x) for x in numbers)
    text = (out / "report.md").read_text()
    lines = text.splitlines()
    assert lines[2].startswith("**Smoke scale") and "test the pipeline only" in lines[2]
    assert lines[4] == "## What was run" and "4 blocks x 128 wide" in text
    assert "3 seeds per model, replicate and lr, each replicate's own, shared by its arms (42,43,44; 45,46,47)" in text
    from machinery import cli
    from machinery.rundir import code_version
    sys.path.insert(0, str(ROOT))
    from reproduce import commit_words
    assert report["versions"] == cli.versions() and report["git"] == code_version()["git"]
    assert f"(every script and machinery module){commit_words(report)}; python " in text
    assert "## The verdicts" in text and "Layer-wise CKA before the decay" in text and "Trend with depth" in text
    assert "detectable (80% power)" in text and "10 moved from train" in text and "lr 0.001 (fixed, not chosen)" in text
    assert text.count("majority baseline") >= 3 and "Wall time:" in text and "Summed stage time:" in text
    assert report["time"]["wall"] <= report["time"]["summed"] + 1e-6  # stages ran side by side


@pytest.mark.slow  # the detour's smoke run: about a minute
def test_a_third_invocation_skips_every_finished_stage(detour):
    out, _, _, _, third = detour
    assert "[run]" not in third and "[resume]" not in third
    assert third.count("[skip]") == len(list((out / "stages").glob("*.json"))) == 39


@pytest.mark.slow  # needs the detour's finished smoke run: about a minute
@pytest.mark.parametrize("change, cause", [
    (["--scale=cpu"], "start (its command)"),
    (["--gpus=2"], "start (its command)"),
    (["--study=biphasic"], "clm-r1 (its command), mlm-r1 (its command)"),
    (["--replicates=3"], "clm-r3 (not in that command)"),
    (["corpus"], "data-corpus (the content of"),
    (["task"], "finetune-mlm-decay-r1-lr0.001 (the content of"),
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
        line, _ = refused(*dry(args))
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
    text = finished(reproduce(*dry(args)))
    assert text.splitlines()[-1] == f"39 stages (39 finished in {out}); inputs checked; nothing was run (--dry_run)"


def test_sigterm_to_the_driver_ends_every_stage(biphasic_stopped):
    out, _, text, status, left = biphasic_stopped
    assert status == 128 + signal.SIGTERM and "stopped by SIGTERM" in text.splitlines()[-1] and left == []
    records = [json.loads(p.read_text()) for p in (out / "stages").glob("*.json")]
    assert any(not r["finished"] for r in records), "no stage was running when the driver was stopped"
    assert not (out / "report.md").exists()


@pytest.mark.slow
def test_a_rerun_after_sigterm_finishes(biphasic):
    out, _, second = biphasic
    assert "[skip]   data-corpus: finished" in second and (out / "report.md").exists()


@pytest.mark.slow
def test_biphasic_arms_share_steps_and_one_wsd_schedule_across_the_switch(biphasic):
    """MLM alone and CLM 25%/50% then MLM: the same steps, and the same learning rate at every token (one
    warmup, one decay at the end of the budget), read from their logs."""
    out = biphasic[0]
    report = json.loads((out / "report.json").read_text())
    runs = {name[:-3]: run for name, run in report["runs"].items() if name.endswith("-r2")}  # replicate 2
    for run in runs.values():
        run["continues"] = run["continues"][:-3]
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
    assert {run["seed"] for run in runs.values()} == {18} and {run["data_seed"] for run in runs.values()} == {43}


@pytest.mark.slow
def test_biphasic_report_chooses_each_lr_on_dev_and_keeps_every_lr_in_an_appendix(biphasic):
    out = biphasic[0]
    report = json.loads((out / "report.json").read_text())
    encoders = ["mlm", "clm25-mlm", "clm50-mlm", "clm", "cpt-from-mlm", "cpt-from-clm"]
    assert [m for c in report["finetune"].values() for m in next(iter(c["tasks"].values()))["arms"]] == encoders
    import numpy as np
    from machinery.compare import choose_apart
    for comparison in report["finetune"].values():
        for task, t in comparison["tasks"].items():
            for arm, row in t["arms"].items():  # each replicate's lr: the best mean dev score of the other's runs
                dev = {lr: np.array([[s["dev"][t["metric"]] for s in json.loads(
                    (out / "finetune" / f"{arm}-r{r}-lr{lr}.json").read_text())["tasks"][task]["seeds"].values()]
                    for r in (1, 2)]) for lr in row["dev"]}
                assert row["chosen"] == choose_apart(dev) and row["runs"] == 4
                assert row["setting"] == ", ".join(dict.fromkeys(x for each in row["chosen"] for x in each))
    assert list(report["per_setting"]) == encoders
    assert all(list(by_lr) == ["0.001", "0.003"] for tasks in report["per_setting"].values() for by_lr in tasks.values())
    assert set(report["losses"]) == {"from scratch at one budget B", "continued pretraining, E more tokens of MLM",
                                     "the decoder control, E more tokens for the CLM-only model"}
    control = report["losses"]["the decoder control, E more tokens for the CLM-only model"]
    assert control["decoder-detour-clm"]["val_clm"]["difference"]["verdict"] in ("higher", "lower",
                                                                                 "no detectable difference")
    val = {name: len(run["val"]) for name, run in report["runs"].items()}  # every eval: 16 steps, one per 2
    assert val["mlm-r1"] >= 8 and val["clm25-r1"] + val["clm50-r1"] + val["clm-r1"] >= 8
    text = (out / "report.md").read_text()
    assert text.startswith("# CLM then MLM against MLM alone, from scratch at one budget, scale `smoke`")
    assert "test the pipeline only" in text and "B = 16,384 (16 steps)" in text
    assert text.count("| arm | fine-tuning lr (chosen on the other replicates' dev) |") == 6  # 2 comparisons x 3 tasks
    assert "## Appendix: every fine-tuning learning rate" in text and "Not used for any comparison" in text
    assert "## The verdicts" in text and "Wall time:" in text and "Summed stage time:" in text
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


@pytest.mark.parametrize("study, scale, count", [("detour", "paper", 52), ("biphasic", "paper", 88),
                                                 ("detour", "cpu", 56), ("biphasic", "cpu", 71)])
def test_dry_run_prints_every_command_and_writes_nothing(tmp_path, capsys, study, scale, count):
    need(CORPUS)
    out = tmp_path / "exp"
    status, text, err = in_process(capsys, f"--study={study}", f"--scale={scale}", f"--out={out}", "--gpus=4",
                                   "--dry_run")
    assert status == 0, err
    lines = text.splitlines()
    assert lines[-1] == f"{count} stages (0 finished in {out}); inputs checked; nothing was run (--dry_run)"
    assert not out.exists()
    command = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in lines if ": python" in line}
    assert len(command) == count
    assert "--seed=19 --data_seed=44" in command["mlm-r3"] and "--seed=17 --data_seed=42" in command["mlm-r1"]
    unit = "H100 GPU-hours" if scale == "paper" else "CPU hours"  # the machine's own terms
    hours = {name: float(c.rsplit("(~", 1)[1].split()[0]) for name, c in command.items() if f"{unit})" in c}
    evals = ("finetune-", "cka-", "needle", "data-", "tok")
    total = float(lines[-2].split("~", 1)[1].split()[0])
    assert total == pytest.approx(sum(hours.values()), rel=0.01)
    if scale == "paper":  # the trainings, estimated from their FLOPs
        assert set(hours) == {name for name in command if not name.startswith(evals)}
        assert lines[-2].startswith("the trainings: ~") and "GPU-hours" in lines[-2]
    else:  # every stage, as the study's committed cpu report measured a stage of its kind (one core each)
        assert set(hours) == set(command) and lines[-2].startswith("the stages: ~") and "CPU hours in all" in lines[-2]
        measured = json.loads((ROOT / "docs" / f"{study}-cpu" / "report.json").read_text())["time"]["stages"]
        assert hours["mlm-r2"] == pytest.approx(sum(measured[f"mlm-r{r}"] for r in (1, 2, 3)) / 3 / 3600, rel=0.01)
        if study == "detour":  # the start model ran alone on both cores: its CPU hours are both cores' time
            assert hours["start"] == pytest.approx(2 * measured["start"] / 3600, rel=0.01)
    if (study, scale) == ("detour", "paper"):  # 10B tokens of MLM on base: 3h11 on 4 x H100 is 12.7 GPU-hours
        assert hours["mlm-r1"] == pytest.approx(12.7, abs=0.5)
    if study == "detour":
        assert "--nproc_per_node=4" in command["clm-r1"] and f"--recipe={scale}" in command["clm-r1"]
        assert scale != "paper" or "--init_from=answerdotai/ModernBERT-base" in command["clm-r1"]
        runs = [f"{out / 'runs' / 'mlm-decay'}-r{r}" for r in (1, 2, 3)]
        assert f"cka {','.join(runs)} " in command["cka-after"]  # three replicates: three seed controls
        controls = [f"--control={out / 'runs' / 'mlm-control-decay'}-r{r}" for r in (1, 2, 3)]
        assert all(c in command["cka-after"] for c in controls)
        assert "--seed=119 --data_seed=44" in command["mlm-control-r3"]
        assert sum(name.startswith("finetune-") for name in command) == 15
        return
    step = {"paper": 8192 * 384, "cpu": 256 * 32}[scale]
    B, E = {"paper": (12_000, 12_000), "cpu": (80, 24)}[scale]
    assert f"--tokens={B // 4 * 3 * step} --schedule_tokens={B * step}" in command["clm25-mlm-r1"]
    assert f"--init_from={out / 'runs' / 'clm25-r1'} --out_dir" in command["clm25-mlm-r1"]  # a hand-off
    assert "--phase=mlm --mask_rate=0.4 --schedule=wsd" in command["clm25-mlm-r1"]
    assert f"--tokens={E * step} --schedule_tokens={E * step} --init_from={out / 'runs' / 'clm-r2'} " \
        f"--weights_only --data={out / 'data' / 'corpus'} --seed=18 --data_seed=43" in command["cpt-from-clm-r2"]
    assert scale != "paper" or f"--decay_tokens={2000 * step}" in command["mlm-r1"]
    assert scale != "cpu" or f"--warmup_tokens={8 * step}" in command["mlm-r1"]
    assert sum(name.startswith("finetune-") for name in command) == {"paper": 54, "cpu": 36}[scale]


def test_bad_flags_are_one_line_each(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("mine")
    (tmp_path / "file").write_text("x")
    (tmp_path / "corpus.csv").write_text("x")
    (tmp_path / "badplan").mkdir()
    (tmp_path / "badplan" / "plan.json").write_text("{")
    onelabel = tmp_path / "onelabel"  # a task the fine-tuning would refuse: nothing to learn
    onelabel.mkdir()
    for split in ("train", "dev", "test"):
        (onelabel / f"{split}.jsonl").write_text('{"text": "a", "label": "x"}\n{"text": "b", "label": "x"}\n')
    bert = tmp_path / "bert"  # a start folder of another model type
    bert.mkdir()
    (bert / "config.json").write_text('{"model_type": "bert"}')
    (bert / "tokenizer.json").write_text("{}")
    out = f"--out={tmp_path / 'exp'}"
    cases = [
        (["--scale=huge", out], "invalid choice: 'huge'"),
        (["--scale=smoke", "--study=both", out], "invalid choice: 'both'"),
        (["--scale=smoke", out, "--jobs=0"], "expected at least 1"),
        (["--scale=smoke", out, "--jobs=two"], "expected an integer"),
        (["--scale=smoke", out, "--gpus=-4"], "--gpus: expected at least 1, got -4"),
        (["--scale=smoke", out, "--gpus=0"], "--gpus: expected at least 1, got 0"),
        (["--scale=smoke", out, "--replicates=0"], "--replicates: expected at least 1, got 0"),
        (["--scale=smoke", out, "--start=/nonexistent", "--dry_run"], "--start=/nonexistent: not found"),
        (["--scale=smoke", out, "--start=org/..", "--dry_run"], "--start=org/..: not found (expected a model "
                                                                 "directory or a hub id like org/name: '..' is not"),
        (["--scale=smoke", out, f"--start={tmp_path / 'empty'}"], "not a model directory (no config.json"),
        (["--scale=smoke", "--study=biphasic", out, f"--start={tmp_path / 'empty'}"], "trains from scratch"),
        (["--scale=smoke", out, f"--corpus={tmp_path / 'none.jsonl'}"], "none.jsonl: not found"),
        (["--scale=smoke", out, f"--corpus={tmp_path / 'empty'}"], "empty: not a file"),
        (["--scale=smoke", out, f"--corpus={tmp_path / 'corpus.csv'}"], "expected a .jsonl, .txt or .parquet"),
        (["--scale=smoke", out, "--corpus", CORPUS, CORPUS], "given twice"),
        (["--scale=smoke", out, "--tasks", tmp_path / "empty"], "expected a folder with train, dev and test"),
        (["--scale=smoke", out, "--tasks", onelabel, "--dry_run"], "1 distinct label(s) ['x']: nothing to learn"),
        (["--scale=smoke", out, f"--start={bert}", "--dry_run"], "model_type is 'bert', expected 'modernbert'"),
        (["--scale=smoke", f"--out={tmp_path / 'file'}", "--dry_run"], "a file; expected a directory"),
        (["--scale=smoke", f"--out={tmp_path / 'notes'}"], "holds no plan.json"),
        (["--scale=smoke", f"--out={tmp_path / 'badplan'}"], "not valid JSON"),
        (["--scale=smoke", "--scale=cpu", out], "--scale is given twice"),
        # a flag the other mode reads alone is refused, never ignored; a dry run meets what the run would
        (["--scale=smoke", out, "--detect=2"], "--detect=2.0 is read by --dry_run alone (the differences the plan"),
        (["--scale=smoke", out, f"--components={tmp_path / 'file'}"], "--components="),
        (["--scale=smoke", out, "--jobs=2", "--dry_run"], "--jobs=2 is read by a run alone (stages run side by side)"),
        (["--scale=smoke", f"--out={tmp_path / 'file' / 'exp'}", "--dry_run"], "cannot write there"),
        (["--scale=smoke", f"--out={tmp_path / 'file' / 'exp'}"], "cannot write there"),
        (["--scale=smoke", f"--out={read_only(tmp_path)}/exp", "--dry_run"], "cannot write there"),
        (["--scale=smoke", out, "--epochs=3"], "unrecognized arguments: --epochs=3"),
        (["--sclae=smoke", out], "unrecognized arguments: --sclae=smoke; did you mean --scale?"),  # not "required"
        (["--scal=smoke", out], "unrecognized arguments: --scal=smoke; did you mean --scale?"),  # never a prefix
        (["--scale=smoke"], "the following arguments are required: --out"),
    ]
    line, stdout = refused(*cases[0][0])  # as a process: one line on stderr, exit status 2
    assert cases[0][1] in line and stdout == ""
    for args, message in cases:
        status, stdout, err = in_process(capsys, *args)
        assert status == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, (args, err)
        assert stdout == "", (args, stdout)
    assert not (tmp_path / "exp").exists() and os.listdir(tmp_path / "notes") == ["README.md"]


def read_only(tmp):
    """A folder this process cannot write in: chmod is no obstacle to root, sysfs is."""
    if os.geteuid() == 0:
        return "/sys"
    (tmp / "ro").mkdir()
    (tmp / "ro").chmod(0o555)
    return tmp / "ro"


def test_a_hub_start_is_pinned_to_the_commit_fetched(tmp_path, capsys, monkeypatch):
    """--start as a hub id: the run fetches it once (huggingface_hub's snapshot folder, named by the commit) and every
    stage reads that folder, so that the plan holds the commit: after the model changed under the same id, the same
    command on the experiment is another plan, refused, where the id alone had reused its finished stages. A dry run
    fetches nothing: it takes the revision this machine holds. (The hub is a double here: no network in tests.)"""
    import huggingface_hub
    import reproduce
    from conftest import tiny_model
    from machinery.hf import HUB_FILES
    from machinery.tokenizer import load_tokenizer
    need(CORPUS)
    commit, asked = ["a" * 40], []

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False, **_):
        folder = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit[0]
        asked.append(local_files_only)
        if not folder.exists():
            tiny_model().save_pretrained(folder)
            load_tokenizer("bytes").save_pretrained(folder)
        return str(folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(reproduce, "run", lambda *args: None)  # the stages are not what is tested
    monkeypatch.setattr(reproduce, "report", lambda *args: None)
    args = ["--scale=smoke", f"--out={tmp_path / 'exp'}", "--start=org/model", "--replicates=1"]
    status, _, err = in_process(capsys, *args)
    assert status == 0 and asked == [False], err
    plan = json.loads((tmp_path / "exp" / "plan.json").read_text())
    pinned = tmp_path / "hub" / "models--org--model" / "snapshots" / commit[0]
    assert f"--tokenizer {pinned / 'tokenizer.json'}" in plan["stages"]["data-corpus"]["command"]
    assert f"--init_from={pinned}" in plan["stages"]["clm-r1"]["command"]
    assert set(plan["stages"]["clm-r1"]["inputs"]) == {str(pinned / f) for f in HUB_FILES}
    status, text, _ = in_process(capsys, *args, "--dry_run")  # the revision on this machine, nothing fetched
    assert status == 0 and asked[-1] is True and f"--init_from={pinned} " in text
    commit[0] = "b" * 40  # the model changed on the hub under the same id
    status, _, err = in_process(capsys, *args)
    assert status == 2 and "holds the results of another command" in err and "clm-r1 (its command)" in err, err
    commit[0] = "a" * 40
    assert in_process(capsys, *args)[0] == 0


def test_the_gpu_hours_say_when_they_guess_the_models_size(tmp_path, capsys):
    """The paper's estimate counts the start model's FLOPs: a hub id's config.json is not here (no network), so it
    takes the recipe's architecture (base), and says so for any start but the scale's own, ModernBERT-base."""
    need(CORPUS)
    said = {}
    for start in ([], ["--start=answerdotai/ModernBERT-large"]):
        status, text, err = in_process(capsys, "--scale=paper", f"--out={tmp_path / 'exp'}", "--gpus=4", "--dry_run",
                                       *start)
        assert status == 0, err
        said[bool(start)] = next(line for line in text.splitlines() if line.startswith("the trainings: ~"))
    assert "sized" not in said[False] and said[True].endswith("; the model sized as the recipe's base: "
                                                              "--start=answerdotai/ModernBERT-large is a hub id whose "
                                                              "config.json is not here)")


def test_a_dry_run_checks_the_gpus_as_the_run_does(tmp_path, capsys, monkeypatch):
    import reproduce
    monkeypatch.setattr(reproduce, "gpu_count", lambda: 2)
    for mode in ([], ["--dry_run"]):
        status, _, err = in_process(capsys, "--scale=smoke", f"--out={tmp_path / 'exp'}", "--gpus=4", *mode)
        assert status == 2 and err == "error: --gpus=4: this machine has 2 GPU(s)\n", err
    assert not (tmp_path / "exp").exists()


def report_with(components=None, **changes):
    """A report.json as reproduce.py writes it, one difference's components in it, with `changes` to its path."""
    components = components if components is not None else dict(
        replicates=3, seeds=2, examples=940, replicate_var=2e-4, seed_var=4e-4, example_var=0.05, seeds_inside=False)
    rep = {"scale": "cpu", "finetune": {"t": {"tasks": {"ncbi_disease": {"arms": {
        "mlm": {}, "clm": {"difference": {"components": components}}}}}}}}
    for path, value in changes.items():
        *parents, last = path.split("/")
        node = rep
        for key in parents:
            node = node[key]
        node[last] = value
    return rep


C = "finetune['t'].tasks['ncbi_disease'].arms['clm'].difference.components"
BAD_COMPONENTS = [  # (the report.json, as text or as an object; what its one error line says)
    ("[1, 2]", "(top level): expected an object, got list"),
    (report_with(finetune=[1]), "finetune: expected an object, got list"),
    (report_with(**{"finetune/t": "x"}), "finetune['t'].tasks: expected an object, got NoneType None"),
    (report_with(**{"finetune/t/tasks/ncbi_disease": {"arms": [1]}}),
     "finetune['t'].tasks['ncbi_disease'].arms: expected an object, got list"),
    (report_with(**{"finetune/t/tasks/ncbi_disease/arms/clm": "x"}), "arms['clm']: expected an object whose"),
    (report_with(**{"finetune/t/tasks/ncbi_disease/arms/clm": {"difference": 3}}), "arms['clm']: expected an"),
    (report_with([1]), f"{C}: expected an object, got list"),
    (report_with({}), f"{C}.replicates: missing"),
    (report_with(dict(report_with()["finetune"]["t"]["tasks"]["ncbi_disease"]["arms"]["clm"]["difference"][
        "components"], example_var="0.05")), f"{C}.example_var: expected a finite number >= 0, got str '0.05'"),
    ('{"finetune": {"t": {"tasks": {"n": {"arms": {"a": {"difference": {"components": {"replicates": 3, "seeds": 2, '
     '"examples": 9, "replicate_var": NaN}}}}}}}}}',
     "finetune['t'].tasks['n'].arms['a'].difference.components.replicate_var: expected a finite number or null"),
]
for key, value, expected in [("replicates", 0, "an integer >= 1, got int 0"),
                             ("seeds", True, "an integer >= 1, got bool True"),
                             ("examples", 9.5, "an integer >= 1, got float 9.5"),
                             ("seed_var", -1e-4, "a finite number >= 0 or null"),
                             ("seeds_inside", "no", "true or false, got str 'no'")]:
    fine = report_with()["finetune"]["t"]["tasks"]["ncbi_disease"]["arms"]["clm"]["difference"]["components"]
    BAD_COMPONENTS.append((report_with({**fine, key: value}), f"{C}.{key}: expected {expected}"))
M = "finetune['t'].tasks['ncbi_disease'].arms['clm'].difference.measured"  # each run's difference, pooled
GOOD_MEASURED = dict(runs=[[0.01, 0.02], [0.0, 0.03]], examples=940, example_var=0.05, example_run_var=0.01)
BAD_COMPONENTS += [(report_with(**{"finetune/t/tasks/ncbi_disease/arms/clm/difference/measured": m}), f"{M}.{e}")
                   for m, e in [({**GOOD_MEASURED, "runs": [[0.01, 0.02], [0.0]]}, "runs: expected a table"),
                                ({**GOOD_MEASURED, "runs": "x"}, "runs: expected a table"),
                                ({**GOOD_MEASURED, "examples": 0}, "examples: expected an integer >= 1"),
                                ({**GOOD_MEASURED, "example_var": None}, "example_var: expected a finite number")]]
TWO = "finetune/t/tasks/ncbi_disease/arms"  # a second difference of the task, pooled with the first as one table
BAD_COMPONENTS += [(report_with(**{TWO: {"mlm": {}, "clm": {"difference": {"measured": GOOD_MEASURED}},
                                         "x": {"difference": {"measured": {**GOOD_MEASURED, **m}}}}}),
                    f"finetune['t'].tasks['ncbi_disease'].arms['x'].difference.measured.{e}")
                   for m, e in [({"runs": [[0.01], [0.0]]}, "runs: expected 2 replicates x 2 seeds, as the task's "
                                                            "first difference, got 2 x 1"),
                                ({"examples": 500}, "examples: expected 940, as the task's first difference, got 500")]]
BAD_COMPONENTS.append((report_with(**{"finetune/t/tasks/ncbi_disease/pooled": 5}),
                       "finetune['t'].tasks['ncbi_disease'].pooled: expected a list of arms, got int 5"))


@pytest.mark.parametrize("report, expected", BAD_COMPONENTS, ids=[e[:50] for _, e in BAD_COMPONENTS])
def test_the_planners_report_is_checked_field_by_field(report, expected, tmp_path, capsys):
    """--components: a report.json of reproduce.py, read by the dry run's planner; every field it reads is checked,
    and one that is not as reproduce.py writes it is one line naming the file and the field, never a traceback."""
    source = tmp_path / "report.json"
    source.write_text(report if isinstance(report, str) else json.dumps(report))
    status, _, err = in_process(capsys, "--scale=cpu", f"--out={tmp_path / 'exp'}", "--dry_run",
                                f"--components={source}")
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --components={source}: ") and expected in err, err


def test_a_plan_or_stage_record_not_as_written_is_one_line(tmp_path):
    """OUT/plan.json and OUT/stages/NAME.json, read at every invocation: a field that is not as reproduce.py writes
    it (edited by hand, another tool's) is one line naming the file and the field."""
    from machinery import stages
    from machinery.cli import InputError
    out = tmp_path / "exp"
    plan_of = [stages.Stage("cka", [sys.executable, "-c", "pass"], threaded=False)]
    plan = stages.fingerprint(plan_of, out, "test", "unit")
    out.mkdir()
    (out / "stages").mkdir()
    fingerprint = plan["stages"]["cka"]["fingerprint"]
    for written, expected in [
            ({**plan, "stages": {"cka": "x"}}, "plan.json: stages['cka']: expected an object, got str 'x'"),
            ({**plan, "stages": {"cka": {"fingerprint": 3}}}, "plan.json: stages['cka'].fingerprint: expected a str"),
            ({**plan, "fingerprint": None}, "plan.json: fingerprint: expected a string, got NoneType None"),
            ({**plan, "threads": {"cka": 0}}, "plan.json: threads: expected an object of stages' thread counts")]:
        (out / "plan.json").write_text(json.dumps(written))
        with pytest.raises(InputError) as refusal:
            stages.check_out(out, plan)
        assert expected in str(refusal.value) and "choose a new --out" in str(refusal.value), str(refusal.value)
    (out / "plan.json").write_text(json.dumps(plan))
    for record, expected in [
            ({"finished": "yes"}, "cka.json: finished: expected true or false, got str 'yes'"),
            ({"finished": True, "outputs": ["OUT/cka.json"]}, "cka.json: outputs: expected an object of paths"),
            ({"finished": True, "outputs": {}}, "cka.json: seconds: expected a finite number >= 0, got NoneType"),
            ({"finished": False, "threads": 0}, "cka.json: threads: expected an integer >= 1, got int 0")]:
        (out / "stages" / "cka.json").write_text(json.dumps({"fingerprint": fingerprint, **record}))
        with pytest.raises(InputError) as refusal:
            stages.check_out(out, plan)
            stages.run(plan_of, out, plan, 1, 1)
        assert expected in str(refusal.value) and "delete it to run the stage again" in str(refusal.value)


def test_a_tokenizer_the_plan_learns_is_no_input_of_the_data_stage(tmp_path):
    """Its content reaches the data stage's fingerprint through the tokenizer stage; counted as an input too, the
    finished experiment's second invocation would see a file the first did not and refuse its own command."""
    sys.path.insert(0, str(ROOT))
    import reproduce
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\n')
    out = tmp_path / "exp"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # as the tokenizer stage leaves it
    stages, tokenizer = reproduce.data_stages(64, [corpus], [corpus], out)
    assert tokenizer == out / "tokenizer.json" and [s.name for s in stages] == ["tokenizer", "data-corpus"]
    assert stages[1].inputs == [corpus]
    mine = tmp_path / "mine.json"  # a tokenizer file of the user's is an input: its content counts
    mine.write_text("{}")
    assert reproduce.data_stages(mine, [], [corpus], out)[0][0].inputs == [corpus, mine]


def test_the_report_names_the_commit_of_its_code_and_uncommitted_edits():
    """The report's code row: the commit whose code ran (its source digest alone cannot be traced back), and where
    the scripts or machinery/ held edits not committed (an ablation), that it was not that commit's code."""
    sys.path.insert(0, str(ROOT))
    import reproduce
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert reproduce.commit_words({"git": commit}) == ", at commit `0123456789ab`"
    assert reproduce.commit_words({"git": commit + "+edits"}) == ", at commit `0123456789ab` plus uncommitted edits " \
                                                                 "to them"
    assert reproduce.commit_words({"git": None}) == reproduce.commit_words({}) == ""  # no git; a report before it


def test_the_dry_run_says_what_the_plan_can_detect(tmp_path, capsys):
    """From a report's runs: per task, the variance components pooled over its arms (machinery/compare.py's
    `components`), the difference the plan detects with 80% power with its range over their uncertainty; with
    --detect, the replicates (at the paper's scale with their GPU-hours), seeds or test examples that would reach
    each difference, at the estimate and at both bounds. A report written before reports kept each run's differences: each difference's
    own components, averaged, said so; a replicate part below 0, said so. Bad input is one line: --detect of 0 or
    below, a report without components."""
    need(CORPUS)
    sys.path.insert(0, str(ROOT))
    import numpy as np
    from machinery.compare import components, floor, needed, project
    from machinery.planfiles import averaged
    rng = np.random.default_rng(0)
    runs = {arm: rng.normal(0, 0.02, (3, 2)) for arm in ("clm", "x")}
    measured = {arm: dict(runs=r.tolist(), examples=940, example_var=0.05, example_run_var=0.03)
                for arm, r in runs.items()}
    rep = {"scale": "cpu", "finetune": {"t": {"tasks": {"ncbi_disease": {"pooled": ["clm", "x"], "arms": {
        "mlm": {}, **{arm: {"difference": {"measured": m, "components": {}}} for arm, m in measured.items()}}}}}}}
    source = tmp_path / "report.json"
    source.write_text(json.dumps(rep))
    out = tmp_path / "exp"
    status, text, err = in_process(capsys, "--scale=cpu", f"--out={out}", "--dry_run", f"--components={source}",
                                   "--detect=3,2")
    assert status == 0, err
    c = components([[{**m, "runs": runs[arm]} for arm, m in measured.items()]])
    at = {reading: 100 * project(c, 3, 2, 940, reading)["detectable"] for reading in ("point", "low", "high")}
    ncbi = next(line for line in text.splitlines() if line.startswith("  ncbi_disease:"))
    assert f"detects {at['point']:.1f} points with 80% power [{at['low']:.1f}, {at['high']:.1f}]" in ncbi
    assert "940 test" in ncbi and "pooled over 2 differences" in ncbi and "4 degrees of freedom" in ncbi
    assert f"detects less than {100 * floor(c, 940):.1f} on all 940 test examples" in ncbi and floor(c, 940) > 0
    from reproduce import floor_line
    assert "less than" not in floor_line(0.0, 500) and "about 0" in floor_line(4e-4, 500)
    for target in (3, 2):
        ways = next(line for line in text.splitlines() if line.startswith(f"    to detect {target} points"))
        need_ = {r: needed(c, target / 100, 3, 2, 940, 940, reading=r) for r in ("point", "low", "high")}
        assert re.match(rf"    to detect {target} points, one change at a time: {need_['point']['replicates']} "
                        rf"replicates \(~[\d.]+ CPU hours in all, [\d.]+ (more|fewer)\) "
                        rf"\[{need_['low']['replicates']}, ", ways) and "GPU-hours" not in ways  # cpu: CPU hours
    assert "chemprot: the source report holds no comparison" in text and "BORROWED" not in text
    assert not out.exists()
    older = dict(replicates=3, seeds=2, examples=940, replicate_var=-2e-4, seed_var=8e-4, example_var=0.05,
                 seeds_inside=False)  # a report of the version before: each difference's own components
    rep = {"scale": "cpu", "finetune": {"t": {"tasks": {"ncbi_disease": {"arms": {
        "mlm": {}, "clm": {"difference": {"components": older}}}}}}}}
    source.write_text(json.dumps(rep))
    status, text, err = in_process(capsys, "--scale=paper", f"--out={out}", "--dry_run", "--gpus=4",
                                   f"--components={source}", "--detect=2.8")
    assert status == 0, err
    ncbi = next(line for line in text.splitlines() if line.startswith("  ncbi_disease:"))
    assert f"detects {100 * project(averaged([older]), 3, 5, 940)['detectable']:.1f} points" in ncbi
    assert "BORROWED from the cpu scale" in text and "each difference's own components, averaged" in text
    ways = next(line for line in text.splitlines() if line.startswith("    to detect 2.8 points"))
    assert re.search(r"\d+ replicates \((this plan's )?~[\d,.]+ H100 GPU-hours", ways), ways  # paper: GPU-hours
    assert "replicate variance's estimate is below 0" in text
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"scale": "cpu", "finetune": {}}))
    for args, message in (([f"--components={source}", "--detect=0"], "--detect: expected a finite number above 0"),
                          ([f"--components={source}", "--detect=2,-1"], "expected a finite number above 0, got '-1'"),
                          ([f"--components={bare}"], "no variance components in it"),
                          ([f"--components={tmp_path / 'none.json'}"], "none.json: not found")):
        status, _, err = in_process(capsys, "--scale=cpu", f"--out={out}", "--dry_run", *args)
        assert status == 2 and message in err, (args, err)


def test_without_the_data_a_run_says_where_they_come_from_and_a_dry_run_goes_on(tmp_path, capsys):
    """A fresh clone has no corpus, tasks or held-out texts: a run is one line naming what --data lacks, where those
    come from and the command that fetches them; a dry run prints every command, the power from the committed report
    (its test-set sizes) and what is missing, without checking OUT against a plan it cannot fingerprint."""
    empty, out = tmp_path / "empty", tmp_path / "exp"
    empty.mkdir()
    status, _, err = in_process(capsys, "--scale=cpu", f"--out={out}", f"--data={empty}")
    assert status == 2 and len(err.splitlines()) == 1, err
    for words in (f"--data={empty}: it lacks corpus/e3c_en_clinical_cases.jsonl, tasks/ncbi_disease", "E3C",
                  "NCBI-disease, ChemProt and PubMedQA", f"`python data.py fetch --out={empty}`", "--data names"):
        assert words in err, words
    status, text, err = in_process(capsys, "--scale=cpu", f"--out={out}", f"--data={empty}", "--dry_run")
    assert status == 0, err
    lines = text.splitlines()
    assert sum(": python" in line for line in lines) == 56 and not out.exists()
    assert any(line.startswith("  ncbi_disease: 940 test examples: detects") for line in lines)
    assert lines[-2].startswith(f"missing: {empty / 'corpus' / 'e3c_en_clinical_cases.jsonl'}, ")
    assert "python data.py fetch" in lines[-2]
    assert lines[-1] == (f"56 stages; not checked: the 5 missing input(s) above, and {out} against the plan (its "
                         f"fingerprints read them); nothing was run (--dry_run)")
    (tmp_path / "file").write_text("x")  # but OUT is checked as the run would meet it
    status, text, err = in_process(capsys, "--scale=cpu", f"--out={tmp_path / 'file' / 'exp'}", f"--data={empty}",
                                   "--dry_run")
    assert status == 2 and err.startswith(f"error: --out={tmp_path / 'file' / 'exp'}: cannot write there"), err


def test_detect_answers_with_their_cost(tmp_path, capsys):
    """--detect's replicates come with the CPU hours of the plan that has them, the same as a dry run with that
    many --replicates totals; seeds scale the fine-tuning stages; more test examples train nothing more."""
    need(CORPUS)
    components = dict(replicates=3, seeds=2, examples=940, replicate_var=5e-5, seed_var=1e-3, example_var=0.02,
                      seeds_inside=False)  # 8 replicates or 17 seeds detect 3 points
    source = tmp_path / "report.json"
    source.write_text(json.dumps({"scale": "cpu", "finetune": {"t": {"tasks": {"ncbi_disease": {"arms": {
        "mlm": {}, "clm": {"difference": {"components": components}}}}}}}}))
    out = tmp_path / "exp"
    status, text, _ = in_process(capsys, "--scale=cpu", f"--out={out}", "--dry_run", "--detect=3",
                                 f"--components={source}")
    ways = next(line for line in text.splitlines() if line.startswith("    to detect 3 points"))
    replicates = int(ways.split("one change at a time: ")[1].split()[0])
    price = float(ways.split(f"{replicates} replicates (~")[1].split()[0])
    status, again, _ = in_process(capsys, "--scale=cpu", f"--out={out}", "--dry_run", f"--replicates={replicates}",
                                  f"--components={source}")
    assert status == 0 and replicates > 3
    assert again.splitlines()[-2].startswith(f"the stages: ~{price:.3g} CPU hours in all")
    assert "seeds (~" in ways and "CPU hours in all" in ways.split("seeds (~")[1]


# A stage's command in miniature: writes its --out (as eval.py and data.py take it) or a run directory's files.
WRITES = ("import sys, pathlib\n"
          "a = sys.argv[1:]\n"
          "p = pathlib.Path(a[1] if a[0] in ('--out', '--out_dir') else a[0].split('=', 1)[1])\n"
          "if a[0] == '--out_dir':\n"
          "    p.mkdir(parents=True)\n"
          "    for name in ('run.json', 'log.jsonl', 'config.json', 'model.safetensors', 'README.md'):\n"
          "        (p / name).write_text(name + ' of the stage')\n"
          "else:\n"
          "    p.write_text('the stage wrote this')\n")


def test_an_experiment_run_by_other_code_is_refused(tmp_path, monkeypatch):
    """The code is in every stage's fingerprint: after an edit to any module (here machinery/compare.py, in a copy
    of the code) the same command on a finished experiment is refused, saying that the code changed, and no
    stage of it counts as finished; the same code elsewhere (an unedited copy) is the same plan."""
    from machinery import cli, stages
    from machinery.cli import InputError
    out = tmp_path / "exp"
    plan_of = [stages.Stage("cka", [sys.executable, "-c", WRITES, f"--out={out / 'cka.json'}"], threaded=False)]
    plan = stages.fingerprint(plan_of, out, "test", "unit")
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))
    stages.run(plan_of, out, plan, 1, 1)
    monkeypatch.setattr(cli, "REPOSITORY", source_copy(tmp_path / "same"))
    assert stages.fingerprint(plan_of, out, "test", "unit") == plan
    stages.check_out(out, plan)
    monkeypatch.setattr(cli, "REPOSITORY", source_copy(tmp_path / "edited", "machinery/compare.py"))
    edited = stages.fingerprint(plan_of, out, "test", "unit")
    with pytest.raises(InputError, match=r"holds the results of another command \(test at scale unit, run by other "
                                         r"code: a \.py file of the repository changed since"):
        stages.check_out(out, edited)
    assert not stages.stage_record(out, "cka", edited["stages"]["cka"]["fingerprint"])


def test_an_experiment_run_on_other_packages_is_refused(tmp_path, monkeypatch):
    """The versions of the packages are in every stage's fingerprint too: the same code on another torch build is
    another command, refused naming the versions that changed; the plan records them and the report states them."""
    from machinery import cli, stages
    from machinery.cli import InputError
    out = tmp_path / "exp"
    plan_of = [stages.Stage("cka", [sys.executable, "-c", WRITES, f"--out={out / 'cka.json'}"], threaded=False)]
    plan = stages.fingerprint(plan_of, out, "test", "unit")
    assert plan["versions"] == cli.versions()
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))
    stages.run(plan_of, out, plan, 1, 1)
    monkeypatch.setattr(stages, "versions", lambda: {**cli.versions(), "torch": "2.11.0+cu130"})
    other = stages.fingerprint(plan_of, out, "test", "unit")
    assert other["stages"]["cka"]["fingerprint"] != plan["stages"]["cka"]["fingerprint"]
    with pytest.raises(InputError, match=rf"\(test at scale unit, run on other packages: torch "
                                         rf"{re.escape(cli.versions()['torch'])} -> 2\.11\.0\+cu130\)"):
        stages.check_out(out, other)


def test_no_stage_starts_under_code_or_packages_its_experiment_was_not_planned_with(tmp_path, monkeypatch):
    """An edit (or a pip install) while a study runs: each stage is handed the plan's code and packages and refuses
    to start under others, its log saying why; it is not finished and no stage after it starts. With the planned
    code the same run finishes them. The driver will not write the report once the code on disk is not the plan's."""
    from machinery import cli, stages
    from machinery.cli import InputError
    out = tmp_path / "exp"
    plan_of = [stages.Stage("help", [sys.executable, str(ROOT / "data.py"), "--help"], threaded=False),
               stages.Stage("cka", [sys.executable, "-c", WRITES, f"--out={out / 'cka.json'}"], needs=["help"],
                            threaded=False)]
    plan = stages.fingerprint(plan_of, out, "test", "unit")
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))
    for other, why in ((dict(code="0" * 64), r"other code than its experiment was planned with \(000000000000 then, "),
                       (dict(versions={**plan["versions"], "torch": "2.11.0+cu130"}),
                        r"on other packages than its experiment was planned with \(torch 2\.11\.0\+cu130 -> ")):
        with pytest.raises(SystemExit):
            stages.run(plan_of, out, {**plan, **other}, 1, 1)
        assert re.search(r"error: this stage of a reproduce\.py experiment would run " + why,
                         (out / "logs" / "help.log").read_text())
        assert not stages.stage_record(out, "help", plan["stages"]["help"]["fingerprint"]).get("finished")
        assert not (out / "logs" / "cka.log").exists()
    stages.run(plan_of, out, plan, 1, 1)
    assert all(stages.stage_record(out, n, e["fingerprint"]).get("finished") for n, e in plan["stages"].items())
    stages.check_unchanged(plan)
    monkeypatch.setattr(cli, "REPOSITORY", source_copy(tmp_path / "edited", "machinery/compare.py"))
    with pytest.raises(InputError, match=r"^every stage has finished, but the code changed while the experiment ran"):
        stages.check_unchanged(plan)
    live = source_copy(tmp_path / "live")  # read as the driver starts (and kept by the process), then edited in place
    monkeypatch.setattr(cli, "REPOSITORY", live)
    started = {**plan, "code": cli.source_digest()}
    stages.check_unchanged(started)
    with open(live / "machinery" / "compare.py", "a") as f:
        f.write("# edited while the experiment ran\n")
    with pytest.raises(InputError, match=r"^every stage has finished, but the code changed while the experiment ran"):
        stages.check_unchanged(started)


def test_a_finished_stage_whose_output_was_replaced_is_refused_naming_it(tmp_path, capsys):
    """A finished stage records the digests of what it wrote (an --out file, a run directory's run, log and
    weights); a rerun checks them before it skips the stage, and one replaced since (a hand run into the same
    file) or gone is one line naming the stage and the file. The model card is not a result: editing it is fine."""
    from machinery import stages
    from machinery.cli import InputError
    out = tmp_path / "exp"
    run_dir = out / "runs" / "mlm-r1"
    plan_of = [stages.Stage("cka", [sys.executable, "-c", WRITES, f"--out={out / 'cka.json'}"], threaded=False),
               stages.Stage("tokenizer", [sys.executable, "-c", WRITES, "--out", out / "tok.json"], threaded=False),
               stages.Stage("mlm-r1", [sys.executable, "-c", WRITES, "--out_dir", run_dir], run_dir=str(run_dir),
                            threaded=False)]
    plan = stages.fingerprint(plan_of, out, "test", "unit")
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))  # as reproduce.py writes it before the first stage
    stages.run(plan_of, out, plan, 1, 1)
    records = {s.name: json.loads((out / "stages" / f"{s.name}.json").read_text()) for s in plan_of}
    assert set(records["cka"]["outputs"]) == {"OUT/cka.json"} and set(records["tokenizer"]["outputs"]) == {
        "OUT/tok.json"}
    assert set(records["mlm-r1"]["outputs"]) == {f"OUT/runs/mlm-r1/{n}" for n in stages.RUN_OUTPUTS}
    (run_dir / "README.md").write_text("the card, edited before publishing")
    stages.check_out(out, plan)
    capsys.readouterr()
    stages.run(plan_of, out, plan, 1, 1)
    assert capsys.readouterr().out.count("[skip]") == 3
    for path, change, how in [(out / "cka.json", "a hand run's numbers", "is not what the stage wrote"),
                              (run_dir / "log.jsonl", None, "is gone"),
                              (run_dir / "model.safetensors", "other weights", "is not what the stage wrote")]:
        kept = path.read_bytes()
        path.write_text(change) if change else path.unlink()
        with pytest.raises(InputError) as refusal:
            stages.check_out(out, plan)
        name = "cka" if path.name == "cka.json" else "mlm-r1"
        assert str(refusal.value).startswith(f"stage {name} finished, but {path} {how}: another command wrote there")
        assert f"delete {out / 'stages' / name}.json to run the stage again" in str(refusal.value)
        # a training's file alone moved away, its run would be continued from its end and write nothing
        assert (f"Move its run directory {run_dir} away and" in str(refusal.value)) == (name == "mlm-r1")
        path.write_bytes(kept)
    stages.check_out(out, plan)  # as the stages wrote them again


SAYS = ("import sys, pathlib\n"  # writes its last argument (--threads=N) to --out; with a marker, fails until it exists
        "a = sys.argv[1:]\n"
        "if len(a) > 2 and not pathlib.Path(a[1]).exists():\n"
        "    sys.exit(1)\n"
        "pathlib.Path(a[0].split('=', 1)[1]).write_text(a[-1])\n")


def test_a_rerun_with_another_jobs_keeps_every_stages_threads(tmp_path, capsys):
    """A CPU run's numbers change with its thread count, which --jobs sets: a stage that first starts in a rerun with
    another --jobs (or on a machine with other cores) takes the threads the plan's first invocation fixed."""
    from machinery import stages
    out, marker = tmp_path / "exp", tmp_path / "fixed"
    plan_of = [stages.Stage("fails", [sys.executable, "-c", SAYS, f"--out={out / 'fails.txt'}", marker]),
               stages.Stage("after", [sys.executable, "-c", SAYS, f"--out={out / 'after.txt'}"], ["fails"])]
    plan = stages.fingerprint(plan_of, out, "test", "unit")
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(SystemExit):  # interrupted before `after` starts: --jobs=1 on 2 cores, 2 threads each
        stages.run(plan_of, out, plan, 1, 2)
    marker.touch()
    stages.run(plan_of, out, plan, 2, 2)  # the same command with --jobs=2 would give each stage 1 thread
    assert (out / "fails.txt").read_text() == (out / "after.txt").read_text() == "--threads=2"
    assert "each stage takes the threads its plan fixed at its first invocation" in capsys.readouterr().out
    # a solo stage (the start model) runs alone on every core; --jobs above the cores leaves each stage one
    alone = [stages.Stage("start", [], solo=True), stages.Stage("arm", [])]
    assert stages.plan_threads(tmp_path / "new", alone, 8, 4) == {"start": 4, "arm": 1}


def test_a_solo_stage_runs_with_no_other_stage_beside_it(tmp_path):
    """A solo stage (the start model) has every core: it waits for the stages running when it is ready, and no stage
    starts beside it, whatever --jobs allows."""
    from machinery import stages
    out = tmp_path / "exp"
    slow = "import time; time.sleep(0.5)\n" + SAYS  # writes its last argument: the solo stage its --threads
    plan_of = [stages.Stage("a", [sys.executable, "-c", slow, f"--out={out / 'a.txt'}"], threaded=False),
               stages.Stage("start", [sys.executable, "-c", slow, f"--out={out / 'start.txt'}"], solo=True),
               stages.Stage("b", [sys.executable, "-c", slow, f"--out={out / 'b.txt'}"], threaded=False)]
    plan = stages.fingerprint(plan_of, out, "test", "unit")
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))
    stages.run(plan_of, out, plan, 3, 3)
    spans = {s.name: json.loads((out / "stages" / f"{s.name}.json").read_text()) for s in plan_of}
    alone = spans.pop("start")
    assert all(r["end"] <= alone["start"] or r["start"] >= alone["end"] for r in spans.values()), spans
    assert (out / "start.txt").read_text() == "--threads=3"


def test_a_stage_that_ends_without_writing_its_outputs_is_not_finished(tmp_path, capsys):
    """A stage that exits 0 with an output missing (a training continued from its end writes nothing: its weights,
    moved away by hand, stay gone) fails with a line naming the file, and is never recorded as finished, which a
    rerun would skip with the output still missing."""
    from machinery import stages
    out = tmp_path / "exp"
    run_dir = out / "runs" / "mlm-r1"
    plan_of = [stages.Stage("mlm-r1", [sys.executable, "-c", "pass", "--out_dir", run_dir], run_dir=str(run_dir),
                            threaded=False)]
    plan = stages.fingerprint(plan_of, out, "test", "unit")
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(SystemExit) as failure:
        stages.run(plan_of, out, plan, 1, 1)
    assert failure.value.code == 1
    assert "[failed] mlm-r1: it ended without writing OUT/runs/mlm-r1/run.json, " in capsys.readouterr().out
    assert json.loads((out / "stages" / "mlm-r1.json").read_text())["finished"] is False


def test_the_report_draws_each_step_at_the_learning_rate_it_trained_at():
    """report.png's learning rate: a step's rate held over the tokens it trained, from the run's first token, so
    that a one-step decay (a smoke scale's) is one flat step at the rate it ran at, and reads as one step, not as a
    decay."""
    pytest.importorskip("matplotlib")
    from machinery import report
    from machinery.curves import new_figure
    runs = {"mlm-r1": dict(continues=None, tokens=3072, objective="mlm", val=[[3072, 4.0, 7.0]],
                           lr=[[1024, 5e-4], [2048, 1e-3], [3072, 1e-3]]),
            "mlm-decay-r1": dict(continues="mlm-r1", tokens=1024, objective="mlm", val=[[1024, 3.9, 7.1]],
                                 lr=[[1024, 1e-3]])}
    axes = new_figure((6, 2), 40).subplots(1, 3)
    report.draw_curves(axes, dict(runs=runs, replicates=1), dict(final=["mlm-decay"], names={"mlm-decay": "MLM"}),
                       {"mlm-decay": "C0"})
    (line,) = [ln for ln in axes[2].get_lines() if ln.get_color() == "C0"]  # not the switch's dotted line
    assert line.get_drawstyle() == "steps-pre"
    assert list(zip(line.get_xdata(), line.get_ydata())) == [(0, 5e-4), (1024, 5e-4), (2048, 1e-3), (3072, 1e-3),
                                                             (4096, 1e-3)]


def test_docs_state_the_sums_the_dry_run_prints(capsys):
    """docs/reproducing.md's plans for the papers' effects and for the biphasic study's 3 points are what the dry
    runs print: every number of those sentences is in the dry run's output (or is the paper's, or the design's)."""
    need(CORPUS)
    text = (ROOT / "docs" / "reproducing.md").read_text()
    plans = [("What the papers' effects would need.", ["--scale=paper", "--gpus=4", "--detect=2.8,2,1,0.3"]),
             ("**Where the power went.**", ["--study=biphasic", "--scale=cpu", "--detect=3"])]
    for start, args in plans:
        paragraph = text[text.index(start):].split("\n\n")[0]
        status, out, err = in_process(capsys, *args, f"--out={ROOT / 'out' / 'never-made'}", "--dry_run")
        assert status == 0, err
        number = r"(?<![\w.,-])\d{1,3}(?:,\d{3})*(?:\.\d+)?(?!\w|,\d)"
        printed, stated = set(re.findall(number, out)), re.findall(number, paragraph.replace("`", " "))
        design = {"0.3", "0.8", "2.7", "61.6", "58.9", "2.8", "2", "1", "3", "5", "4", "200", "4.5", "29.0", "6.4",
                  "20.9", "5.3", "8.1", "2.5", "3.1", "10.9", "11.1", "5.7", "8.9"}
        assert not [x for x in stated if x not in printed and x not in design], paragraph
        below = re.findall(r"(\w+)'s replicate variance was estimated below 0 \((-[\d.]+) points", paragraph)
        assert len(below) == paragraph.count("replicate variance"), paragraph  # each names its task
        for task, value in below:  # the task's own block of the dry run prints it
            assert f"({value} points^2" in re.search(rf"\n  {task}: .*?(?=\n  \S|\Z)", out, re.S).group(), task
        if "--scale=paper" in args:  # the detour's total, as the section before states it
            assert "the trainings: ~200 H100 GPU-hours" in out
            assert "about 200 GPU-hours (its seed controls included)" in text


def test_the_report_says_when_fine_tuning_scored_dev():
    """What the report says of fine-tuning is what eval.py finetune did with those settings: dev scored --evals
    times where given, 4 times in a step budget, after every epoch in an epoch budget (the paper scale's)."""
    import eval as ev
    import reproduce
    from machinery.cli import pick_device
    for ft in (dict(steps=300, epochs=3, evals=2), dict(steps=300), dict(seeds="42", max_len=512, dev_min=200)):
        said = reproduce.fine_tuning_budget(ft)
        s = ev.Settings(ft.get("epochs"), ft.get("steps"), ft.get("evals"), 5e-5, 512, 16, "cls", 0,
                        pick_device("cpu"), "default")
        kind = ev.KINDS["single"]
        total, points = ev.budget(kind, 1600, s)
        want = "after every epoch" if len(points) == total // 100 and "steps" not in ft else f"{len(points)} times"
        assert f"dev scored {want}" in said, (ft, said, points)


def test_a_loss_difference_without_an_interval_is_not_counted_as_excluding_0():
    """With one replicate a loss difference has no interval (its verdict says so): the report's count of the
    intervals that exclude 0, against what chance alone gives, leaves it out rather than count it as one that does."""
    import reproduce
    from machinery.report import chance_lines
    runs = {f"{m}-r1": dict(objective="mlm", continues="", val=[[1024, 3.0 + d, 6.0 - d]])
            for m, d in (("mlm", 0.0), ("a", 0.2))}
    losses = reproduce.losses(runs, ["mlm", "a"], "mlm", 1)
    assert losses["a"]["val_mlm"]["difference"]["verdict"] == "no interval"
    assert chance_lines({"losses": {"the decayed models": losses}, "finetune": {}}) == []


def test_an_input_whose_content_changed_is_another_command(tmp_path, monkeypatch):
    """An input's content is in its stage's fingerprint: a file edited in place (same name and size), a weights file
    of a model folder (a --start) replaced, and a file larger than what is hashed whole changed in its first or its
    last MiB each make another command, refused naming the input; a hidden file of a folder (a lock) is no content."""
    from machinery import stages
    from machinery.cli import InputError
    monkeypatch.setattr(stages, "WHOLE", 1 << 20)  # a 3 MiB file is hashed by its size, first and last MiB
    out, corpus, start, big = tmp_path / "exp", tmp_path / "corpus.jsonl", tmp_path / "start", tmp_path / "big.bin"
    corpus.write_text('{"text": "a cell"}\n')
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"weights")
    big.write_bytes(bytes(3 << 20))
    plan_of = [stages.Stage("data", [sys.executable, "-c", "pass"], inputs=[corpus, start, big], threaded=False)]

    def plan():  # as a new invocation reads its inputs again
        stages.content.cache_clear()
        return stages.fingerprint(plan_of, out, "test", "unit")
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan()))
    (start / ".lock").write_text("held")
    stages.check_out(out, plan())
    for path, at in ((corpus, 10), (start / "model.safetensors", 3), (big, 0), (big, (3 << 20) - 1)):
        kept = path.read_bytes()
        path.write_bytes(kept[:at] + b"x" + kept[at + 1:])
        named = start if path.parent == start else path  # a folder is one input
        with pytest.raises(InputError, match=rf"1 stages differ: data \(the content of {re.escape(str(named))}\)"):
            stages.check_out(out, plan())
        path.write_bytes(kept)
    stages.check_out(out, plan())


def test_the_driver_writes_no_report_once_its_code_changed_while_the_stages_ran(tmp_path, capsys, monkeypatch):
    """The code an experiment is planned with is read as the driver starts: a module edited while the stages run
    stops the driver before the report, which the edited code would write."""
    need(CORPUS)
    import reproduce
    from machinery import cli
    live = source_copy(tmp_path / "code")
    monkeypatch.setattr(cli, "REPOSITORY", live)
    written = []

    def stages_ran(*_):  # every stage finished; meanwhile a module was edited
        with open(live / "machinery" / "compare.py", "a") as f:
            f.write("# edited while the experiment ran\n")
    monkeypatch.setattr(reproduce, "run", stages_ran)
    monkeypatch.setattr(reproduce, "report", lambda *args: written.append(args))
    status, _, err = in_process(capsys, "--scale=smoke", f"--out={tmp_path / 'exp'}")
    assert status == 2 and err.startswith("error: every stage has finished, but the code changed"), err
    assert written == []


def test_the_wall_time_counts_each_second_that_some_stage_ran_once(tmp_path):
    """The report's wall time: the union of the stages' spans (two side by side count once, a pause between
    invocations not at all); the summed time adds every stage's."""
    from machinery import stages
    (tmp_path / "stages").mkdir()
    spans = {"a": (100.0, 110.0), "b": (105.0, 115.0), "c": (106.0, 108.0), "d": (109.0, 116.0),
             "e": (120.0, 125.0)}
    for name, (start, end) in spans.items():
        (tmp_path / "stages" / f"{name}.json").write_text(json.dumps(dict(
            fingerprint="f", threads=1, finished=True, seconds=end - start, start=start, end=end)))
    times = stages.stage_times(tmp_path, [stages.Stage(name, []) for name in spans])
    assert times == dict(stages={"a": 10.0, "b": 10.0, "c": 2.0, "d": 7.0, "e": 5.0}, summed=34.0, wall=21.0)


def test_no_two_replicates_share_a_fine_tuning_seed():
    """Replicate r's fine-tuning seeds are the scale's moved past every seed of the replicates before it, however
    the scale's are spaced."""
    import reproduce
    seeds = lambda given, R: [reproduce.ft_seeds({"ft": {"seeds": given}}, r) for r in range(1, R + 1)]  # noqa: E731
    assert seeds("42,43", 3) == ["42,43", "44,45", "46,47"] and seeds("42", 3) == ["42", "43", "44"]
    spaced = [set(s.split(",")) for s in seeds("42,44,50", 4)]
    assert all(not spaced[i] & spaced[j] for i in range(4) for j in range(i)) and spaced[0] == {"42", "44", "50"}


def test_the_needle_reads_up_to_the_length_each_scale_trained_at(tmp_path):
    """The needle's lengths: powers of two from the scale's shortest up to the sequence length its train.py
    recipe trains at, that length included."""
    import reproduce
    from train import RECIPES, Config
    for scale, s in reproduce.DETOUR.items():
        command = reproduce.needle_stage(s, tmp_path, 2, tmp_path / "heldout.jsonl").command
        lengths = [int(x) for x in reproduce.flag(command, "lengths").split(",")]
        seq_len = {**vars(Config()), **RECIPES[s["recipe"]]}["seq_len"]
        assert lengths == [s["needle"]["shortest"] * 2 ** i for i in range(len(lengths))] and lengths[-1] == seq_len


def test_the_loss_differences_are_paired_t_intervals_whose_verdicts_follow_them():
    """Each model's final validation losses (the last eval of each replicate) against its reference's, replicate by
    replicate: the 95% interval of scipy's t, "lower" or "higher" only where it excludes 0, the difference a
    two-sided t test over the replicates detects with 80% power (scipy's noncentral t), and whether the two
    trained different objectives."""
    import numpy as np
    from scipy import stats
    import reproduce
    base = {"mlm": [3.0, 3.2, 3.1], "clm": [6.0, 6.1, 6.3]}
    shift = {"a": {"mlm": [-0.10, -0.13, -0.08], "clm": [0.05, -0.06, 0.02]},
             "b": {"mlm": [0.30, 0.36, 0.41], "clm": [-0.9, -1.0, -1.2]}}
    runs = {}
    for r in range(3):
        for m, objective in (("mlm", "mlm"), ("a", "mlm"), ("b", "clm")):
            final = [base[k][r] + (shift[m][k][r] if m in shift else 0.0) for k in ("mlm", "clm")]
            runs[f"{m}-r{r + 1}"] = dict(objective=objective, continues="", val=[[512, 9.0, 9.0], [1024, *final]])
    got = reproduce.losses(runs, ["mlm", "a", "b"], "mlm", 3)
    t = stats.t.ppf(0.975, 2)
    for m, key, verdict in (("a", "mlm", "lower"), ("a", "clm", "no detectable difference"), ("b", "mlm", "higher"),
                            ("b", "clm", "lower")):
        d, row = np.array(shift[m][key]), got[m][f"val_{key}"]
        se = d.std(ddof=1) / np.sqrt(3)
        assert row["each"] == pytest.approx([x + y for x, y in zip(base[key], d)])
        assert [row["difference"][k] for k in ("mean", "low", "high")] == pytest.approx(
            [d.mean(), d.mean() - t * se, d.mean() + t * se])
        assert row["difference"]["verdict"] == verdict
        nc = row["difference"]["detectable"] / se
        assert stats.nct.sf(t, 2, nc) + stats.nct.cdf(-t, 2, nc) == pytest.approx(0.8, abs=1e-3)
        assert row["difference"]["by_construction"] == (m == "b")
    assert "difference" not in got["mlm"]["val_mlm"]
    from machinery.report import summary  # the verdicts' list says each of them of its own loss
    line = next(x for x in summary({"losses": {"t": got}, "finetune": {}, "replicates": 3}, {"names": {}})
                if x.startswith("- **a**"))
    assert re.fullmatch(r"- \*\*a\*\* against mlm: validation MLM loss -0\.103 \[\S+ \S+\] \(lower\); validation CLM "
                        r"loss \+0\.003 \[\S+ \S+\] \(no detectable difference\)\.", line), line


def test_the_appendix_averages_each_settings_dev_and_test_scores_over_every_run(tmp_path):
    """The appendix (per_setting): per fine-tuned model, task and lr, the mean dev and the mean test score over every
    seed of every replicate, and the task's majority baseline on dev, from results files as eval.py writes them."""
    import reproduce
    s, models = {"lrs": [1e-3, 3e-3]}, reproduce.FINETUNED["detour"]
    (tmp_path / "finetune").mkdir()
    for i, m in enumerate(models):
        for lr in s["lrs"]:
            for r in (1, 2):  # two seeds each: dev i + lr + 0.1 r + 0.01 k, test 0.5 - 0.1 r - 0.01 k
                seeds = {str(40 + 2 * r + k): {"dev": {"f1": i + lr + 0.1 * r + 0.01 * k},
                                               "test": {"f1": 0.5 - 0.1 * r - 0.01 * k}} for k in (0, 1)}
                task = dict(primary="f1", kind="ner", majority="O", scored=["O"], seeds=seeds,
                            baseline={"dev": {"f1": 0.2}, "test": {"f1": 0.25}})
                reproduce.ft_path(tmp_path, f"{m}-r{r}", lr).write_text(json.dumps({"tasks": {"ncbi_disease": task}}))
    table = reproduce.per_setting(tmp_path, s, "detour", 2)
    assert list(table) == models
    for i, m in enumerate(models):
        for lr in s["lrs"]:
            row = table[m]["ncbi_disease"][f"{lr:g}"]
            assert row == dict(metric="f1", dev=pytest.approx(i + lr + 0.155), test=pytest.approx(0.345),
                               dev_baseline=0.2, runs=4)
