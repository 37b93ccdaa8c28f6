"""Two papers' comparisons, each in one command, at a smoke, a CPU and the paper's scale, with a report.

    python reproduce.py --scale=smoke --out=out/smoke --jobs=2                    # the CLM detour: the pipeline works
    python reproduce.py --study=biphasic --scale=smoke --out=out/bi --jobs=2      # CLM then MLM from scratch
    python reproduce.py --study=biphasic --scale=cpu --out=out/bi-cpu --jobs=2    # 83 min of 2 CPU cores
    python reproduce.py --scale=paper --out=out/paper --dry_run                   # print every command, check inputs

--study=detour (the default) is continued pretraining of an encoder: a start model; the CLM detour and its MLM
twin on the domain corpus (same data order); three MLM seed controls; low or middle blocks frozen during CLM; the
MLM decays (and one with the low blocks frozen); layer-wise CKA of the twins against the seed controls' band; and
fine-tuning of every decayed model.
--study=biphasic is pretraining from scratch at one budget B: MLM alone (40% masking), CLM for 25% or 50% of B
then MLM, and CLM alone; same data order, seed and steps, one warmup-stable-decay schedule over all of B (its decay
in the last 10%, after the switch; the MLM phase continues the CLM phase's run and schedule). CLM is trained once:
CLM alone is CLM 25% handed off to CLM at 25% and again at 50% of B, where the MLM phases branch off. Then continued
pretraining: MLM for an extra budget E from the MLM-only and from the CLM-only model (their weights, with a fresh
optimizer and schedule); and a decoder control: from the CLM-only model an MLM detour then a CLM return, against
CLM continued for E, compared on validation CLM loss. Every final model is fine-tuned at three learning rates, to
see how much its score depends on the rate.

Every stage is an ordinary command of data.py, train.py or eval.py, printed before it runs (its output goes to
OUT/logs/STAGE.log). A finished stage is skipped, an interrupted training resumes, independent stages run side by
side up to --jobs: after any interruption run the same command again. Each stage runs in a process group of its
own. Ctrl-C or SIGTERM to this driver ends them (SIGTERM, so that a training saves a checkpoint, then SIGKILL after
60 s); a driver killed outright (SIGKILL) takes them with it.

OUT holds the results of one command. OUT/plan.json keeps each stage's fingerprint: a hash of its command, of the
content of its inputs (corpus files, the --start checkpoint, task files, held-out texts) and of the fingerprints
of the stages it depends on. A command whose stages differ from the ones in OUT (another scale, corpus, start,
task file or flag) is refused, naming the stages that differ: use a new --out. Refused rather than re-run in
place, because re-running would delete the finished runs of the first command, and a report must never mix two.
"""
import json
import math
import re
import sys
import time
from pathlib import Path

from machinery.cli import InputError, Parser, positive_int, read_json, run as run_main, usable_cores, write_json
from machinery.stages import Stage, check_out, fingerprint, run, shown, stage_record, stage_times

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent / "shared" / "data"  # where the real data lives beside a checkout (never copied in)
TASKS = [SHARED / "tasks" / t for t in ("ncbi_disease", "chemprot", "pubmedqa")]
HELDOUT = SHARED / "heldout" / "pubmedqa_abstracts.jsonl"  # CKA's texts: no model trained on them

# -----------------------------------------------------------------------------
# Scales. Budgets in tokens (detour) or optimizer steps of the recipe (biphasic); `ft`: eval.py finetune's
# flags, run once per learning rate of `lrs`; a small model fine-tunes best at a larger lr than base's 5e-5.

