"""reproduce.py: the smoke scale end to end (killed midway, resumed, then skipped), and the paper scale's dry run."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, SHARED_DATA, need

CORPUS = SHARED_DATA / "corpus" / "e3c_en_clinical_cases.jsonl"


def reproduce(*args, **kwargs):
    return subprocess.Popen([sys.executable, str(ROOT / "reproduce.py"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def finished(proc):
    out, _ = proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    return out


def finite_numbers(obj):
    """Every number in a JSON tree, to check that none is NaN or infinite."""
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in finite_numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in finite_numbers(v)]
    return [obj] if isinstance(obj, (int, float)) and not isinstance(obj, bool) else []


def without_times(report):
    return {k: v for k, v in report.items() if k not in ("seconds",)}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke scale, killed (with its whole process group, as Ctrl-C would) once a training arm runs, then
    run again to the end; returns (out dir, the second and third invocations' output)."""
    need(CORPUS)
    out = tmp_path_factory.mktemp("smoke") / "exp"
    first = reproduce("--scale=smoke", f"--out={out}", "--jobs=2", start_new_session=True)
    while not (out / "stages" / "mlm.json").exists() and first.poll() is None:
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate()
    assert first.returncode == -9, "the smoke run finished before it could be interrupted"
    second = finished(reproduce("--scale=smoke", f"--out={out}", "--jobs=2"))
    third = finished(reproduce("--scale=smoke", f"--out={out}", "--jobs=2"))
    return out, second, third


def test_smoke_report_holds_every_table_with_finite_numbers(smoke):
    out, second, _ = smoke
    assert "[skip]   mlm: finished" in second  # what the killed invocation finished is not run again
    report = json.loads((out / "report.json").read_text())
    assert set(report["cka"]) == {"before", "after"} and all(len(rows) == 4 for rows in report["cka"].values())
    assert set(report["finetune"]) == {"ncbi_disease", "chemprot", "pubmedqa"}
    for row in report["finetune"].values():
        assert {"clm-decay", "mlm-decay", "clm-freeze-low-decay", "clm-freeze-mid-decay", "clm-decay-freeze-low"} <= set(row)
        assert all(len(row[m]["seeds"]) == 5 for m in row if m != "metric")
    assert set(report["paired_clm_minus_mlm"]) == set(report["finetune"])
    assert {"clm", "mlm", "mlm-seed18", "clm-decay", "mlm-decay", "start"} <= set(report["validation"])
    numbers = finite_numbers(without_times(report))
    assert len(numbers) > 200 and all(math.isfinite(x) for x in numbers)
    text = (out / "report.md").read_text()
    assert "Layer-wise CKA before the decay" in text and "Paired difference CLM - MLM" in text


def test_a_second_invocation_skips_every_finished_stage(smoke):
    out, _, third = smoke
    assert "[run]" not in third and "[resume]" not in third
    assert third.count("[skip]") == len(list((out / "stages").glob("*.json")))


def test_paper_dry_run_prints_every_command_and_trains_nothing(tmp_path):
    need(CORPUS)
    out = finished(reproduce("--scale=paper", f"--out={tmp_path / 'paper'}", "--gpus=4", "--dry_run"))
    assert "nothing was run" in out and not (tmp_path / "paper").exists()
    lines = out.splitlines()
    clm = next(line for line in lines if line.startswith("clm: "))
    assert "--nproc_per_node=4" in clm and "--recipe=paper" in clm and "--tokens=10000000000" in clm
    assert "--init_from=answerdotai/ModernBERT-base" in clm
    assert any(line.startswith("clm-decay-freeze-low: ") and "--freeze=low" in line for line in lines)


def test_bad_input_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "reproduce.py"), "--scale=smoke", f"--out={tmp_path}",
                             f"--corpus={tmp_path / 'none.jsonl'}"], capture_output=True, text=True)
    assert result.returncode != 0 and result.stderr.strip().startswith("error: --corpus")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_an_interrupted_run_gives_the_same_report(smoke, tmp_path):
    """The killed-and-resumed smoke run's numbers equal an uninterrupted run's (wall times aside)."""
    out, _, _ = smoke
    finished(reproduce("--scale=smoke", f"--out={tmp_path / 'straight'}", "--jobs=2"))
    straight = json.loads((tmp_path / "straight" / "report.json").read_text())
    assert without_times(straight) == without_times(json.loads((out / "report.json").read_text()))
