"""machinery/curves.py: log.jsonl series across phase hand-offs (offsets to the token, damaged logs, missing
parents) and the loss pictures (a PNG of the requested pixel size, one colour per run, no matplotlib)."""
import json
import os
import subprocess
import sys

import pytest

from machinery import curves, rundir
from machinery.cli import InputError


def train(phase, step, tokens):
    return dict(phase=phase, step=step, tokens=tokens, loss=10.0 - step / 10, lr=1e-3, grad_norm=1.0, ms=5.0,
                tokens_per_s=1000, mfu=None)


def val(phase, step, tokens):
    return dict(phase=phase, step=step, tokens=tokens, val_mlm=3.0 + step / 100, val_clm=4.0 + step / 100)


def phase_log(phase, steps, tokens_per_step, eval_every=5):
    """Train records for steps 1..steps, and a validation record every eval_every steps, as train.py writes them."""
    records = []
    for step in range(1, steps + 1):
        records.append(train(phase, step, step * tokens_per_step))
        if step % eval_every == 0:
            records.append(val(phase, step, step * tokens_per_step))
    return records


def make_run(path, records, state=None, step=10, tail=""):
    """A fake run directory: run.json, log.jsonl (with `tail` appended raw) and a checkpoint's state.json."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "run.json"), "w") as f:
        json.dump({"written_by": "train.py", "run_id": "x"}, f)
    with open(os.path.join(path, "log.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)
    if state is not None:
        checkpoint = os.path.join(path, "checkpoints", f"step-{step:08d}")
        os.makedirs(checkpoint, exist_ok=True)
        with open(os.path.join(checkpoint, "state.json"), "w") as f:
            json.dump(state, f)
    return str(path)


@pytest.fixture(autouse=True)
def fresh_messages(monkeypatch):
    """Each test sees the once-per-process messages afresh."""
    from machinery import cli
    monkeypatch.setattr(cli, "_said", set())


def tokens(records):
    return [r["tokens"] for r in records]


def test_two_phases_share_one_token_axis(tmp_path):
    # the parent trained on after the hand-off (steps 11-12): those records are not the child's past
    parent = make_run(tmp_path / "clm25", phase_log("clm", 12, 100))
    child = make_run(tmp_path / "clm25-mlm", phase_log("mlm", 5, 64))
    history = [dict(phase="clm", tokens=1000, dir=os.path.join(parent, "checkpoints", "step-00000010"))]
    first, second = curves.series(child, history)
    assert (first["phase"], first["offset"], second["phase"], second["offset"]) == ("clm", 0, "mlm", 1000)
    assert first["run_dir"] == os.path.normpath(parent)
    assert tokens(first["train"]) == [100 * s for s in range(1, 11)]
    assert tokens(first["val"]) == [500, 1000]
    assert tokens(second["train"]) == [1000 + 64 * s for s in range(1, 6)]
    assert tokens(second["val"]) == [1320]
    assert [r["loss"] for r in second["train"]] == [r["loss"] for r in phase_log("mlm", 5, 64) if "loss" in r]


def test_offsets_add_up_over_a_chain_recorded_from_another_directory(tmp_path, monkeypatch):
    # dirs were recorded relative to where train.py ran; we read from elsewhere: they are found beside the run.
    # The oldest entry names a run directory (older runs), the next a checkpoint folder.
    out = tmp_path / "out"
    make_run(out / "start", phase_log("mlm", 4, 10))
    make_run(out / "clm", phase_log("clm", 3, 7))
    child = make_run(out / "clm-decay", phase_log("decay", 2, 5))
    checkpoint(out / "clm", 3, "clm", 21, [], CLM)
    history = [dict(phase="mlm", tokens=40, dir="out/start"),
               dict(phase="clm", tokens=21, dir="out/clm/checkpoints/step-00000003")]
    os.makedirs(tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path / "elsewhere")
    segments = curves.series(child, history)
    assert [s["offset"] for s in segments] == [0, 40, 61]
    assert [tokens(s["train"]) for s in segments] == [[10, 20, 30, 40], [47, 54, 61], [66, 71]]
    # the clm phase's configuration is read where its log was found: its train loss says what it measures
    assert [s["objective"] for s in segments] == ["mlm phase", "CLM (next token)", "decay phase"]


@pytest.mark.parametrize("folder, run_dir", [
    ("out/clm/checkpoints/step-00000050", "out/clm"),
    ("/abs/out/clm/checkpoints/step-00000050/", "/abs/out/clm"),
    ("out/clm", "out/clm"),
    ("out/clm/", "out/clm")])
def test_run_dir_of_a_history_entry(folder, run_dir):
    assert curves.run_dir_of(folder) == os.path.normpath(run_dir)


def test_damaged_log_lines_are_skipped_with_one_warning_each_kind(tmp_path, capsys):
    good = phase_log("mlm", 3, 10)
    run = make_run(tmp_path / "run", good[:2], tail='not json\n[1, 2]\n{"step": "x", "tokens": 1}\n'
                   + json.dumps(good[2]) + "\n" + '{"phase": "mlm", "st')
    records = curves.read_log(os.path.join(run, "log.jsonl"))
    assert records == good
    cut, skipped = capsys.readouterr().err.splitlines()
    assert "line 7 is cut short" in cut
    assert "skipped 3 line(s) that are not log records (line 3 first)" in skipped


def test_a_last_line_without_newline_that_parses_is_kept(tmp_path, capsys):
    good = phase_log("mlm", 2, 10)
    run = make_run(tmp_path / "run", good[:1], tail=json.dumps(good[1]))
    assert curves.read_log(os.path.join(run, "log.jsonl")) == good
    assert capsys.readouterr().err == ""


def test_missing_parent_warns_once_and_keeps_its_tokens(tmp_path, capsys):
    child = make_run(tmp_path / "mlm", phase_log("mlm", 2, 8))
    history = [dict(phase="clm", tokens=500, dir=str(tmp_path / "gone" / "checkpoints" / "step-00000005"))]
    for _ in range(3):  # the trainer draws at every checkpoint: the warning is said once
        first, second = curves.series(child, history)
    assert (first["train"], first["val"], second["offset"]) == ([], [], 500)
    assert tokens(second["train"]) == [508, 516]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "gone" in err[0] and "log.jsonl is not there" in err[0]


RUN_ID = "0123456789abcdef0123456789abcdef"


def checkpoint(run, step, phase, phase_tokens, history, config=None):
    """A checkpoint folder of run as train.py leaves it: its marker, a state.json with every field (`config`: the
    run's configuration, {} by default), and the other files it lists (empty: only their sizes are read)."""
    with open(os.path.join(run, "run.json"), "w") as f:
        json.dump({"written_by": "train.py", "run_id": RUN_ID}, f)
    folder = os.path.join(run, "checkpoints", f"step-{step:08d}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, rundir.MARKER), "w") as f:
        f.write(RUN_ID)
    files = [name for name in rundir.CHECKPOINT_FILES if name != rundir.STATE]
    for name in files:
        open(os.path.join(folder, name), "w").close()
    total = sum(h["tokens"] for h in history) + phase_tokens
    state = dict(phase=phase, step=step, phase_step=step, phase_tokens=phase_tokens, total_tokens=total,
                 schedule_tokens_done=total, loader={"sequence": 0}, rng=[], config=config or {}, code={},
                 tokenizer="bytes", history=history, files={name: 0 for name in files})
    with open(os.path.join(folder, rundir.STATE), "w") as f:
        json.dump(state, f)
    return folder


def test_run_series_takes_the_history_of_the_newest_checkpoint(tmp_path, capsys):
    parent = make_run(tmp_path / "clm", phase_log("clm", 10, 100))
    entry = dict(phase="clm", tokens=1000, dir=checkpoint(parent, 10, "clm", 1000, []))
    child = make_run(tmp_path / "mlm", phase_log("mlm", 10, 50))
    checkpoint(child, 5, "mlm", 250, [dict(entry, tokens=600)])  # an older one: its history is not used
    checkpoint(child, 10, "mlm", 500, [entry])
    segments = curves.run_series(child)
    assert [(s["phase"], s["offset"]) for s in segments] == [("clm", 0), ("mlm", 1000)]
    assert tokens(segments[0]["train"])[-1] == 1000 and tokens(segments[1]["train"])[-1] == 1500
    assert capsys.readouterr().err == ""


def test_run_series_without_a_checkpoint_or_with_a_damaged_one_is_its_own_log(tmp_path, capsys):
    run = make_run(tmp_path / "run", phase_log("clm", 3, 10), state={"phase": "clm"})  # run_id "x": no run
    own = [("clm", 0, [10, 20, 30])]
    assert [(s["phase"], s["offset"], tokens(s["train"])) for s in curves.run_series(run)] == own
    with open(os.path.join(checkpoint(run, 3, "clm", 30, []), rundir.STATE), "w") as f:
        f.write("{}")  # a run of ours whose newest state is damaged
    for _ in range(2):
        assert [(s["phase"], s["offset"], tokens(s["train"])) for s in curves.run_series(run)] == own
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith("warning: ") and "own log alone" in warning


def png_shape(path):
    image = pytest.importorskip("matplotlib.image")
    return image.imread(path).shape[:2]  # (height, width)


def test_draw_run_writes_a_png_of_the_requested_size(tmp_path):
    pytest.importorskip("matplotlib")
    parent = make_run(tmp_path / "clm", phase_log("clm", 10, 100))
    entry = dict(phase="clm", tokens=1000, dir=os.path.join(parent, "checkpoints", "step-00000010"))
    child = make_run(tmp_path / "mlm", phase_log("mlm", 10, 50), state=dict(phase="mlm", history=[entry]))
    path = curves.draw_run(child, figsize=(6, 4), dpi=50)
    assert path == os.path.join(child, "loss.png") and os.path.getsize(path) > 0
    assert png_shape(path) == (200, 300)
    assert sorted(os.listdir(child)) == ["checkpoints", "log.jsonl", "loss.png", "run.json"]  # no temporary left
    empty = make_run(tmp_path / "new", [])  # the first save may come before any validation: still a picture
    assert png_shape(curves.draw_run(empty, str(tmp_path / "empty.png"), figsize=(4, 3), dpi=40)) == (120, 160)


def test_draw_runs_one_colour_per_run_in_every_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    # run a continues a parent that never validated: a different number of lines per panel, so colours taken
    # from matplotlib's cycle would differ between panels
    parent = make_run(tmp_path / "start", phase_log("mlm", 10, 100, eval_every=100))
    entry = dict(phase="mlm", tokens=1000, dir=checkpoint(parent, 10, "mlm", 1000, []))
    runs = [make_run(tmp_path / "a", phase_log("clm", 10, 100)), make_run(tmp_path / "b", phase_log("mlm", 10, 100))]
    checkpoint(runs[0], 10, "clm", 1000, [entry])
    figures = []
    save = curves.save
    monkeypatch.setattr(curves, "save", lambda fig, out: (figures.append(fig), save(fig, out))[1])
    out = str(tmp_path / "cmp.png")
    assert curves.draw_runs(runs, out, names=["CLM", "MLM"], figsize=(7, 5), dpi=40) == out
    assert os.path.getsize(out) > 0 and png_shape(out) == (200, 280)
    (fig,) = figures
    colours = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            colours.setdefault(line.get_label(), set()).add(line.get_color())
    assert set(colours) >= {"MLM", "CLM"}
    assert len(colours["MLM"]) == len(colours["CLM"]) == 1 and colours["MLM"] != colours["CLM"]
    # validation MLM and CLM, then a train panel per objective: mlm (a's parent and b), clm (a)
    assert [len([ln for ln in ax.get_lines() if ln.get_label() in ("MLM", "CLM")]) for ax in fig.axes] == [2, 2, 2, 1]
    assert {t.get_text() for t in fig.legends[0].get_texts()} == {"MLM", "CLM", "phase switch (in its run's colour)"}


def test_without_matplotlib_it_says_so_once_and_draws_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    run = make_run(tmp_path / "run", phase_log("mlm", 3, 10))
    assert curves.draw_run(run) is None
    assert curves.draw_run(run) is None
    assert curves.draw_runs([run, run], str(tmp_path / "cmp.png"), names=["x", "y"]) is None
    captured = capsys.readouterr()
    assert captured.err == "matplotlib is not installed: no loss picture; pip install matplotlib\n"
    assert captured.out == ""
    assert not os.path.exists(os.path.join(run, "loss.png")) and not os.path.exists(tmp_path / "cmp.png")


def test_command_line(tmp_path, capsys):
    """One command draws curves, eval.py's: a run's own picture (its loss.png by default) or several runs'."""
    pytest.importorskip("matplotlib")
    import eval as ev
    a = make_run(tmp_path / "a", phase_log("mlm", 3, 10))
    b = make_run(tmp_path / "b", phase_log("clm", 3, 10))
    ev.main(["curves", a])
    assert os.path.isfile(os.path.join(a, "loss.png"))
    out = str(tmp_path / "cmp.png")
    ev.main(["curves", a, b, f"--out={out}", "--names=MLM,CLM"])
    assert os.path.isfile(out)
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")] == \
        [os.path.join(a, "loss.png"), out]
    for argv, message in [([a, b], "--out"), ([a, b, f"--out={out}", "--names=x"], "1 names for 2 runs"),
                          ([a, "--names=x"], "one run's picture"), ([str(tmp_path)], "no log.jsonl")]:
        with pytest.raises(InputError, match=message):
            ev.main(["curves", *argv])


def test_a_run_on_a_read_only_disk_is_one_line_naming_its_loss_png_and_another_out_draws_it(tmp_path, small_disk,
                                                                                           capsys):
    """`eval.py curves RUN` writes RUN/loss.png by default: on a disk that cannot take it (a colleague's runs on a
    read-only mount) an error line that names the file and what to do before anything is drawn, as a given --out
    gets, not a traceback from the PNG writer; --out elsewhere draws the same run."""
    pytest.importorskip("matplotlib")
    import eval as ev
    disk = small_disk("1m")
    run = make_run(disk / "run", phase_log("mlm", 3, 10))
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    with pytest.raises(InputError) as refused:
        ev.main(["curves", run])
    assert str(refused.value) == f"--out={run}/loss.png: cannot write it (Read-only file system); name a file in " \
                                 f"a folder that exists and can be written"
    ev.main(["curves", run, f"--out={tmp_path / 'run.png'}"])
    assert (tmp_path / "run.png").is_file() and sorted(os.listdir(run)) == ["log.jsonl", "run.json"]


# --- a continued run's curve starts at its start; each train loss says what it measures ------------------------

CLM, MLM30, MLM15 = dict(objective="clm", mask_rate=0.3), dict(objective="mlm", mask_rate=0.3), \
    dict(objective="mlm", mask_rate=0.15)


def drawn(monkeypatch):
    """The figures curves.save is handed, kept (and written as usual)."""
    figures, save = [], curves.save
    monkeypatch.setattr(curves, "save", lambda fig, out: (figures.append(fig), save(fig, out))[1])
    return figures


def a_detour_and_its_twin(tmp_path):
    """A CLM detour and its decay (MLM at 15%), and an MLM twin (30%), each started from weights: a validation at
    step 0 (the start model's losses, 5.0) then losses that move away from it."""
    def started(phase, steps, tokens_per_step):
        return [dict(val("x", 0, 0), phase=phase, val_mlm=5.0, val_clm=7.0), *phase_log(phase, steps, tokens_per_step)]
    clm = make_run(tmp_path / "clm", started("clm", 10, 100))
    checkpoint(clm, 10, "clm", 1000, [], CLM)
    decay = make_run(tmp_path / "clm-decay", [dict(val("decay", 0, 0), val_mlm=6.5), *phase_log("decay", 2, 100)])
    checkpoint(decay, 2, "decay", 200, [dict(phase="clm", tokens=1000, dir=os.path.join(clm, "checkpoints",
                                                                                        "step-00000010"))], MLM15)
    mlm = make_run(tmp_path / "mlm", started("mlm", 10, 100))
    checkpoint(mlm, 10, "mlm", 1000, [], MLM30)
    return decay, mlm


def test_a_phase_switch_is_named_inside_its_panel(tmp_path, monkeypatch):
    """The name of a phase switch stays inside the loss panel, wherever the switch is (a decay is the last tenth of
    the axis: named to its left, never under the legend in the right margin)."""
    pytest.importorskip("matplotlib")
    clm = make_run(tmp_path / "clm", phase_log("clm", 20, 100))
    checkpoint(clm, 20, "clm", 2000, [], CLM)
    decay = make_run(tmp_path / "clm-decay", phase_log("decay", 2, 100))  # the switch at 2,000 of 2,200 tokens
    checkpoint(decay, 2, "decay", 200, [dict(phase="clm", tokens=2000, dir=clm)], MLM15)
    figures = drawn(monkeypatch)
    curves.draw_run(decay)  # the size train.py draws at
    loss_ax = figures[0].axes[0]
    renderer = figures[0].canvas.get_renderer()
    (name,) = loss_ax.texts
    inside, box = loss_ax.get_window_extent(renderer), name.get_window_extent(renderer)
    assert name.get_text().strip() == "clm -> decay"
    switches = [line.get_xdata()[0] for ax in figures[0].axes for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert switches == [2000, 2000]  # on both panels, where the decay starts
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1, (box, inside)


def test_a_continued_run_starts_its_curve_at_its_step_0_validation(tmp_path, monkeypatch):
    """A run started from weights validates before its first step: its curve starts there, at token 0, with the
    start model's loss (the jump of its first steps shows); a hand-off's step 0 sits where its parent ended."""
    pytest.importorskip("matplotlib")
    decay, mlm = a_detour_and_its_twin(tmp_path)
    clm, handed = curves.run_series(decay)
    assert (clm["val"][0]["tokens"], clm["val"][0]["val_mlm"]) == (0, 5.0)
    assert (handed["val"][0]["tokens"], handed["val"][0]["val_mlm"]) == (1000, 6.5)
    figures = drawn(monkeypatch)
    curves.draw_runs([decay, mlm], str(tmp_path / "cmp.png"), names=["CLM", "MLM"], dpi=30)
    val_mlm = figures[0].axes[0]
    firsts = {line.get_label(): (line.get_xdata()[0], line.get_ydata()[0]) for line in val_mlm.get_lines()
              if line.get_label() in ("CLM", "MLM")}
    assert firsts == {"CLM": (0, 5.0), "MLM": (0, 5.0)}
    curves.draw_run(decay, dpi=30)
    own = [line for line in figures[1].axes[0].get_lines() if line.get_label() == curves.VALIDATION["val_mlm"]]
    assert (own[0].get_xdata()[0], own[0].get_ydata()[0]) == (0, 5.0)


def test_train_losses_name_their_objective_and_masking_rate(tmp_path, monkeypatch):
    """CLM, MLM at 30% and MLM at 15% are three quantities: compared runs get a train-loss panel for each, named
    by it, and a run's own picture a series for each; the learning rate is drawn step by step (a one-step phase
    is one flat step at its rate)."""
    pytest.importorskip("matplotlib")
    decay, mlm = a_detour_and_its_twin(tmp_path)
    figures = drawn(monkeypatch)
    curves.draw_runs([decay, mlm], str(tmp_path / "cmp.png"), names=["CLM", "MLM"], dpi=30)
    panels = {ax.get_ylabel().split("\n")[0]: {line.get_label() for line in ax.get_lines()} & {"CLM", "MLM"}
              for ax in figures[0].axes}
    assert panels == {"validation MLM loss (15% masked)": {"CLM", "MLM"}, "validation CLM loss (next token)":
                      {"CLM", "MLM"}, "train loss, CLM (next token)": {"CLM"}, "train loss, MLM, 15% masked": {"CLM"},
                      "train loss, MLM, 30% masked": {"MLM"}}
    curves.draw_run(decay, dpi=30)
    loss_ax, lr_ax = figures[1].axes
    labels = {line.get_label() for line in loss_ax.get_lines()}
    assert {"train loss, CLM (next token)", "train loss, MLM, 15% masked"} <= labels
    assert not any(label.startswith("train loss, MLM, 30%") for label in labels)
    train = [line for line in loss_ax.get_lines() if line.get_alpha() == 0.5]  # each objective's phases alone
    assert [(line.get_label(), min(line.get_xdata()), max(line.get_xdata())) for line in train] == [
        ("train loss, CLM (next token)", 100, 1000), ("train loss, MLM, 15% masked", 1100, 1200)]
    lr = [line for line in lr_ax.get_lines() if line.get_drawstyle() == "steps-pre"]
    assert [list(line.get_xdata()) for line in lr] == [[0, *range(100, 1001, 100)], [1000, 1100, 1200]]


def test_eval_curves_says_what_it_wrote(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import eval as ev
    decay, mlm = a_detour_and_its_twin(tmp_path)
    out = tmp_path / "cmp.png"
    ev.main(["curves", decay, mlm, f"--out={out}", "--names=CLM,MLM"])
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out} (a picture: open it in any image viewer)"


def test_runs_of_one_name_are_told_apart_by_their_paths(tmp_path, monkeypatch):
    """out/a/clm and out/b/clm compared without --names: the legend names each by its path, not both "clm"."""
    pytest.importorskip("matplotlib")
    runs = [make_run(tmp_path / folder / "clm", phase_log("clm", 3, 10)) for folder in ("a", "b")]
    figures = drawn(monkeypatch)
    curves.draw_runs(runs, str(tmp_path / "cmp.png"), dpi=20)
    assert {t.get_text() for t in figures[0].legends[0].get_texts()} == {os.path.normpath(r) for r in runs}