DETOUR = {
    "smoke": dict(recipe="smoke", tokenizer="bytes", general_bytes=200_000, start_tokens=30_720, arm_tokens=10_240,
                  controls=3, eval_interval=2, cka=dict(n=32, seeds="42,43,44", max_len=128),
                  ft=dict(seeds="42,43,44,45,46", epochs=1, train_subset=32, eval_subset=16, max_len=64), lrs=[1e-3]),
    "cpu": dict(recipe="cpu", tokenizer=8192, general_bytes=2_000_000, start_tokens=2_000_000, arm_tokens=1_000_000,
                controls=3, eval_interval=10, cka=dict(n=300, seeds="42,43,44", max_len=256),
                ft=dict(seeds="42,43,44,45,46", epochs=2, train_subset=500, eval_subset=200, max_len=128),
                lrs=[5e-4]),
    "paper": dict(recipe="paper", start="answerdotai/ModernBERT-base", arm_tokens=10_000_000_000, controls=3,
                  eval_interval=None, cka=dict(n=500, seeds="42,43,44", max_len=512),
                  ft=dict(seeds="42,43,44,45,46", max_len=512), lrs=[5e-5]),
}
# B = `steps`, E = `extra_steps`, both multiples of 4 so that every share is whole steps. decay_steps 0: train.py's
# --decay_frac (the last 10% of a schedule); the paper decays over its last 2k steps. The cpu scale, measured on
# 2 cores with --jobs=2 (2026-11-25): 7.3M training tokens in 11 trainings (4,356 s summed, ~1,700 tokens/s each)
# and 24 fine-tunings of 3 tasks x 3 seeds (~230 s each, 5,543 s summed), 83 min of wall time.
BIPHASIC = {
    "smoke": dict(recipe="smoke", tokenizer="bytes", steps=16, extra_steps=12, decay_steps=0, eval_interval=2,
                  ft=dict(seeds="42,43", epochs=1, train_subset=32, eval_subset=16, max_len=64),
                  lrs=[3e-4, 1e-3, 3e-3]),
    "cpu": dict(recipe="cpu", tokenizer=8192, steps=200, extra_steps=60, decay_steps=0, eval_interval=10,
                ft=dict(seeds="42,43,44", epochs=2, train_subset=250, eval_subset=100, max_len=128),
                lrs=[2e-4, 5e-4, 1e-3]),
    "paper": dict(recipe="paper", tokenizer="answerdotai/ModernBERT-base", steps=12_000, extra_steps=12_000,
                  decay_steps=2_000, eval_interval=None, ft=dict(seeds="42,43,44,45,46", max_len=512),
                  lrs=[2e-5, 5e-5, 1e-4]),
}
CONTROL_SEEDS = (18, 19, 20, 21, 22)  # the twins train with seed 17; a control differs from MLM only in its seed
# Method names for tables and figures (a run directory's name is not a method's), final models first: the
# order of the tables and of the colours, one per final model in every panel.
METHODS = {
    "detour": {"mlm-decay": "MLM", "clm-decay": "CLM detour", "clm-freeze-low-decay": "CLM, low blocks frozen",
               "clm-freeze-mid-decay": "CLM, middle blocks frozen",
               "clm-decay-freeze-low": "CLM, low blocks frozen in the decay", "start": "start model",
               "mlm": "MLM (Phase 1)", "clm": "CLM detour (Phase 1)", "clm-freeze-low": "CLM, low frozen (Phase 1)",
               "clm-freeze-mid": "CLM, middle frozen (Phase 1)",
               **{f"mlm-seed{seed}{end}": f"MLM seed control {seed}{what}" for seed in CONTROL_SEEDS
                  for end, what in (("", " (Phase 1)"), ("-decay", ""))}},
    "biphasic": {"mlm": "MLM only", "clm25-mlm": "CLM 25% then MLM", "clm50-mlm": "CLM 50% then MLM",
                 "clm": "CLM only", "cpt-from-mlm": "MLM-only model + MLM", "cpt-from-clm": "CLM-only model + MLM",
                 "decoder-detour-clm": "CLM-only + MLM detour + CLM", "decoder-clm": "CLM-only + CLM",
                 "clm25": "CLM, the first 25% of B", "clm50": "CLM, 25% to 50% of B",
                 "decoder-detour": "CLM-only + MLM detour (first phase)"},
}
FINAL = {"detour": list(METHODS["detour"])[:5], "biphasic": list(METHODS["biphasic"])[:8]}
# The fine-tuning tables: (title, models, the model the others are paired against).
COMPARISONS = {
    "detour": [("the decayed models", FINAL["detour"], "mlm-decay")],
    "biphasic": [("from scratch at one budget B", FINAL["biphasic"][:4], "mlm"),
                 ("continued pretraining, E more tokens of MLM", ["cpt-from-mlm", "cpt-from-clm"], "cpt-from-mlm"),
                 ("the decoder control, E more tokens for the CLM-only model", ["decoder-clm", "decoder-detour-clm"],
                  "decoder-clm")],
}
TITLES = {"detour": "The CLM detour against MLM in continued pretraining",
          "biphasic": "CLM then MLM against MLM alone, from scratch at one budget"}


def python(script, *args):
    return [sys.executable, str(HERE / script), *map(str, args)]


def trainer(nproc):
    """One process per GPU through torchrun; a plain process on a CPU."""
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                str(HERE / "train.py")]
    return python("train.py")


def training(s, nproc):
    every = [f"--eval_interval={s['eval_interval']}"] if s["eval_interval"] else []  # a curve point per eval
    return [*trainer(nproc), f"--recipe={s['recipe']}", *every]


def data_stages(spec, learn_from, corpus, out, needs=()):
    """(stages, tokenizer): the corpus tokenized for training into OUT/data/corpus, with `spec` (a file, a hub id,
    'bytes'), or an int: a vocabulary of that many ids learned on `learn_from`, so that a small model is not
    mostly embedding."""
    stages, prep, tokenizer = [], [], spec
    if isinstance(spec, int):
        tokenizer = out / "tokenizer.json"
        stages.append(Stage("tokenizer", python("data.py", "tokenizer", "--input", *learn_from, "--vocab_size", spec,
                                                "--out", tokenizer), list(needs), corpus, threaded=False))
        prep = ["tokenizer"]
    stages.append(Stage("data-corpus", python("data.py", "prepare", "--input", *corpus, "--tokenizer", tokenizer,
                                              "--out", out / "data" / "corpus", "--val_fraction", 0.02), prep,
                        [*corpus, *([tokenizer] if Path(str(tokenizer)).is_file() else [])], threaded=False))
    return stages, tokenizer


