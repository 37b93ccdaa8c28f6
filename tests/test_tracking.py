"""--log_to: the records of log.jsonl sent live to TensorBoard, Weights & Biases (offline) and trackio (local), read
back and compared with log.jsonl across a resume; a tracker asked for but not installed, or named twice, is one line
at start; a tracker, the loss picture or the model card failing mid-run is a warning, and training goes on."""
import glob
import importlib.util
import json
import shutil
import struct
import sys
import time

import pytest

import train
from machinery import cli, tracking
from machinery.rundir import RunDir

SMALL = ["--preset=tiny", "--seq_len=128", "--batch_size=4", "--micro_batch_size=2", "--eval_sequences=2",
         "--eval_interval=2", "--log_interval=1000", "--save_interval=2", "--warmup_tokens=1024", "--lr=1e-3",
         "--threads=1", f"--tokens={5 * 4 * 128}"]


def interrupted_and_resumed(corpus, out, tracker, lost_a_step=False):
    """A run stopped after step 3 and resumed to its end (step 5). `lost_a_step`: the checkpoint of step 3 is
    gone, as after a kill right after step 3 was logged: the resume trains and logs step 3 again."""
    train.main([f"--data={corpus}", f"--out_dir={out}", *SMALL, f"--log_to={tracker}", "--max_steps=3"])
    if lost_a_step:
        shutil.rmtree(RunDir.open(str(out)).latest_state()["dir"])
    train.main([f"--out_dir={out}", "--resume"])


def numbers(out):
    """{(key, step): value} of every number log.jsonl holds, training and validation records alike."""
    return {(key, record["step"]): value for record in map(json.loads, open(out / "log.jsonl"))
            for key, value in record.items() if key != "step" and isinstance(value, (int, float))}


def test_tensorboard_holds_log_jsonl_and_a_resume_continues_its_curves(demo_corpus, tmp_path, capsys):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                      reason="tensorboard is not installed (pip install tensorboard)")
    out = tmp_path / "run"
    interrupted_and_resumed(demo_corpus, out, "tensorboard", lost_a_step=True)
    said = f"TensorBoard event files in {out}/tensorboard/; to view them: tensorboard --logdir {out}/tensorboard"
    printed = capsys.readouterr().out  # at each start, and in the summary of the finished run
    assert printed.count(f"tracked: {said}") == 2 and printed.count(f"tracked:    {said}") == 1
    events = accumulator.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = [(tag, e.step, e.value) for tag in events.Tags()["scalars"] for e in events.Scalars(tag)]
    got = {(tag, step): value for tag, step, value in scalars}
    # step 3, logged by both processes, is shown once: the resume hid the first one (a validation record repeats
    # its step's tokens, as in log.jsonl)
    assert [step for tag, step, _ in scalars if tag == "loss"] == [1, 2, 3, 4, 5]
    assert len(scalars) == len(got) + sum("val_mlm" in r for r in map(json.loads, open(out / "log.jsonl")))
    expected = numbers(out)
    assert got.keys() == expected.keys() and {k for k, _ in got} >= {"loss", "lr", "grad_norm", "val_mlm"}
    assert all(got[k] == pytest.approx(v, rel=1e-6) for k, v in expected.items())  # float32 events


