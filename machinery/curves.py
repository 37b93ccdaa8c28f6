"""Loss pictures from log.jsonl, across phase hand-offs and across runs. A reader of the recipe may skip this file.

A run's picture shows its train and validation losses and learning rate against tokens, with the runs it
continues before it on the same axis (a detour and its decay read as one curve). The command is eval.py's:

    python eval.py curves out/clm25-mlm                          # draws out/clm25-mlm/loss.png again
    python eval.py curves out/clm25-mlm out/mlm --out=cmp.png    # several runs, one colour each
"""
import contextlib
import json
import math
import os

from machinery import rundir
from machinery.cli import InputError, check_outputs, read_json, say_once


# -----------------------------------------------------------------------------
# The series: log records on one token axis across phase hand-offs.


def is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_log(path):
    """The records of a log.jsonl, in order. A last line cut short (a kill mid-write) is dropped; any other line
    that is not a JSON object with numeric step and tokens is skipped with a warning."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    records, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and is_number(record.get("step")) and is_number(record.get("tokens")):
            records.append(record)
        elif number == len(lines):  # no newline after it: the write was cut short
            say_once(f"warning: {path}: line {number} is cut short (a write was interrupted); drawn without it")
        else:
            bad.append(number)
    if bad:
        say_once(f"warning: {path}: skipped {len(bad)} line(s) that are not log records (line {bad[0]} first)")
    return records


def run_dir_of(folder):
    """The run directory a history entry names: a checkpoint folder OUT/checkpoints/step-N is two levels below its
    run; runs written before checkpoint folders existed recorded the run directory itself."""
    folder = os.path.normpath(folder)
    if os.path.basename(os.path.dirname(folder)) == "checkpoints":
        return os.path.dirname(os.path.dirname(folder))
    return folder


def parent_log(folder, run_dir):
    """The log.jsonl of the run a history entry names, or None with a warning (once). A relative path was
    recorded from the directory train.py ran in; when that is not this one, the parent is looked for beside
    run_dir, where a chain of phases usually lives (out/clm25 and out/clm25-mlm)."""
    parent = run_dir_of(folder)
    places = [parent]
    if not os.path.isabs(parent):
        places.append(os.path.join(os.path.dirname(os.path.abspath(run_dir)), os.path.basename(parent)))
    for place in places:
        if os.path.isfile(os.path.join(place, "log.jsonl")):
            return os.path.join(place, "log.jsonl")
    say_once(f"warning: {run_dir} continues {parent}, whose log.jsonl is not there: its tokens stay on the axis, "
             f"its curve is not drawn")
    return None


def saved_config(folder, found=None):
    """The configuration a run of a chain trained with: the state.json of `folder` (the checkpoint it was left
    at), else the newest checkpoint of its run directory, else of `found` (where its log was found); {} where
    none is readable (moved, deleted or damaged since)."""
    try:
        return read_json(os.path.join(folder, rundir.STATE))["config"]
    except (InputError, KeyError, TypeError):
        pass
    for place in filter(None, (run_dir_of(folder), found)):
        try:
            return rundir.RunDir.open(place).latest_state()["config"]
        except (InputError, KeyError, TypeError):
            continue
    return {}


def objective_of(config, phase):
    """What a phase's train loss measures, from its configuration: the objective, and MLM's masking rate (a loss
    at 30% masked is not one at 15%); the phase's name where no configuration is left."""
    if config.get("objective") == "clm":
        return "CLM (next token)"
    if config.get("objective") == "mlm":
        return f"MLM, {config['mask_rate']:.0%} masked"
    return f"{config['objective']} objective" if config.get("objective") else f"{phase} phase"  # one of yours


def segment(phase, run_dir, offset, records, until=None, config=None):
    """One phase's records, their tokens moved by `offset` (the tokens of the phases before it), and what its
    train loss measures. A parent's records stop where the child took over (`until`): a parent trained on after
    the hand-off is not drawn on. A continued run's validation at its step 0 is its first point, at `offset`."""
    kept = [{**r, "tokens": r["tokens"] + offset} for r in records if until is None or r["tokens"] <= until]
    return dict(phase=phase, run_dir=run_dir, offset=offset, objective=objective_of(config or {}, phase),
                train=[r for r in kept if "loss" in r], val=[r for r in kept if "val_mlm" in r or "val_clm" in r])


def series(run_dir, history=(), phase=None, config=None):
    """The segments of run_dir, oldest first: one per entry of `history` ({phase, tokens, dir} of the runs it
    continues, oldest first) and its own last (`config`: its configuration). A missing parent log leaves its
    segment empty, not its tokens."""
    segments, offset = [], 0
    for entry in history:
        log = parent_log(entry["dir"], run_dir)
        config_then = saved_config(entry["dir"], log and os.path.dirname(log))
        segments.append(segment(entry["phase"], run_dir_of(entry["dir"]), offset, read_log(log) if log else [],
                                until=entry["tokens"], config=config_then))
        offset += entry["tokens"]
    log = os.path.join(run_dir, "log.jsonl")
    records = []
    if os.path.isfile(log):
        records = read_log(log)
    else:
        say_once(f"warning: {log} is missing: the picture has no curve of {run_dir} itself")
    phase = phase or next((r["phase"] for r in records if "phase" in r), None)
    return segments + [segment(phase, os.path.normpath(run_dir), offset, records, config=config)]