def ft_path(out, arm, lr):
    return out / "finetune" / f"{arm}-lr{lr:g}.json"


def finetune_stages(s, out, tasks, study):
    """Every final model fine-tuned on every task over the scale's seeds, once per learning rate."""
    flags = [f"--{k}={v}" for k, v in s["ft"].items()]
    return [Stage(f"finetune-{arm}-lr{lr:g}", python("eval.py", "finetune", out / "runs" / arm,
                                                    *(f"--task={t}" for t in tasks), *flags, f"--lr={lr}",
                                                    f"--out={ft_path(out, arm, lr)}"), [arm], list(tasks))
            for arm in FINAL[study] for lr in s["lrs"]]


def detour_plan(s, out, a):
    """Every stage of the CLM detour study, in an order that respects `needs`."""
    runs, start, stages = out / "runs", a.start or s.get("start"), []
    if start is None:  # no pretrained ModernBERT offline: our own start model learns general text first
        general = out / "general.jsonl"
        stages.append(Stage("data-general", python("data.py", "docstrings", "--out", general, "--max_bytes",
                                                   s["general_bytes"]), threaded=False))
        more, tokenizer = data_stages(s["tokenizer"], [general, *a.corpus], a.corpus, out, ["data-general"])
        stages += more
        stages.append(Stage("data-general-prepare", python(
            "data.py", "prepare", "--input", general, "--tokenizer", tokenizer, "--out", out / "data" / "general",
            "--val_fraction", 0.02), ["data-general", *(["tokenizer"] if isinstance(s["tokenizer"], int) else [])],
            threaded=False))
        stages.append(Stage("start", [*training(s, a.nproc), "--phase=mlm", f"--data={out / 'data' / 'general'}",
                                      f"--tokens={s['start_tokens']}", f"--out_dir={runs / 'start'}"],
                            ["data-general-prepare"], run_dir=str(runs / "start"), solo=True))
        start, start_needs, start_inputs = runs / "start", ["start"], []
    else:  # the corpus in the start model's own vocabulary
        more, _ = data_stages(start_tokenizer(start), [], a.corpus, out)
        stages, start_needs, start_inputs = more, [], [start] if Path(start).exists() else []
    arm = [*training(s, a.nproc), f"--init_from={start}", "--weights_only", f"--data={out / 'data' / 'corpus'}",
           f"--tokens={s['arm_tokens']}"]
    arms = [("clm", "clm", []), ("mlm", "mlm", []), ("clm-freeze-low", "clm", ["--freeze=low"]),
            ("clm-freeze-mid", "clm", ["--freeze=mid"])]
    arms += [(f"mlm-seed{seed}", "mlm", [f"--seed={seed}"]) for seed in CONTROL_SEEDS[:s["controls"]]]
    for name, phase, flags in arms:
        stages.append(Stage(name, [*arm, f"--phase={phase}", *flags, f"--out_dir={runs / name}"],
                            ["data-corpus", *start_needs], start_inputs, str(runs / name)))
    decays = [(f"{name}-decay", name, []) for name, _, _ in arms] + [("clm-decay-freeze-low", "clm", ["--freeze=low"])]
    for name, parent, flags in decays:  # a phase hand-off: the decay continues its arm's run
        stages.append(Stage(name, [*training(s, a.nproc), "--phase=decay", f"--init_from={runs / parent}", *flags,
                                   f"--out_dir={runs / name}"], [parent], run_dir=str(runs / name), continues=parent))
    controls = [f"mlm-seed{seed}" for seed in CONTROL_SEEDS[:s["controls"]]]
    for when, suffix in (("before", ""), ("after", "-decay")):
        pair = [f"mlm{suffix}", f"clm{suffix}", *(c + suffix for c in controls)]
        stages.append(Stage(f"cka-{when}", python(
            "eval.py", "cka", runs / pair[0], runs / pair[1], *(f"--control={runs / c}" for c in pair[2:]),
            f"--texts={HELDOUT}", *(f"--{k}={v}" for k, v in s["cka"].items()), "--names=MLM,CLM",
            f"--out={out / f'cka-{when}.json'}"), pair, [HELDOUT]))
    return stages + finetune_stages(s, out, a.tasks, "detour")


def step_tokens(recipe):
    """Tokens per optimizer step of a train.py recipe (seq_len x batch_size), read from train.py itself."""
    from train import RECIPES, Config  # imports torch: only the biphasic plan needs it
    values = {**vars(Config()), **RECIPES[recipe]}
    return values["seq_len"] * values["batch_size"]