def wandb_records(path):
    """The protobuf records of a W&B .wandb file: a header, then LevelDB-log blocks of 32 KiB whose records
    (FULL, or FIRST MIDDLE... LAST pieces) each have a 7-byte header: crc32, length, type."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, piece = 7, b""
    while pos + 7 <= len(data):
        room = (1 << 15) - pos % (1 << 15)
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if room < 7 or kind == 0:  # the zero padding at a block's end
            pos += room
            continue
        piece, pos = piece + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            piece = b""
            yield record


def test_wandb_offline_holds_log_jsonl_in_one_run_across_a_resume(demo_corpus, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    for variable in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "test-project")
    out = tmp_path / "run"
    interrupted_and_resumed(demo_corpus, out, "wandb")
    files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)  # one run, resumed
    runs, rows = [], []
    for path in files:
        for _ in range(600):  # wandb-core may close the file a moment after finish() returned
            if "exit" in [record.WhichOneof("record_type") for record in wandb_records(path)]:
                break
            time.sleep(0.1)
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                runs.append((record.run.run_id, record.run.display_name, record.run.project))
            elif record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    assert set(runs) == {(run_id, "run", "test-project")}
    expected = [{k: v for k, v in r.items() if k != "phase" and v is not None}
                for r in map(json.loads, open(out / "log.jsonl"))]
    assert rows == expected


def test_trackio_holds_log_jsonl_in_one_run_across_a_resume(demo_corpus, tmp_path, monkeypatch):
    home = tmp_path / "trackio"  # trackio's folder, never the user's ~/.cache
    monkeypatch.setenv("TRACKIO_DIR", str(home))
    monkeypatch.setenv("TRACKIO_PROJECT", "test-project")
    pytest.importorskip("trackio", reason="trackio is not installed (pip install trackio; tests/requirements.txt "
                                          "leaves it out: it pins pillow<13 and brings a web server)")
    for module in [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "trackio"]:
        for attribute, folder in (("TRACKIO_DIR", home), ("MEDIA_DIR", home / "media")):
            if hasattr(module, attribute):  # read from the environment at the first import, maybe earlier
                monkeypatch.setattr(module, attribute, folder)
    from trackio.sqlite_storage import SQLiteStorage
    out = tmp_path / "run"
    interrupted_and_resumed(demo_corpus, out, "trackio")
    (name,) = SQLiteStorage.get_runs("test-project")
    assert name == f"run-{json.loads((out / 'run.json').read_text())['run_id'][:8]}"
    assert (home / "test-project.db").is_file()
    got = {(k, row["step"]): v for row in SQLiteStorage.get_logs("test-project", name)
           for k, v in row.items() if k not in ("step", "timestamp") and v is not None}
    assert got == pytest.approx(numbers(out))


def test_a_tracker_not_installed_is_one_line_at_start(demo_corpus, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = tmp_path / "run"
    for flags, words in ((["--log_to=tensorboard,wandb"], "the wandb package is not installed (pip install wandb)"),
                         (["--log_to=mlflow"], "'mlflow' is not a tracker; expected some of tensorboard, wandb, "
                                               "trackio"),
                         (["--log_to=tensorboard,tensorboard"], "tensorboard is named twice; name each tracker once")):
        with pytest.raises(SystemExit) as stop:
            cli.run(train.main, [f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, *flags])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err, err
        assert not (out / "checkpoints").exists()


class Flaky:
    """A tracker whose network fails at its `fail_at`-th log call (and, with `close_fails`, at its close)."""
    fail_at, close_fails, made = 3, False, []

    def __init__(self, out_dir, run_id, config, first_step):
        self.logged, self.closed = [], 0
        Flaky.made.append(self)

    def log(self, scalars, step):
        if len(self.logged) + 1 == self.fail_at:
            raise ConnectionError("Connection reset by peer\nmore lines of the network stack")
        self.logged.append(step)

    def close(self):
        self.closed += 1
        if self.close_fails:
            raise TimeoutError("the server did not answer")


@pytest.fixture
def flaky(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flaky" else real(name, *a))
    monkeypatch.setitem(tracking.TRACKERS, "flaky", Flaky)
    monkeypatch.setattr(Flaky, "made", [])
    return Flaky


def test_a_tracker_that_fails_mid_run_is_a_warning_and_training_goes_on(demo_corpus, tmp_path, capsys, flaky):
    """A network error at the tracker's 3rd call (step 2's validation record): one warning naming it, no more calls
    to it, and the run trains, logs and saves every step to its end."""
    out = tmp_path / "run"
    train.main([f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, "--log_to=flaky"])
    (tracker,) = flaky.made
    printed = capsys.readouterr()
    err = printed.err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: --log_to: flaky at step 2 failed (ConnectionError: Connection reset by peer); it "
                        "gets no more records in this run; log.jsonl holds them all"], err
    assert tracker.logged == [1, 2] and tracker.closed == 1  # closed when dropped, never called again
    assert [r["step"] for r in map(json.loads, open(out / "log.jsonl")) if "loss" in r] == [1, 2, 3, 4, 5]
    assert RunDir.open(str(out)).latest_state()["phase_step"] == 5
    tracked = [line for line in printed.out.splitlines() if line.startswith("tracked:")]
    assert tracked == ["tracked:    flaky failed at step 2 (the warning above says why): it holds the records before "
                       "that; log.jsonl holds them all"]  # the summary never says it holds the run


def test_a_tracker_that_fails_to_close_is_a_warning(demo_corpus, tmp_path, capsys, flaky, monkeypatch):
    monkeypatch.setattr(flaky, "fail_at", 0)
    monkeypatch.setattr(flaky, "close_fails", True)
    out = tmp_path / "run"
    train.main([f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, "--log_to=flaky"])
    assert "warning: --log_to: closing flaky failed (TimeoutError: the server did not answer)" in capsys.readouterr().err
    assert flaky.made[0].closed == 1 and RunDir.open(str(out)).latest_state()["phase_step"] == 5


@pytest.mark.parametrize("broken", ["picture", "card"])
def test_a_picture_or_card_that_fails_is_a_warning_and_the_checkpoints_are_kept(broken, demo_corpus, tmp_path, capsys,
                                                                               monkeypatch):
    """Not OSError alone: whatever the plotting or the card's text raises costs a warning, never a step."""
    def fails(*args):
        raise ValueError("a bug in the drawing")
    from machinery import curves
    monkeypatch.setattr(*((curves, "draw_run") if broken == "picture" else (train.progress, "card")), fails)
    out = tmp_path / "run"
    train.main([f"--data={demo_corpus}", f"--out_dir={out}", *SMALL])
    what = {"picture": "the loss picture", "card": "the model card"}[broken]
    printed = capsys.readouterr()
    warnings = [line for line in printed.err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {what} failed (ValueError: a bug in the drawing); training goes on"] * 3  # 3 saves
    assert RunDir.open(str(out)).latest_state()["phase_step"] == 5
    assert (out / "loss.png").is_file() == (broken == "card") and (out / "README.md").is_file() == (broken == "picture")
    # what failed is never named as written: not in the summary, not in the card
    summary = printed.out[printed.out.index("done: phase"):]
    if broken == "picture":
        assert "loss.png" not in summary and "loss.png" not in (out / "README.md").read_text()
        assert f"its losses: {out}/log.jsonl (no picture: the loss picture was not drawn" in summary
    else:
        assert "README.md" not in summary and "no model card: it failed" in summary and "loss.png (picture)" in summary


def test_a_picture_that_fails_after_an_earlier_one_is_not_named(demo_corpus, tmp_path, capsys, monkeypatch):
    """A picture drawn at the first saves and failing at the last: the summary and the last card do not name the
    picture, which shows the run as it was at an earlier save."""
    from machinery import curves
    real, calls = curves.draw_run, []

    def draw(*args):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("a bug in the drawing")
        return real(*args)
    monkeypatch.setattr(curves, "draw_run", draw)
    out = tmp_path / "run"
    train.main([f"--data={demo_corpus}", f"--out_dir={out}", *SMALL])
    printed = capsys.readouterr().out
    assert len(calls) == 3 and (out / "loss.png").is_file()  # the second save's
    assert "loss.png" not in printed[printed.index("done: phase"):]
    assert "loss.png" not in (out / "README.md").read_text()


def test_each_tracker_says_where_its_records_are_and_how_to_view_them(monkeypatch):
    for name in ("WANDB_PROJECT", "TRACKIO_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRACKIO_PROJECT", "mine")
    board, wandb, trackio = tracking.where("tensorboard, wandb,trackio", "out/run")
    assert board == ("TensorBoard event files in out/run/tensorboard/; to view them: tensorboard --logdir "
                     "out/run/tensorboard (then open http://localhost:6006)")
    assert "run run of project modernbert" in wandb and "wandb sync out/run/wandb/offline-run-*" in wandb
    assert trackio.endswith("trackio show --project mine") and tracking.where("", "out/run") == []