def latest_state(run_dir):
    """The validated state of run_dir's newest checkpoint: None before the first one, or (said once) when it is
    damaged, in which case the picture shows the run's own log alone."""
    try:
        return rundir.latest_state(run_dir)
    except InputError as e:
        say_once(f"warning: {e}; the loss picture shows {run_dir}'s own log alone")
        return None


def run_series(run_dir):
    """run_dir's log and the logs of the runs it continues (its newest checkpoint's history), on one token
    axis: a list of segments {phase, run_dir, offset, objective, train, val}, oldest first; each record's tokens
    count from the start of the first phase."""
    state = latest_state(run_dir) or {}
    return series(run_dir, state.get("history", []), state.get("phase"), state.get("config"))


# -----------------------------------------------------------------------------
# The pictures: matplotlib's Agg backend through its object interface (no window, no pyplot state).


def new_figure(figsize, dpi, layout=None, what="loss picture"):
    """An empty figure drawn by Agg, or None (said once) where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401  (imported first: a missing matplotlib fails here)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        say_once(f"matplotlib is not installed: no {what}; pip install matplotlib")
        return None
    fig = Figure(figsize=figsize, dpi=dpi, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def save(fig, out_png):
    """Write through a temporary file and a rename, so a viewer never shows half a picture."""
    tmp = f"{out_png}.tmp{os.getpid()}"
    try:
        fig.savefig(tmp, format="png", dpi=fig.dpi)
        os.replace(tmp, out_png)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return out_png


def plot(ax, segments, part, key, label, steps=False, **style):
    """record[key] against tokens, a line per segment (a missing parent leaves a gap, never a bridge). With
    steps, each record's value is held over the tokens of the step it logs, from the segment's start: a learning
    rate is the one a step trained at, so a phase of one step is one flat step, never a point or a slope."""
    for seg in segments:
        points = [(r["tokens"], r[key]) for r in seg[part] if is_number(r.get(key))]
        if points and steps:
            points = [(seg["offset"], points[0][1]), *points]
            style = dict(style, drawstyle="steps-pre")  # y_i over (x_i-1, x_i]: the step that ends at x_i
        if points:
            ax.plot(*zip(*points), label=label, **style)
            label = "_nolegend_"  # one legend entry per series


def objectives(segments):
    """The train losses' objectives of segments, in order of first appearance."""
    return list(dict.fromkeys(seg["objective"] for seg in segments))


def mark_switches(axes, segments, label, names=False, **style):
    """A vertical line on every panel where a phase hands off to the next; with names, the phases on the first,
    beside the line on the side with more room (a switch in the right half is named on its left: a name that ran
    past the panel would go under the legend)."""
    low, high = axes[0].get_xlim()
    for before, seg in zip(segments, segments[1:]):
        for ax in axes:
            ax.axvline(seg["offset"], label=label, **style)
        label = "_nolegend_"
        if names:
            left = seg["offset"] > (low + high) / 2
            axes[0].text(seg["offset"], 0.98, f" {before['phase']} -> {seg['phase']} ", va="top", fontsize="small",
                         ha="right" if left else "left",
                         transform=axes[0].get_xaxis_transform())  # x in tokens, y in the panel's height


def tokens_axis(ax):
    from matplotlib.ticker import EngFormatter
    ax.xaxis.set_major_formatter(EngFormatter())  # 1.25 M, 10 G: tokens at a glance
    ax.set_xlabel("tokens")


def run_name(run_dir):
    return os.path.basename(os.path.abspath(run_dir))


def draw_run(run_dir, out_png=None, figsize=(9, 6), dpi=100):
    """One run's picture, across the phases it continues: train loss (light), validation MLM and CLM losses, and
    the learning rate below, against tokens. Written to out_png (default run_dir/loss.png); returns its path,
    or None without matplotlib."""
    fig = new_figure(figsize, dpi)
    if fig is None:
        return None
    segments = run_series(run_dir)
    # fixed margins: a constrained layout doubles the cost of a picture redrawn at every checkpoint
    width, height = figsize  # margins in inches, so a small picture keeps its labels
    fig.subplots_adjust(left=0.8 / width, right=1 - 2.5 / width, bottom=0.55 / height, top=1 - 0.35 / height,
                        hspace=0.12)  # the legends go in the right margin, never over the last points
    loss_ax, lr_ax = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    for colour, objective in zip(TRAIN_COLOURS, objectives(segments)):  # a loss per objective and masking rate
        plot(loss_ax, [s for s in segments if s["objective"] == objective], "train", "loss",
             f"train loss, {objective}", color=colour, alpha=0.5, lw=0.8)
    plot(loss_ax, segments, "val", "val_mlm", VALIDATION["val_mlm"], color="C1", marker="o", ms=4)
    plot(loss_ax, segments, "val", "val_clm", VALIDATION["val_clm"], color="C2", marker="s", ms=4)
    plot(lr_ax, segments, "train", "lr", "learning rate of each step", steps=True, color="C3")
    mark_switches([loss_ax, lr_ax], segments, "phase switch", names=True, color="k", ls=":", lw=1)
    loss_ax.set(title=run_name(run_dir), ylabel="loss (nats per token)")
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    tokens_axis(lr_ax)
    for ax in (loss_ax, lr_ax):
        if ax.get_legend_handles_labels()[0]:  # a run with no record yet has nothing to name
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", borderaxespad=0)
    return save(fig, out_png or os.path.join(run_dir, "loss.png"))