def biphasic_plan(s, out, a):
    """Every stage of the biphasic study. All trainings share the seed, the data order and the steps."""
    runs, data, per_step = out / "runs", out / "data" / "corpus", step_tokens(s["recipe"])
    assert s["steps"] % 4 == 0 and s["extra_steps"] % 2 == 0, "budgets in whole steps: 25% of B, half of E"
    B, E = s["steps"] * per_step, s["extra_steps"] * per_step
    stages, _ = data_stages(s["tokenizer"], a.corpus, a.corpus, out)
    wsd = ["--schedule=wsd", *([f"--decay_tokens={s['decay_steps'] * per_step}"] if s["decay_steps"] else [])]
    mlm, clm = ["--phase=mlm", "--mask_rate=0.4"], ["--phase=clm"]  # the study's MLM masks 40%

    def arm(name, objective, tokens, schedule, parent="", weights_only=False):
        """A training of `tokens` within a WSD schedule over `schedule` tokens: from scratch; from the weights of
        `parent` (a fresh optimizer, data position and schedule); or continuing `parent`'s run, a hand-off that
        carries its Adam moments, step counter, data position and schedule."""
        origin = [f"--init_from={runs / parent}", *(["--weights_only"] if weights_only else [])] if parent else []
        origin += [f"--data={data}"] if weights_only or not parent else []  # a hand-off inherits its data
        return Stage(name, [*training(s, a.nproc), *objective, *wsd, f"--tokens={tokens}",
                            f"--schedule_tokens={schedule}", *origin, f"--out_dir={runs / name}"],
                     [parent or "data-corpus"], run_dir=str(runs / name), continues=parent)

    # CLM 25% and 50% are the first quarter and half of the CLM-only run (the same seed, data order and schedule),
    # so CLM is trained once, in hand-offs at 25% and 50% of B that the MLM phases branch from: a hand-off within
    # one schedule is bit-identical to the straight run, and B/4 + B/2 of training are saved. The longest chain
    # comes first: the scheduler starts ready stages in this order.
    stages += [arm("clm25", clm, B // 4, B), arm("clm50", clm, B // 4, B, "clm25"), arm("clm", clm, B // 2, B, "clm50")]
    stages += [arm(f"clm{share}-mlm", mlm, B - B * share // 100, B, f"clm{share}") for share in (25, 50)]
    stages.append(arm("mlm", mlm, B, B))
    # Continued pretraining restarts the optimizer and the schedule (--weights_only): both start models ended
    # their decay, and carrying Adam moments would give MLM-from-MLM moments of its own objective and
    # MLM-from-CLM moments of another. Fresh ones leave the weights as the only difference.
    stages += [arm("cpt-from-mlm", mlm, E, E, "mlm", True), arm("cpt-from-clm", mlm, E, E, "clm", True)]
    stages += [arm("decoder-detour", mlm, E // 2, E, "clm", True),
               arm("decoder-detour-clm", clm, E - E // 2, E, "decoder-detour"),
               arm("decoder-clm", clm, E, E, "clm", True)]
    return stages + finetune_stages(s, out, a.tasks, "biphasic")


STUDIES = {"detour": (DETOUR, detour_plan), "biphasic": (BIPHASIC, biphasic_plan)}


def start_tokenizer(start):
    """The tokenizer a --start checkpoint was trained with: its tokenizer.json, or its hub id."""
    local = Path(start) / "tokenizer.json"
    return local if local.is_file() else start


# -----------------------------------------------------------------------------
# The report: OUT/report.md, OUT/report.json and OUT/report.png, from the finished stages of this plan alone.


def run_log(run_dir):
    """A run's train and validation records (a resume trims the log to the checkpoint it starts from)."""
    from machinery.curves import read_log
    records = read_log(Path(run_dir) / "log.jsonl")
    return {"train": [r for r in records if "loss" in r], "val": [r for r in records if "val_mlm" in r]}


def runs_summary(out, stages):
    """Per training stage: tokens trained, its validation points (every eval) and lr, the chain it continues, and
    what it trained, from the configuration its last checkpoint holds (`how`: e.g. 'mlm 40% masked, wsd')."""
    from machinery.rundir import latest_state
    summary = {}
    for s in (s for s in stages if s.run_dir):
        log, c = run_log(s.run_dir), latest_state(s.run_dir)["config"]
        rate = f" {c['mask_rate']:.0%} masked" if c["objective"] == "mlm" else ""
        summary[s.name] = dict(
            tokens=max([r["tokens"] for r in log["train"]], default=0), continues=s.continues,
            objective=c["objective"],
            how=f"{c['objective']}{rate}, {c['schedule']}" + (f", frozen: {c['freeze']}" if c["freeze"] else ""),
            val=[[r["tokens"], r["val_mlm"], r["val_clm"]] for r in log["val"]],
            lr=[[r["tokens"], r["lr"]] for r in log["train"]])
    return summary


def finetune_summary(out, s, study):
    """Per final model and lr: each task's primary test metric per seed, mean, std and majority baseline."""
    summary = {}
    for arm in FINAL[study]:
        for lr in s["lrs"]:
            tasks = read_json(ft_path(out, arm, lr), "a results file of eval.py finetune")["tasks"]
            summary.setdefault(arm, {})[f"{lr:g}"] = {
                name: dict(metric=t["primary"], mean=t["mean"][t["primary"]], std=t["std"][t["primary"]],
                           baseline=t["baseline"]["test"][t["primary"]],
                           seeds={seed: r["test"][t["primary"]] for seed, r in t["seeds"].items()})
                for name, t in tasks.items()}
    return summary


def model_line(run_dir):
    """The architecture actually trained, from its config.json and its weights' header."""
    config = read_json(Path(run_dir) / "config.json", "a model's config.json")
    with open(Path(run_dir) / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    params = sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return (f"ModernBERT, {config['num_hidden_layers']} blocks x {config['hidden_size']} wide, {params / 1e6:.2f}M "
            f"parameters, vocabulary {config['vocab_size']:,}")


def report(out, study, scale, s, stages, plan):
    rep = dict(study=study, scale=scale, fingerprint=plan["fingerprint"], runs=runs_summary(out, stages),
               finetune=finetune_summary(out, s, study), time=stage_times(out, stages))
    if study == "detour":
        keys = ("layers", "divergence", "control_divergence", "ratio", "outside_band")
        rep["cka"] = {w: {k: v for k, v in read_json(out / f"cka-{w}.json").items() if k in keys}
                      for w in ("before", "after")}
    rep["figures"] = [f for f in [figure(out, rep, study, s)] if f]
    write_json(out / "report.json", finite(rep))
    (out / "report.md").write_text(markdown(out, rep, study, s, stages))
    print(f"report: {out / 'report.md'}, {out / 'report.json'}" + "".join(f", {out / f}" for f in rep["figures"]))


def finite(obj):
    """JSON has no inf or NaN (a ratio over a zero control divergence): such a number is written as its text."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return str(obj) if isinstance(obj, float) and not math.isfinite(obj) else obj


def chain(runs, name):
    """The runs `name` continues, first to last, ending with `name` itself."""
    names = [name]
    while runs[names[-1]]["continues"]:
        names.append(runs[names[-1]]["continues"])
    return names[::-1]


def curve_segments(rep, arms):
    """Per arm, its runs on one token axis (run, offset): the runs it continues come first, each drawn once, by
    the first arm that has it, arms of one objective first (the CLM-only model draws the CLM runs that CLM 25%
    and 50% then MLM branch off; the MLM-only model is an arm of its own)."""
    runs, drawn, segments = rep["runs"], set(), {}
    one_objective = [a for a in arms if len({runs[n]["objective"] for n in chain(runs, a)}) == 1]
    for arm in one_objective + [a for a in arms if a not in one_objective]:
        offset, parts = 0, []
        for name in chain(runs, arm):
            if name not in drawn and (name == arm or name not in arms):
                parts.append((name, offset))
                drawn.add(name)
            offset += runs[name]["tokens"]
        segments[arm] = parts
    return {arm: segments[arm] for arm in arms}


CURVES = [("val", 1, "validation MLM loss (15% masked)", "nats per token"),
          ("val", 2, "validation CLM loss", "nats per token"), ("lr", 1, "learning rate", "learning rate")]


def figure(out, rep, study, s):
    """report.png: validation MLM and CLM loss and the learning rate against tokens (top), fine-tuning per task
    (bottom), one colour per final model in every panel. None without matplotlib (said once)."""
    from machinery.curves import new_figure, save
    tasks = list(rep["finetune"][FINAL[study][0]][f"{s['lrs'][0]:g}"])
    fig = new_figure((18, 10), 100, layout="constrained")
    if fig is None:
        return None
    axes = fig.subplots(2, max(len(CURVES), len(tasks)), squeeze=False)
    colour = {arm: f"C{i % 10}" for i, arm in enumerate(FINAL[study])}
    handles = draw_curves(axes[0], rep, study, colour) + draw_finetuning(axes[1], rep, study, s, tasks, colour)
    for ax in [*axes[0][len(CURVES):], *axes[1][len(tasks):]]:
        ax.set_visible(False)
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=9)
    fig.suptitle(f"{TITLES[study]}, scale {rep['scale']}" + (" (smoke: these numbers test the pipeline only)"
                                                              if rep["scale"] == "smoke" else ""))
    save(fig, out / "report.png")
    return "report.png"


def draw_curves(axes, rep, study, colour):
    """Every eval's validation losses, and the lr of every step, of each final model along the runs it continues,
    one line per model that branches off the last point of a run another model draws; a dotted line where a run
    continues another. Returns the legend's handles."""
    from machinery.curves import tokens_axis
    from matplotlib.lines import Line2D
    runs, switches = rep["runs"], set()
    for i, (arm, parts) in enumerate(curve_segments(rep, FINAL[study]).items()):
        switches |= {offset for _, offset in parts} - {0}
        first, start = parts[0]
        before = runs[first]["continues"]  # a run another model draws: this one branches off its last point
        for ax, (part, column, _, _) in zip(axes, CURVES):
            points = [(start, runs[before][part][-1][column])] if before and runs[before][part] else []
            points += [(p[0] + offset, p[column]) for name, offset in parts for p in runs[name][part]]
            style = dict(lw=1.2, ms=3, marker="o") if part == "val" else dict(lw=3.5 - 0.3 * i, marker=".")
            if points:  # the lr lines nested: where runs share a schedule, every one shows
                ax.plot(*zip(*points), color=colour[arm], **style)
    for ax, (_, _, title, unit) in zip(axes, CURVES):
        for x in switches:
            ax.axvline(x, color="grey", ls=":", lw=1)
        ax.set(title=f"{title} against tokens", ylabel=unit)
        tokens_axis(ax)
    handles = [Line2D([], [], color=colour[arm], marker="o", ms=3, label=METHODS[study][arm]) for arm in colour]
    if switches:
        handles.append(Line2D([], [], color="grey", ls=":", label="a run continues another here"))
    return handles


def draw_finetuning(axes, rep, study, s, tasks, colour):
    """Per task, each final model's test score at each fine-tuning lr (mean ± std over seeds) and the majority
    baseline. Returns the legend's handles for the lrs and the baseline."""
    from matplotlib.lines import Line2D
    arms, markers, lrs = FINAL[study], "os^v", [f"{lr:g}" for lr in s["lrs"]]
    for ax, task in zip(axes, tasks):
        for k, lr in enumerate(lrs):
            for i, arm in enumerate(arms):
                r = rep["finetune"][arm][lr][task]
                ax.errorbar(i + 0.2 * (k - (len(lrs) - 1) / 2), 100 * r["mean"], yerr=100 * r["std"],
                            color=colour[arm], marker=markers[k], ms=5, capsize=2, ls="none")
        ax.axhline(100 * r["baseline"], color="black", ls="--", lw=1)
        ax.set_xticks(range(len(arms)), [METHODS[study][a] for a in arms], rotation=30, ha="right", fontsize=8)
        ax.set(title=f"fine-tuning: {task}", ylabel=f"test {r['metric']} x100")
    seeds = len(s["ft"]["seeds"].split(","))
    return [Line2D([], [], color="black", ls="--", label="majority baseline (test split)")] + [
        Line2D([], [], color="grey", marker=markers[k], ls="none",
               label=f"fine-tuning lr {lr}: mean ± std over {seeds} seeds") for k, lr in enumerate(lrs)]


def markdown(out, rep, study, s, stages):
    from eval import cka_markdown, finetune_markdown  # imports torch: only the report needs it
    lines = [f"# {TITLES[study]}, scale `{rep['scale']}`", ""]
    if rep["scale"] == "smoke":
        lines += ["**Smoke scale: a tiny model trained for seconds. These numbers test the pipeline only; they say "
                  "nothing about the methods.**", ""]
    lines += what_was_run(out, rep, study, s, stages)
    lines += ["## Training runs", "", "Validation losses on the same held-out windows of the corpus for every run "
              "(MLM with 15% masked, CLM on every position), at the end of each run; curves in report.png.", "",
              "| run | method | objective, schedule | continues | tokens (with the runs it continues) | "
              "validation MLM loss | validation CLM loss |", "|---|---|---|---|---|---|---|"]
    for name, r in rep["runs"].items():
        last = r["val"][-1] if r["val"] else [0, math.nan, math.nan]
        total = sum(rep["runs"][n]["tokens"] for n in chain(rep["runs"], name))
        lines.append(f"| {name} | {METHODS[study].get(name, '')} | {r['how']} | {r['continues'] or '-'} | "
                     f"{r['tokens']:,}" + (f" ({total:,})" if r["continues"] else "") +
                     f" | {last[1]:.4f} | {last[2]:.4f} |")
    lines.append("")
    if study == "biphasic":
        lines += decoder_control(rep)
    else:
        for when in ("before", "after"):
            lines += [f"## Layer-wise CKA {when} the decay", "",
                      cka_markdown(read_json(out / f"cka-{when}.json")).strip(), "",
                      f"![CKA {when} the decay](cka-{when}.png)", ""]
    for title, arms, base in COMPARISONS[study]:
        for lr in s["lrs"]:
            results = {METHODS[study][a]: read_json(ft_path(out, a, lr)) for a in arms}
            lines += [f"## Fine-tuning at lr {lr:g}: {title}", "",
                      finetune_markdown(results, baseline_arm=METHODS[study][base]).strip(), ""]
    if len(s["lrs"]) > 1:
        lines += stability(rep, study, s)
    lines += times(rep["time"]) + [f"![{f}]({f})" for f in rep["figures"]]
    return "\n".join(lines) + "\n"


def what_was_run(out, rep, study, s, stages):
    ft, seeds = s["ft"], s["ft"]["seeds"].split(",")
    subsets = (f"{ft['train_subset']} train / {ft['eval_subset']} dev and test examples per task"
               if "train_subset" in ft else "the full tasks")
    epochs = f"{ft['epochs']} epoch(s)" if "epochs" in ft else "eval.py's default epochs"
    first = next(st for st in stages if st.name == FINAL[study][0])
    tasks = next(st.inputs for st in stages if st.name.startswith("finetune-"))
    rows = [("study", f"`--study={study}`: {TITLES[study]}"),
            ("scale", f"`{rep['scale']}`: `train.py --recipe={s['recipe']}`"),
            ("model", model_line(first.run_dir)),
            ("tokens", budgets(rep, study, s) + "; every run's in the table below"),
            ("fine-tuning", f"{', '.join(Path(str(t)).name for t in tasks)}; {subsets}, "
                            f"{ft['max_len']} tokens, {epochs}; lr {', '.join(f'{lr:g}' for lr in s['lrs'])}; "
                            f"{len(seeds)} seeds ({', '.join(seeds)}) per model and lr"),
            ("stages", f"{len(stages)}, all finished; plan fingerprint `{rep['fingerprint'][:12]}`")]
    if study == "detour":
        rows.insert(4, ("CKA", f"{s['cka']['n']} held-out texts x {len(s['cka']['seeds'].split(','))} draws, "
                               f"{s['cka']['max_len']} tokens; band: {s['controls']} MLM seed controls"))
    return ["## What was run", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]


def budgets(rep, study, s):
    runs = rep["runs"]
    if study == "biphasic":
        return (f"B = {runs['mlm']['tokens']:,} ({s['steps']} steps) for every model from scratch, E = "
                f"{runs['cpt-from-mlm']['tokens']:,} ({s['extra_steps']} steps) more for every continued one")
    start = f"start model {runs['start']['tokens']:,} (general text); " if "start" in runs else ""
    return f"{start}Phase 1 {runs['clm']['tokens']:,} per arm; decay {runs['clm-decay']['tokens']:,}"


def decoder_control(rep):
    detour, plain = rep["runs"]["decoder-detour-clm"], rep["runs"]["decoder-clm"]
    a, b = detour["val"][-1][2], plain["val"][-1][2]
    return ["## Decoder control", "",
            f"From the CLM-only model, E = {plain['tokens']:,} more tokens: an MLM detour then a CLM return ends at "
            f"validation CLM loss {a:.4f}; CLM continued for the same tokens ends at {b:.4f} (detour - continued: "
            f"{a - b:+.4f}; positive means the detour cost the decoder).", ""]


def stability(rep, study, s):
    """Per final model and task: the mean over seeds at each fine-tuning lr, and their range."""
    tasks = list(rep["finetune"][FINAL[study][0]][f"{s['lrs'][0]:g}"])
    lrs = [f"{lr:g}" for lr in s["lrs"]]
    first = rep["finetune"][FINAL[study][0]][lrs[0]]
    lines = ["## Stability across fine-tuning learning rates", "",
             f"Mean test score (x100) over seeds at lr {' / '.join(lrs)}, and the range of those means: a smaller "
             f"range means a model less sensitive to the fine-tuning lr.", "",
             "| model | " + " | ".join(f"{t} [{first[t]['metric']}]" for t in tasks) + " |",
             "|---|" + "---|" * len(tasks),
             "| majority baseline | " + " | ".join(f"{100 * first[t]['baseline']:.2f}" for t in tasks) + " |"]
    for arm in FINAL[study]:
        cells = []
        for t in tasks:
            means = [100 * rep["finetune"][arm][lr][t]["mean"] for lr in lrs]
            cells.append(" / ".join(f"{m:.2f}" for m in means) + f" (range {max(means) - min(means):.2f})")
        lines.append(f"| {METHODS[study][arm]} | " + " | ".join(cells) + " |")
    return lines + [""]


def times(t):
    lines = ["## Time", "",
             f"Wall time: {t['wall']:.0f} s (while at least one stage ran; pauses between invocations left out). "
             f"Summed stage time: {t['summed']:.0f} s (each stage's own time, added up: stages ran side by side). "
             f"An interrupted attempt's time is in neither.", "", "| stage | seconds |", "|---|---|"]
    return lines + [f"| {n} | {v:.1f} |" for n, v in t["stages"].items()] + [""]


# -----------------------------------------------------------------------------
# Command line.


def parse(argv):
    parser = Parser(description=__doc__)
    parser.add_argument("--study", choices=STUDIES, default="detour", help="which comparison (see above)")
    parser.add_argument("--scale", choices=DETOUR, required=True, help="smoke: the pipeline in a minute; cpu: 80-85 "
                        "min of 2 CPU cores; paper: the papers' budgets on the GPUs present")
    parser.add_argument("--out", required=True, help="the experiment directory (plan, runs, logs, report); new, "
                        "empty, or made by this same command")
    parser.add_argument("--jobs", type=positive_int, default=1, help="stages run side by side (CPU: one per core)")
    parser.add_argument("--gpus", type=positive_int, default=None, help="processes per training, through torchrun "
                        "when more than 1 (default: the GPUs present at --scale=paper, else 1)")
    parser.add_argument("--start", default=None, help="detour: the start checkpoint, a model directory or a hub id "
                        "(default: answerdotai/ModernBERT-base at --scale=paper; smoke and cpu pretrain their own)")
    parser.add_argument("--corpus", nargs="+", default=[str(SHARED / "corpus" / "e3c_en_clinical_cases.jsonl")],
                        help="the training corpus: .jsonl, .txt or .parquet files")
    parser.add_argument("--tasks", nargs="+", default=[str(t) for t in TASKS],
                        help="fine-tuning task folders (train/dev/test .jsonl or .tsv)")
    parser.add_argument("--dry_run", action="store_true", help="check the inputs and OUT, print every command; run "
                        "nothing, write nothing")
    return parser.parse_args(argv)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_inputs(a):
    """Every input before anything runs: one InputError listing all that is wrong."""
    problems = []
    for i, c in enumerate(a.corpus):
        p = Path(c)
        if not p.is_file() or p.suffix not in (".jsonl", ".txt", ".parquet"):
            problems.append(f"--corpus {c}: " + ("expected a .jsonl, .txt or .parquet file" if p.is_file() else
                                                 "not a file" if p.exists() else "not found"))
        elif p.stat().st_size == 0:
            problems.append(f"--corpus {c}: empty")
        elif p.resolve() in [Path(x).resolve() for x in a.corpus[:i]]:
            problems.append(f"--corpus {c}: given twice")
    for t in a.tasks:
        kinds = {ext for ext in (".tsv", ".jsonl") if all((Path(t) / f"{s}{ext}").is_file()
                                                         for s in ("train", "dev", "test"))}
        if len(kinds) != 1:
            problems.append(f"--tasks {t}: expected a folder with train, dev and test .jsonl (or .tsv) files")
    names = [Path(t).name for t in a.tasks]
    if len(set(names)) < len(names):
        problems.append(f"--tasks: two folders share a name ({', '.join(names)}); results are kept by task name")
    if a.study == "detour" and not HELDOUT.is_file():
        problems.append(f"{HELDOUT}: not found (CKA's held-out texts live in ../shared/data)")
    if a.start is not None and a.study != "detour":
        problems.append(f"--start={a.start}: the {a.study} study trains from scratch; --start is for --study=detour")
    elif a.start is not None and Path(a.start).exists():
        missing = [f for f in ("config.json", "tokenizer.json") if not (Path(a.start) / f).is_file()]
        if missing:
            problems.append(f"--start={a.start}: not a model directory (no {' or '.join(missing)})")
    elif a.start is not None and not HUB_ID.fullmatch(a.start):
        problems.append(f"--start={a.start}: not found (expected a model directory or a hub id like org/name)")
    if problems:
        raise InputError("; ".join(problems))


def main(argv=None):
    a = parse(argv)
    check_inputs(a)
    scales, plan_of = STUDIES[a.study]
    s, out = scales[a.scale], Path(a.out).resolve()
    a.nproc = a.gpus or (gpu_count() if a.scale == "paper" else 1) or 1
    if a.gpus and not a.dry_run and 0 < gpu_count() < a.gpus:
        raise InputError(f"--gpus={a.gpus}: this machine has {gpu_count()} GPU(s)")
    a.corpus, a.tasks = [Path(c).resolve() for c in a.corpus], [Path(t).resolve() for t in a.tasks]
    if a.start and Path(a.start).exists():  # stages run from the repository root
        a.start = str(Path(a.start).resolve())
    stages = plan_of(s, out, a)
    plan = fingerprint(stages, out, a.study, a.scale)
    check_out(out, plan)
    if a.dry_run:
        finished = {n for n in plan["stages"] if stage_record(out, n, plan["stages"][n]["fingerprint"]).get("finished")}
        for st in stages:
            print(f"{st.name}: {shown(st.command)}" + ("   (finished in OUT)" if st.name in finished else ""))
        if a.start and not Path(a.start).exists():
            print(f"--start={a.start}: taken as a hub id; it is fetched when the first stage that needs it runs")
        print(f"{len(stages)} stages ({len(finished)} finished in {out}); inputs checked; nothing was run (--dry_run)")
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "plan.json").exists():
            write_json(out / "plan.json", plan)
    except OSError as e:
        raise InputError(f"--out={a.out}: cannot write there ({e.strerror or e})") from None
    print(f"reproduce: study {a.study}, scale {a.scale}, {len(stages)} stages, {a.jobs} at a time, into {out}")
    t0 = time.time()
    run(stages, out, plan, a.jobs, usable_cores())
    report(out, a.study, a.scale, s, stages, plan)
    print(f"all stages finished; this invocation took {time.time() - t0:.0f} s")


def gpu_count():
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


if __name__ == "__main__":
    run_main(main)