# Validation measures every run alike, whatever it trains (train.validation_losses).
VALIDATION = {"val_mlm": "validation MLM loss (15% masked)", "val_clm": "validation CLM loss (next token)"}
TRAIN_COLOURS = ("C0", "C4", "C5", "C6", "C7", "C8", "C9")  # C1-C3 are validation's and the learning rate's


def draw_runs(run_dirs, out_png, names=None, figsize=None, dpi=100):
    """Several runs on shared axes: validation MLM and CLM losses, then the train loss of each objective and
    masking rate on a panel of its own (a CLM loss and an MLM loss at 30% are not one quantity), against tokens,
    one colour per run in every panel (line styles change after 10 runs). figsize: (10, 2.6 per panel) by
    default. Returns out_png, or None without matplotlib."""
    for folder in run_dirs:
        if not os.path.isfile(os.path.join(folder, "log.jsonl")):
            raise InputError(f"{folder}: no log.jsonl (not a train.py run directory)")
    if names is not None and len(names) != len(run_dirs):
        raise InputError(f"--names gives {len(names)} names for {len(run_dirs)} runs")
    check_outputs("--out", [out_png], [os.path.join(folder, "log.jsonl") for folder in run_dirs])
    if not names:
        names = [run_name(d) for d in run_dirs]
        if len(set(names)) < len(names):  # out/a/clm and out/b/clm: the paths tell them apart
            names = [os.path.normpath(d) for d in run_dirs]
    every = [run_series(run_dir) for run_dir in run_dirs]
    panels = [("val", key, None) for key in VALIDATION]
    panels += [("train", "loss", objective) for objective in objectives([s for run in every for s in run])]
    fig = new_figure(figsize or (10, 2.6 * len(panels)), dpi, layout="constrained")  # room for the legend
    if fig is None:
        return None
    axes = fig.subplots(len(panels), 1, sharex=True)
    switches = False
    for i, (segments, name) in enumerate(zip(every, names)):
        colour = dict(color=f"C{i % 10}", ls=("-", "--", "-.")[i // 10 % 3])
        for ax, (part, key, objective) in zip(axes, panels):
            style = dict(marker="o", ms=3) if part == "val" else dict(alpha=0.6, lw=0.8)
            mine = [s for s in segments if objective in (None, s["objective"])]
            plot(ax, mine, part, key, name, **colour, **style)
        mark_switches(axes, segments, None, color=colour["color"], ls=":", lw=1)
        switches |= len(segments) > 1
    if switches:
        axes[0].plot([], [], color="grey", ls=":", label="phase switch (in its run's colour)")
    for ax, (_, key, objective) in zip(axes, panels):
        ax.set_ylabel(f"{VALIDATION.get(key) or 'train loss, ' + objective}\n(nats per token)", fontsize="small")
    axes[0].set_title("runs compared: one colour per run in every panel")
    tokens_axis(axes[-1])
    legend = {}  # label -> handle, from every panel: a run may have train records and no validation yet
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    if legend:
        fig.legend(legend.values(), legend.keys(), loc="outside right upper", fontsize="small")
    return save(fig, out_png)


def draw(runs, out=None, names=None):
    """eval.py curves: one run's picture across the phases it continues (out: its loss.png by default), or several
    runs on shared axes (out needed). Returns the path written, or None without matplotlib."""
    for folder in runs:
        if not os.path.isfile(os.path.join(folder, "log.jsonl")):
            raise InputError(f"{folder}: no log.jsonl (not a train.py run directory)")
    if len(runs) > 1:
        if not out:
            raise InputError("--out: several runs are drawn into one picture; name the PNG to write")
        return draw_runs(runs, out, names)
    if names:
        raise InputError("--names names the runs of a comparison; one run's picture is titled by its directory")
    # its own loss.png by default: checked too, as a run on a read-only disk (a colleague's) cannot take it
    check_outputs("--out", [out or os.path.join(runs[0], "loss.png")], [os.path.join(runs[0], "log.jsonl")])
    return draw_run(runs[0], out)

