"""Two papers' comparisons, each in one command, at a smoke, a CPU and the paper's scale, with a report.

    python data.py fetch --out data/bio                   # once: the corpus, tasks and held-out texts (--data)
    python reproduce.py --scale=smoke --out=out/smoke --jobs=2                    # the CLM detour: the pipeline works
    python reproduce.py --study=biphasic --scale=smoke --out=out/bi --jobs=2      # CLM then MLM from scratch
    python reproduce.py --scale=cpu --out=out/detour-cpu --jobs=2                 # about 3 h of 2 CPU cores
    python reproduce.py --scale=paper --out=out/paper --dry_run                   # every command, its cost, the power

Every arm is trained --replicates times (default: 2 at smoke, 3 at cpu and paper scale). Replicate r of every arm
shares its training seed (17 + r - 1) and its data-order seed (42 + r - 1) with replicate r of the other arms, so
arms are compared pair by pair; replicates differ in both seeds, so they measure how much two pretraining runs of one
arm differ. Every final model of every replicate is fine-tuned on every task with its replicate's fine-tuning seeds:
the same for every arm, other seeds in each replicate (42,43 in the first, 44,45 in the second, ...).

--study=detour (the default) is continued pretraining of an encoder: a start model; the CLM detour and its MLM
twin on the domain corpus; low or middle blocks frozen during CLM; the MLM decays (and one with the low blocks
frozen); layer-wise CKA of the twins, replicate by replicate, against the band of the MLM replicates compared with
each other (the seed controls); a needle in a haystack at the lengths the models were trained for (how far back each
decayed model reads); and fine-tuning of every decayed model.
--study=biphasic is pretraining from scratch at one budget B: MLM alone (40% masking), CLM for 25% or 50% of B
then MLM, and CLM alone; same data order, seed and steps, one warmup-stable-decay schedule over all of B (its decay
in the last 10%, after the switch; the MLM phase continues the CLM phase's run and schedule). CLM is trained once
per replicate: CLM alone is CLM 25% handed off to CLM at 25% and again at 50% of B, where the MLM phases branch
off. Then continued pretraining: MLM for an extra budget E from the MLM-only and from the CLM-only model (their
weights, with a fresh optimizer and schedule); and a decoder control: from the CLM-only model an MLM detour then a
CLM return, against CLM continued for E, compared on validation CLM loss. The six encoders are fine-tuned at each
learning rate of the scale; each replicate's rate is chosen on the other replicates' dev scores.

The report (OUT/report.md, report.json, report.png) gives every difference between arms with its 95% interval over
the replicates (and, for fine-tuning, the seeds and test examples), says "better" or "worse" only where the
interval excludes 0, flags models that collapsed to the majority baseline, and reads test scores only at the
setting chosen on dev (for each replicate, on the other replicates' dev scores).

Every stage is an ordinary command of data.py, train.py or eval.py, printed before it runs (its output goes to
OUT/logs/STAGE.log). A finished stage is skipped, an interrupted training resumes, independent stages run side by
side up to --jobs: after any interruption run the same command again. Each stage runs in a process group of its
own. Ctrl-C or SIGTERM to this driver ends them (SIGTERM, so that a training saves a checkpoint, then SIGKILL after
60 s); a driver killed outright (SIGKILL) takes them with it.

OUT holds the results of one command. OUT/plan.json keeps each stage's fingerprint: a hash of its command, of the
content of its inputs (corpus files, the --start checkpoint, task files, held-out texts; a hub id as --start is
fetched once, first, and every stage reads that snapshot, whose folder is named by its commit), of the code (every .py
file of the repository) and of the fingerprints of the stages it depends on. A command whose stages differ from
the ones in OUT (another scale, corpus, start, task file, flag, or edited code) is refused, naming the stages that
differ or the code: use a new --out. Refused rather than re-run in
place, because re-running would delete the finished runs of the first command, and a report must never mix two.
"""
import argparse
import json
import math
import statistics
import re
import sys
import time
from pathlib import Path

from machinery import sources
from machinery.cli import (InputError, Parser, positive_float, positive_int, read_json, run as run_main, usable_cores,
                           write_json, write_text)
from machinery.hf import HUB_FILES, hub_id_problem, hub_snapshot
from machinery.planfiles import read_components  # a report's variance components, checked field by field
from machinery.stages import (Stage, check_out, check_unchanged, check_writable, fingerprint, run, shown,
                              stage_record)

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent / "shared" / "data"  # this project's machines keep the data beside a checkout (never copied in)
DATA = SHARED if SHARED.is_dir() else Path("data/bio")  # elsewhere, where `python data.py fetch` writes them

# -----------------------------------------------------------------------------
# Scales. Budgets in tokens (detour) or optimizer steps of the recipe (biphasic); `replicates`: pretraining runs
# per arm; `ft`: eval.py finetune's flags, run once per learning rate of `lrs`; a small model fine-tunes best at a
# larger lr than base's 5e-5; `needle`: eval.py needle at the lengths from `shortest` up to the recipe's seq_len in
# powers of two (what the models were trained at), its depths and examples per cell. With 3 replicates the
# detour's arms are half as long as with one (500k tokens; 1M moved every layer outside the band before) and the
# biphasic budget B is 80 steps (200 with one replicate), one seed at two learning rates. The fine-tuning below
# dominates: the detour at cpu scale is an estimated 3 h 5 min of 2 idle cores (15 models x 2 seeds; measured
# under load: 4 h 15 min wall, 28,553 s summed), the biphasic study 2 h 25 min measured (30 fine-tunings of
# 5-7 min; 8,692 s wall, 17,229 s summed, nearly idle).

# cpu: every test example; 300 optimizer steps per task and seed, at most 3 epochs (ncbi_disease and chemprot
# read about 1 epoch, pubmedqa's 300 train examples 3: 57 steps); dev scored twice on at most 1,000 examples;
# pubmedqa's 50-example dev set topped up to 200 from train. Measured on the detour's models: 300-400 steps take
# ncbi_disease to entity F1 ~0.70 and chemprot to macro-F1 ~0.30 (its majority: 0.04), where 500 examples x 2
# epochs left chemprot at its baseline. About 6 min of one core per model and seed.
CPU_FT = dict(seeds="42,43", steps=300, epochs=3, evals=2, dev_subset=1000, dev_min=200, max_len=128)
# smoke: a few steps on subsets (dev_min 60 moves 10 of pubmedqa's train examples to its 50-example dev set)
SMOKE_FT = dict(seeds="42,43,44", steps=4, epochs=2, evals=2, train_subset=32, dev_subset=16, test_subset=16,
                dev_min=60, max_len=64)
DETOUR = {
    "smoke": dict(recipe="smoke", tokenizer="bytes", general_bytes=200_000, start_tokens=30_720, arm_tokens=10_240,
                  replicates=2, eval_interval=2, cka=dict(n=32, seeds="42,43,44", max_len=128),
                  needle=dict(shortest=64, depths="0,50,100", n=4),
                  ft=SMOKE_FT, lrs=[1e-3]),
    "cpu": dict(recipe="cpu", tokenizer=8192, general_bytes=2_000_000, start_tokens=2_000_000, arm_tokens=500_000,
                replicates=3, eval_interval=10, cka=dict(n=300, seeds="42,43,44", max_len=256),
                needle=dict(shortest=64, depths="0,25,50,75,100", n=30),
                ft=CPU_FT, lrs=[5e-4]),
    "paper": dict(recipe="paper", start="answerdotai/ModernBERT-base", arm_tokens=10_000_000_000, replicates=3,
                  eval_interval=None, cka=dict(n=500, seeds="42,43,44", max_len=512),
                  needle=dict(shortest=512, depths="0,25,50,75,100", n=100),
                  ft=dict(seeds="42,43,44,45,46", max_len=512, dev_min=200), lrs=[5e-5]),
}
# B = `steps`, E = `extra_steps`, both multiples of 4 so that every share is whole steps. decay_steps 0: train.py's
# --decay_frac (the last 10% of a schedule); the paper decays over its last 2k steps. warmup_steps: the cpu recipe's
# 200k-token warmup would be 30% of its short B, longer than the first CLM share; 10% is what B = 200 steps had.
BIPHASIC = {
    "smoke": dict(recipe="smoke", tokenizer="bytes", steps=16, extra_steps=12, decay_steps=0, eval_interval=2,
                  replicates=2, ft={**SMOKE_FT, "seeds": "42,43"}, lrs=[1e-3, 3e-3]),
    "cpu": dict(recipe="cpu", tokenizer=8192, steps=80, extra_steps=24, decay_steps=0, warmup_steps=8,
                eval_interval=8, replicates=3,
                ft={**CPU_FT, "seeds": "42"}, lrs=[3e-4, 1e-3]),
    "paper": dict(recipe="paper", tokenizer="answerdotai/ModernBERT-base", steps=12_000, extra_steps=12_000,
                  decay_steps=2_000, eval_interval=None, replicates=3,
                  ft=dict(seeds="42,43,44,45,46", max_len=512, dev_min=200),
                  lrs=[2e-5, 5e-5, 1e-4]),
}
SEED, DATA_SEED = 17, 42  # replicate r trains with seed 17 + r - 1 and data order 42 + r - 1 (r = 1: the paper's)
CONTROL_SEED = 100  # the detour's seed control r: MLM with seed 117 + r - 1 and replicate r's data order
# Method names for tables and figures (a run's name is its method's key and its replicate: clm-decay-r2), final
# models first: the order of the tables and of the colours, one per final model in every panel.
METHODS = {
    "detour": {"mlm-decay": "MLM", "clm-decay": "CLM detour", "clm-freeze-low-decay": "CLM, low blocks frozen",
               "clm-freeze-mid-decay": "CLM, middle blocks frozen",
               "clm-decay-freeze-low": "CLM, low blocks frozen in the decay", "start": "start model",
               "mlm": "MLM (Phase 1)", "clm": "CLM detour (Phase 1)", "clm-freeze-low": "CLM, low frozen (Phase 1)",
               "clm-freeze-mid": "CLM, middle frozen (Phase 1)", "mlm-control-decay": "MLM, seed control (CKA)",
               "mlm-control": "MLM, seed control (Phase 1)"},
    "biphasic": {"mlm": "MLM only", "clm25-mlm": "CLM 25% then MLM", "clm50-mlm": "CLM 50% then MLM",
                 "clm": "CLM only", "cpt-from-mlm": "MLM-only model + MLM", "cpt-from-clm": "CLM-only model + MLM",
                 "decoder-detour-clm": "CLM-only + MLM detour + CLM", "decoder-clm": "CLM-only + CLM",
                 "clm25": "CLM, the first 25% of B", "clm50": "CLM, 25% to 50% of B",
                 "decoder-detour": "CLM-only + MLM detour (first phase)"},
}
FINAL = {"detour": list(METHODS["detour"])[:5], "biphasic": list(METHODS["biphasic"])[:8]}
# The encoders fine-tuned; the decoder control's two models are compared on validation CLM loss alone.
FINETUNED = {"detour": FINAL["detour"], "biphasic": FINAL["biphasic"][:6]}
# The comparisons: (title, models, the model the others are paired against).
COMPARISONS = {
    "detour": [("the decayed models", FINAL["detour"], "mlm-decay")],
    "biphasic": [("from scratch at one budget B", FINAL["biphasic"][:4], "mlm"),
                 ("continued pretraining, E more tokens of MLM", ["cpt-from-mlm", "cpt-from-clm"], "cpt-from-mlm"),
                 ("the decoder control, E more tokens for the CLM-only model", ["decoder-clm", "decoder-detour-clm"],
                  "decoder-clm")],
}
TITLES = {"detour": "The CLM detour against MLM in continued pretraining",
          "biphasic": "CLM then MLM against MLM alone, from scratch at one budget"}


def replicate(name, r):
    return f"{name}-r{r}"


def seeds(r, control=False):
    """A replicate's training seed and data-order seed, as train.py flags; its seed control (CKA's) keeps the data
    order and takes another training seed, so that the control differs from replicate r in its seed alone."""
    return [f"--seed={SEED + r - 1 + (CONTROL_SEED if control else 0)}", f"--data_seed={DATA_SEED + r - 1}"]


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
                        # a tokenizer the plan learns is in OUT, fingerprinted through its stage; a file of the
                        # user's is an input (its content counted whether or not it existed at the first run)
                        [*corpus, *([tokenizer] if not isinstance(spec, int) and Path(str(tokenizer)).is_file()
                                    else [])], threaded=False))
    return stages, tokenizer


def ft_path(out, model, lr):
    return out / "finetune" / f"{model}-lr{lr:g}.json"


def ft_seeds(s, r):
    """Replicate r's fine-tuning seeds: the scale's, moved past those of the replicates before it (42,43; 44,45; ...;
    past their whole span, so that no two replicates share one however the scale's are spaced).
    Every arm of a replicate shares them, so its runs pair seed by seed; no two replicates do, so that how an arm
    fares on one seed is a draw of its own in each replicate, which the replicates' spread (the interval) holds,
    and not one draw that every replicate repeats and no interval sees."""
    first = [int(x) for x in str(s["ft"]["seeds"]).split(",")]
    return ",".join(str(x + (r - 1) * (max(first) - min(first) + 1)) for x in first)


def finetune_stages(s, out, tasks, study, R):
    """Every fine-tuned model of every replicate on every task over its replicate's seeds, once per learning rate."""
    def flags(r):
        return [f"--{k}={v}" for k, v in {**s["ft"], "seeds": ft_seeds(s, r)}.items()]
    return [Stage(f"finetune-{m}-lr{lr:g}", python("eval.py", "finetune", out / "runs" / m,
                                                  *(f"--task={t}" for t in tasks), *flags(r), f"--lr={lr}",
                                                  f"--out={ft_path(out, m, lr)}"), [m], list(tasks))
            for r in range(1, R + 1) for m in (replicate(a, r) for a in FINETUNED[study]) for lr in s["lrs"]]


def detour_plan(s, out, a):
    """Every stage of the CLM detour study, in an order that respects `needs`."""
    runs, start, stages, R = out / "runs", a.start or s.get("start"), [], a.replicates
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
        # a hub snapshot's folder may gain files that other tools fetch: its inputs are the files the stages read
        inputs = ([Path(start) / f for f in HUB_FILES] if a.hub else [start]) if Path(start).exists() else []
        stages, start_needs, start_inputs = more, [], inputs
    arm = [*training(s, a.nproc), f"--init_from={start}", "--weights_only", f"--data={out / 'data' / 'corpus'}",
           f"--tokens={s['arm_tokens']}"]
    # mlm-control: the seed control of CKA, MLM again with replicate r's data order and another training seed
    arms = [("clm", "clm", []), ("mlm", "mlm", []), ("clm-freeze-low", "clm", ["--freeze=low"]),
            ("clm-freeze-mid", "clm", ["--freeze=mid"]), ("mlm-control", "mlm", [])]
    decays = [(f"{name}-decay", name, []) for name, _, _ in arms] + [("clm-decay-freeze-low", "clm", ["--freeze=low"])]
    for r in range(1, R + 1):
        for name, phase, flags in arms:
            run_dir = runs / replicate(name, r)
            stages.append(Stage(replicate(name, r), [*arm, f"--phase={phase}", *flags,
                                                     *seeds(r, control=name == "mlm-control"), f"--out_dir={run_dir}"],
                                ["data-corpus", *start_needs], start_inputs, str(run_dir)))
    for r in range(1, R + 1):
        for name, parent, flags in decays:  # a phase hand-off: the decay continues its arm's run and seeds
            run_dir, parent = runs / replicate(name, r), replicate(parent, r)
            stages.append(Stage(replicate(name, r), [*training(s, a.nproc), "--phase=decay",
                                                     f"--init_from={runs / parent}", *flags, f"--out_dir={run_dir}"],
                                [parent], run_dir=str(run_dir), continues=parent))
    for when, suffix in (("before", ""), ("after", "-decay")):  # mlm-r and mlm-control-r: the seed controls
        mlm, clm, control = ([replicate(f"{name}{suffix}", r) for r in range(1, R + 1)]
                             for name in ("mlm", "clm", "mlm-control"))
        stages.append(Stage(f"cka-{when}", python(
            "eval.py", "cka", ",".join(str(runs / m) for m in mlm), ",".join(str(runs / m) for m in clm),
            *(f"--control={runs / m}" for m in control), f"--texts={a.heldout}",
            *(f"--{k}={v}" for k, v in s["cka"].items()), "--names=MLM,CLM",
            f"--out={out / f'cka-{when}.json'}"), mlm + clm + control, [a.heldout]))
    stages.append(needle_stage(s, out, R, a.heldout))
    return stages + finetune_stages(s, out, a.tasks, "detour", R)


def needle_stage(s, out, R, heldout):
    """eval.py needle on every final model of every replicate, an arm's replicates together, at the lengths the
    scale's models were trained for: powers of two from the scale's shortest up to its recipe's seq_len; its
    haystacks are the `heldout` texts."""
    finals = [[replicate(m, r) for r in range(1, R + 1)] for m in FINAL["detour"]]
    seq_len, lengths = trained_length(s["recipe"]), [s["needle"]["shortest"]]
    while lengths[-1] * 2 <= seq_len:
        lengths.append(lengths[-1] * 2)
    arms = [",".join(str(out / "runs" / m) for m in arm) for arm in finals]
    return Stage("needle", python("eval.py", "needle", *arms, f"--names={','.join(FINAL['detour'])}",
                                  f"--texts={heldout}", f"--lengths={','.join(map(str, lengths))}",
                                  f"--depths={s['needle']['depths']}", f"--n={s['needle']['n']}",
                                  f"--out={out / 'needle.json'}"),
                 [m for arm in finals for m in arm], [heldout])


def trained_length(recipe):
    """The sequence length a train.py recipe trains at, read from train.py itself."""
    from train import RECIPES, Config  # imports torch
    return {**vars(Config()), **RECIPES[recipe]}["seq_len"]


def step_tokens(recipe):
    """Tokens per optimizer step of a train.py recipe (seq_len x batch_size), read from train.py itself."""
    from train import RECIPES, Config  # imports torch: only the biphasic plan needs it
    values = {**vars(Config()), **RECIPES[recipe]}
    return values["seq_len"] * values["batch_size"]


def biphasic_plan(s, out, a):
    """Every stage of the biphasic study. Within a replicate, all trainings share the seeds, the data order and
    the steps."""
    runs, data, per_step = out / "runs", out / "data" / "corpus", step_tokens(s["recipe"])
    assert s["steps"] % 4 == 0 and s["extra_steps"] % 2 == 0, "budgets in whole steps: 25% of B, half of E"
    B, E = s["steps"] * per_step, s["extra_steps"] * per_step
    stages, _ = data_stages(s["tokenizer"], a.corpus, a.corpus, out)
    wsd = ["--schedule=wsd", *([f"--decay_tokens={s['decay_steps'] * per_step}"] if s["decay_steps"] else []),
           *([f"--warmup_tokens={s['warmup_steps'] * per_step}"] if s.get("warmup_steps") else [])]
    mlm, clm = ["--phase=mlm", "--mask_rate=0.4"], ["--phase=clm"]  # the study's MLM masks 40%

    for r in range(1, a.replicates + 1):
        def arm(name, objective, tokens, schedule, parent="", weights_only=False):
            """A training of `tokens` within a WSD schedule over `schedule` tokens: from scratch; from the weights
            of `parent` (a fresh optimizer, data position and schedule); or continuing `parent`'s run, a hand-off
            that carries its Adam moments and t, data position, seeds and schedule."""
            name, parent = replicate(name, r), parent and replicate(parent, r)
            origin = [f"--init_from={runs / parent}", *(["--weights_only"] if weights_only else [])] if parent else []
            origin += [f"--data={data}", *seeds(r)] if weights_only or not parent else []  # a hand-off inherits
            return Stage(name, [*training(s, a.nproc), *objective, *wsd, f"--tokens={tokens}",
                                f"--schedule_tokens={schedule}", *origin, f"--out_dir={runs / name}"],
                         [parent or "data-corpus"], run_dir=str(runs / name), continues=parent)

        # CLM 25% and 50% are the first quarter and half of the CLM-only run (the same seeds, data order and
        # schedule), so CLM is trained once, in hand-offs at 25% and 50% of B that the MLM phases branch from: a
        # hand-off within one schedule is bit-identical to the straight run, and B/4 + B/2 of training are saved.
        # The longest chain comes first: the scheduler starts ready stages in this order.
        stages += [arm("clm25", clm, B // 4, B), arm("clm50", clm, B // 4, B, "clm25"),
                   arm("clm", clm, B // 2, B, "clm50")]
        stages += [arm(f"clm{share}-mlm", mlm, B - B * share // 100, B, f"clm{share}") for share in (25, 50)]
        stages.append(arm("mlm", mlm, B, B))
        # Continued pretraining restarts the optimizer and the schedule (--weights_only): both start models ended
        # their decay, and carrying Adam moments would give MLM-from-MLM moments of its own objective and
        # MLM-from-CLM moments of another. Fresh ones leave the weights as the only difference.
        stages += [arm("cpt-from-mlm", mlm, E, E, "mlm", True), arm("cpt-from-clm", mlm, E, E, "clm", True)]
        stages += [arm("decoder-detour", mlm, E // 2, E, "clm", True),
                   arm("decoder-detour-clm", clm, E - E // 2, E, "decoder-detour"),
                   arm("decoder-clm", clm, E, E, "clm", True)]
    return stages + finetune_stages(s, out, a.tasks, "biphasic", a.replicates)


STUDIES = {"detour": (DETOUR, detour_plan), "biphasic": (BIPHASIC, biphasic_plan)}


# -----------------------------------------------------------------------------
# What a plan costs: an estimate for the dry run.

MFU = 0.3  # the paper's 4 x H100 runs, about 200k tokens/s per GPU, are 27-30% of the bf16 peak by model.py's count


def flag(command, name, default=None):
    """The value of --name=VALUE in a stage's command, or default."""
    return next((str(c).split("=", 1)[1] for c in command if str(c).startswith(f"--{name}=")), default)


def gpu_hours(stages, s, start):
    """Per training stage, an estimate of its H100 GPU-hours: its tokens x model.py's training FLOPs per token (at
    the recipe's sequence length, causal for CLM, the head on masked positions only for MLM) at MFU of the H100's
    bf16 peak. A decay without --tokens runs 10% of the run it continues, as train.py does."""
    import torch
    from data import OBJECTIVES
    from machinery.progress import PEAK_FLOPS
    from model import ModernBERT, ModernBERTConfig
    from train import PHASES, RECIPES, Config
    recipe = {**vars(Config()), **RECIPES[s["recipe"]]}
    local = start is not None and (Path(start) / "config.json").is_file()
    config = (ModernBERTConfig.read(Path(start) / "config.json") if local else
              ModernBERTConfig.from_preset(recipe["preset"]))
    with torch.device("meta"):  # the FLOP count needs the shapes only
        model = ModernBERT(config)
    tokens, hours = {}, {}
    for st in (st for st in stages if st.run_dir):
        phase = PHASES[flag(st.command, "phase")]
        tokens[st.name] = int(flag(st.command, "tokens", 0)) or tokens[st.continues] // 10
        objective = OBJECTIVES[phase["objective"]]
        rate = float(flag(st.command, "mask_rate", phase.get("mask_rate", recipe["mask_rate"])))
        per_token = model.flops_per_token(recipe["seq_len"], objective.causal, rate if objective.masked else 1.0)
        hours[st.name] = tokens[st.name] * per_token / (MFU * PEAK_FLOPS["H100"]) / 3600
    return hours


def costs(a, s, stages, seeds=None):
    """(unit, {stage: hours}, how it was estimated) in the machine's own terms: H100 GPU-hours of the trainings at
    the paper's scale (gpu_hours), CPU hours of every stage at a scale with a committed report that measured them
    (measured_hours), nothing at another. seeds: that many fine-tuning seeds instead of the scale's (a fine-tuning
    stage trains each seed in turn)."""
    if a.scale == "paper":
        from train import RECIPES, Config
        start, preset = a.start or s.get("start"), {**vars(Config()), **RECIPES[s["recipe"]]}["preset"]
        guessed = start not in (None, s.get("start")) and not (Path(start) / "config.json").is_file()
        return "H100 GPU-hours", gpu_hours(stages, s, start), (
            f"an estimate: model FLOPs at {MFU:.0%} of the H100's bf16 peak, the paper's measured rate; fine-tuning "
            f"and CKA not counted" + (f"; the model sized as the recipe's {preset}: --start={start} is a hub id "
                                      f"whose config.json is not here" if guessed else ""))
    source = HERE / "docs" / f"{a.study}-{a.scale}" / "report.json"
    if not source.is_file():
        return None, {}, ""
    hours, wall = measured_hours(stages, source)
    more = seeds / len(str(s["ft"]["seeds"]).split(",")) if seeds else 1  # the seeds a stage trains, against then
    hours = {name: h * (more if name.startswith("finetune-") else 1) for name, h in hours.items()}
    return "CPU hours", hours, (
        f"measured: {source.relative_to(HERE)}, a stage's mean over its replicates there, each stage on one of the "
        f"{MEASURED_CORES} cores of the development machine" + (", the start model on both" if any(
            st.solo for st in stages) else "") + f"; that run took {wall / 3600:.1f} h of wall time with "
        f"--jobs={MEASURED_CORES}; {len(hours)} of {len(stages)} stages measured")


def amount(hours):
    """Hours to three significant digits, in plain figures (1010, not 1.01e+03)."""
    return f"{hours:.0f}" if hours >= 100 else f"{hours:.3g}"


MEASURED_CORES = 2  # the committed reports were made with --jobs=2 on a 2-core machine: a stage had one core


def kind(stage):
    """A stage's name without its replicate: clm-r2 -> clm, finetune-mlm-r3-lr0.0005 -> finetune-mlm-lr0.0005."""
    return re.sub(r"-r\d+(?=-|$)", "", stage)


def measured_hours(stages, source):
    """({stage: CPU hours}, the source's wall seconds): per stage of this plan, the mean time of the stages of its
    kind in a committed report.json, times the cores it had (a solo stage: every one)."""
    times = read_json(source, "a report.json of reproduce.py").get("time") or {}
    seconds = {}
    for name, t in (times.get("stages") or {}).items():
        seconds.setdefault(kind(name), []).append(t)
    return ({st.name: statistics.mean(seconds[kind(st.name)]) * (MEASURED_CORES if st.solo else 1) / 3600
             for st in stages if kind(st.name) in seconds}, times.get("wall", 0))


def start_tokenizer(start):
    """The tokenizer a --start checkpoint was trained with: its tokenizer.json, or its hub id."""
    local = Path(start) / "tokenizer.json"
    return local if local.is_file() else start


# -----------------------------------------------------------------------------
# What a plan can detect: the variance components of a finished report (per task, pooled over the arms of each
# comparison as its intervals pooled them, and over the comparisons), projected onto this plan's replicates, seeds
# and test sets at three readings (machinery/compare.py: `components`, `project`, `needed`).


def test_examples(rep, task):
    """The test examples a task had in a report.json (where its folder is not here), or None."""
    return next((c["tasks"][task]["test_examples"] for c in (rep.get("finetune") or {}).values()
                 if task in c.get("tasks", {}) and "test_examples" in c["tasks"][task]), None)


def detect_list(text):
    """argparse type: differences in points separated by commas, each a finite number above 0."""
    return [positive_float(x) for x in text.split(",")]


def power_plan(a, s, price=lambda **_: ""):
    """Print, per task, the difference this plan would detect with 80% power at the source report's pooled
    components, with its range over their uncertainty, what the reading assumed and the least any design detects
    on the task's test set; with --detect, per difference asked for, what would reach it and what that costs
    (price(replicates=n) or price(seeds=n): words)."""
    from machinery.compare import READINGS, floor, needed, project
    from machinery.tasks import read_task
    source = Path(a.components) if a.components else HERE / "docs" / f"{a.study}-cpu" / "report.json"
    if not source.is_file():
        if a.components or a.detect:
            raise InputError(f"--components={source}: not found (a report.json of a finished reproduce.py run)")
        return print(f"power: no report at {source} to take variance components from (--components names one)")
    try:
        rep, found = read_components(source)
    except InputError as e:
        if a.components or a.detect:
            raise
        return print(f"power: not estimated ({e})")
    R, S = a.replicates, len(str(s["ft"]["seeds"]).split(","))
    measured_at = rep.get("scale")
    print(f"power: this plan, {R} replicate(s) x {S} fine-tuning seed(s), with the variance components of {source} "
          f"(scale {measured_at}, its model and fine-tuning budget)"
          + ("" if measured_at == a.scale else
             f"; BORROWED from the {measured_at} scale: this plan is at the {a.scale} scale, whose model and "
             f"fine-tuning change them, so every figure below assumes the same variance in points there, an "
             f"assumption no run has tested") + ". Each figure at the estimate, then [at the low, high 95% "
          "confidence bound of the runs' variance]:")
    for folder in a.tasks:
        name = Path(folder).name
        total = len(read_task(folder)["test"]) if Path(folder).exists() else test_examples(rep, name)
        if total is None:
            print(f"  {name}: not found, and the source report holds no comparison on it")
            continue
        N = min(total, s["ft"].get("test_subset") or total)
        if name not in found:
            print(f"  {name}: the source report holds no comparison on it")
            continue
        c = found[name]
        at = {reading: project(c, R, S, N, reading)["detectable"] for reading in READINGS}
        print(f"  {name}: {N} test examples: detects {100 * at['point']:.1f} points with 80% power "
              f"[{100 * at['low']:.1f}, {100 * at['high']:.1f}] (the runs' variance on {c['top_df']:g} degrees of "
              f"freedom" + (f", pooled over {c['arms']} differences" if c["arms"] > 1 else "") + "); " +
              floor_line(floor(c, total), total))
        for note in reading_notes(c):
            print(f"    {note}")
        for target in a.detect or ():
            ways = {reading: needed(c, target / 100, R, S, N, total, reading=reading) for reading in READINGS}
            print(f"    to detect {target:g} point{'' if target == 1 else 's'}, one change at a time: " + "; or ".join(
                way(ways, key, total, price) for key in ("replicates", "seeds", "examples")))


def floor_line(least, total):
    """`floor` in words; said as about 0 where it rounds to 0.0 points (the shared part estimated at 0 or near)."""
    if 100 * least < 0.05:
        return (f"the part of the sampling noise on all {total} test examples that every run shares is estimated at "
                f"about 0 (a floor under 0.05 points on what more replicates or seeds can detect)")
    return (f"no number of replicates or seeds detects less than {100 * least:.1f} on all {total} test examples (the "
            f"part of their sampling noise that every run shares)")


def reading_notes(c):
    """What a reading of these components assumed, in words."""
    notes = []
    if c.get("older"):
        notes.append("each difference's own components, averaged (a report written before reports pooled them and "
                     "kept each run's differences); the examples' part is held as it was measured")
    if c["replicate_var"] is not None and c["replicate_var"] < 0:
        notes.append(f"the replicate variance's estimate is below 0 ({1e4 * c['replicate_var']:+.2f} points^2: the "
                     f"replicate means vary less than their seeds predict): read as 0, their spread all seed noise")
    if c["seeds_inside"]:
        notes.append("one fine-tuning seed: seed noise cannot be told from pretraining noise; more seeds are read "
                     "as changing nothing, and at the low bound as if all of it were seed noise")
    return notes


def way(ways, key, total, price):
    """One answer of `needed` at the estimate with what it costs, and its range over the readings."""
    def one(reading):
        n = ways[reading][key]
        return f"{n}" if n is not None else "none up to 200" if key != "examples" else f"not with all {total}"
    point = ways["point"][key]
    what = {"replicates": "replicates", "seeds": "seeds", "examples": "test examples"}[key]
    cost = price(**{key: point}) if point is not None and key != "examples" else ""
    head = (f"{point} {what}{cost}" if point is not None else
            f"no number of {what} up to 200" if key != "examples" else
            f"not with test examples alone (all {total} the task holds give {100 * ways['point']['all_examples']:.1f} "
            f"points)")
    return f"{head} [{one('low')}, {one('high')}]"


# -----------------------------------------------------------------------------
# The report: OUT/report.md, OUT/report.json and OUT/report.png, from the finished stages of this plan alone. The
# numbers are gathered here; eval.py computes the intervals and the choices, machinery/report.py writes them out.


def report(out, study, scale, s, stages, plan, R):
    from eval import kind_of  # imports torch: only the report needs it
    from machinery import report as render
    from eval import cka_summary
    from machinery.compare import compare, compared, family
    from machinery.stages import stage_times
    from machinery.rundir import code_version
    runs = runs_summary(stages)
    rep = dict(study=study, scale=scale, replicates=R, fingerprint=plan["fingerprint"], code=plan["code"],
               git=code_version()["git"],  # the code on disk is the plan's (check_unchanged): its commit, "+edits"
               versions=plan.get("versions") or {}, runs=runs,  # {} in a plan written before versions were kept
               losses={title: losses(runs, models, base, R) for title, models, base in COMPARISONS[study]},
               finetune={}, per_setting=per_setting(out, s, study, R), time=stage_times(out, stages))
    for title, models, base in COMPARISONS[study]:
        if set(models) <= set(FINETUNED[study]):
            rep["finetune"][title] = compare({m: {f"{lr:g}": [ft_path(out, replicate(m, r), lr)
                                                               for r in range(1, R + 1)] for lr in s["lrs"]}
                                              for m in models}, kind_of, base)
    family([d for c in rep["finetune"].values() for d in compared(c)])  # the study's fine-tuning comparisons
    if study == "detour":  # CKA summarised again from every draw's numbers, by this version's code
        cka = {w: read_json(out / f"cka-{w}.json") for w in ("before", "after")}
        rep["cka"] = {w: as_in_out({**{k: v for k, v in r.items() if k != "per_seed"}, **cka_summary(r["per_seed"])},
                                   out) for w, r in cka.items()}
        rep["needle"] = as_in_out(needle_summary(out / "needle.json"), out)
    rep["what"] = what_was_run(rep, study, s, stages)
    spec = dict(title=TITLES[study], names=METHODS[study], final=FINAL[study], finetuned=FINETUNED[study])
    rep["figures"] = [f for f in [render.study_figure(out / "report.png", rep, spec, s["lrs"])] if f]
    write_json(out / "report.json", finite(rep))
    write_text(out / "report.md", render.study_markdown(rep, spec))
    print(f"report: {out / 'report.md'}, {out / 'report.json'}" + "".join(f", {out / f}" for f in rep["figures"]))


def finite(obj):
    """JSON has no inf or NaN (a ratio over a zero control divergence): such a number is written as its text."""
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return str(obj) if isinstance(obj, float) and not math.isfinite(obj) else obj


def as_in_out(obj, out):
    """obj with every path inside out written OUT/..., as the plan shows commands: the report of an experiment is
    the same wherever its folder is."""
    if isinstance(obj, dict):
        return {k: as_in_out(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [as_in_out(v, out) for v in obj]
    inside = isinstance(obj, str) and (obj == str(out) or obj.startswith(f"{out}/"))
    return "OUT" + obj[len(str(out)):] if inside else obj


def needle_summary(path):
    """eval.py needle's result without each example's numbers (the file beside the report keeps them) and without
    its time (the report's time section has every stage's)."""
    r = {k: v for k, v in read_json(path, "eval.py needle's result").items() if k != "seconds"}
    for arm in r["arms"].values():
        for one in arm["replicates"]:
            one["cells"] = {length: {c: {k: v for k, v in cell.items() if not k.endswith("_each")}
                                     for c, cell in row.items()} for length, row in one["cells"].items()}
    return r


def runs_summary(stages):
    """Per training stage: tokens trained, its validation points (every eval) and lr, the chain it continues, and
    what it trained, from the configuration its last checkpoint holds (`how`: e.g. 'mlm 40% masked, wsd')."""
    from data import OBJECTIVES
    from machinery.curves import read_log
    from machinery.rundir import latest_state
    summary = {}
    for s in (s for s in stages if s.run_dir):
        records, c = read_log(Path(s.run_dir) / "log.jsonl"), latest_state(s.run_dir)["config"]
        train, val = [r for r in records if "loss" in r], [r for r in records if "val_mlm" in r]
        rate = f" {c['mask_rate']:.0%} masked" if OBJECTIVES[c["objective"]].masked else ""
        summary[s.name] = dict(
            tokens=max([r["tokens"] for r in train], default=0), continues=s.continues, objective=c["objective"],
            how=f"{c['objective']}{rate}, {c['schedule']}" + (f", frozen: {c['freeze']}" if c["freeze"] else ""),
            seed=c["seed"], data_seed=c["data_seed"], val=[[r["tokens"], r["val_mlm"], r["val_clm"]] for r in val],
            lr=[[r["tokens"], r["lr"]] for r in train])
    return summary


def losses(runs, models, base, R):
    """Per model: its final validation MLM and CLM losses over the replicates, mean and 95% interval; and its
    paired difference to `base` replicate by replicate, with the verdict (lower is better), the difference a t
    test over the replicates would detect with 80% power, and whether the two models trained different objectives
    (`by_construction`: their losses differ whatever the recipe is worth, so no count of what chance gives holds
    them)."""
    from machinery.compare import detectable, t_interval, verdict
    from machinery.report import chain
    out = {}
    for m in models:
        out[m] = {}
        trained = [[runs[n]["objective"] for n in chain(runs, replicate(x, 1))] for x in (m, base)]
        for column, key in ((1, "val_mlm"), (2, "val_clm")):
            final = [runs[replicate(m, r)]["val"][-1][column] for r in range(1, R + 1)]
            ref = [runs[replicate(base, r)]["val"][-1][column] for r in range(1, R + 1)]
            mean, low, high = t_interval(final)
            entry = dict(each=final, mean=mean, low=low, high=high)
            if m != base:
                diffs = [x - y for x, y in zip(final, ref)]
                d, dl, dh = t_interval(diffs)
                se = statistics.stdev(diffs) / math.sqrt(R) if R > 1 else None
                entry["difference"] = dict(mean=d, low=dl, high=dh, verdict=verdict(dl, dh, "higher", "lower"),
                                           detectable=None if se is None else detectable(se * se, 0.0, R - 1),
                                           by_construction=trained[0] != trained[1])
            out[m][key] = entry
    return out


def per_setting(out, s, study, R):
    """Per fine-tuned model, task and lr: the mean dev and test scores over its runs, and the dev baseline (the
    appendix: test scores at settings no model chose are shown, never compared)."""
    from machinery.tasks import load_results
    table = {}
    for m in FINETUNED[study]:
        for lr in s["lrs"]:
            results = [load_results(ft_path(out, replicate(m, r), lr)) for r in range(1, R + 1)]
            for task, t in results[0]["tasks"].items():
                metric = t["primary"]
                runs = [x for res in results for x in res["tasks"][task]["seeds"].values()]
                table.setdefault(m, {}).setdefault(task, {})[f"{lr:g}"] = dict(
                    metric=metric, dev=float(sum(x["dev"][metric] for x in runs) / len(runs)),
                    test=float(sum(x["test"][metric] for x in runs) / len(runs)),
                    dev_baseline=t["baseline"]["dev"][metric], runs=len(runs))
    return table


def model_line(run_dir):
    """The architecture actually trained, from its config.json and its weights' header."""
    config = read_json(Path(run_dir) / "config.json", "a model's config.json")
    with open(Path(run_dir) / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    params = sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return (f"ModernBERT, {config['num_hidden_layers']} blocks x {config['hidden_size']} wide, {params / 1e6:.2f}M "
            f"parameters, vocabulary {config['vocab_size']:,}")


def commit_words(rep):
    """', at commit C' (with ', plus uncommitted edits to them' where the code was not C's): the code the report's
    digest names, where git knew it; '' where it did not, or in a report written before it was recorded."""
    commit, edits = str(rep.get("git") or "").partition("+edits")[:2]
    return f", at commit `{commit[:12]}`" + (" plus uncommitted edits to them" if edits else "") if commit else ""


def what_was_run(rep, study, s, stages):
    """The rows of the report's first table."""
    ft, R = s["ft"], rep["replicates"]
    first = next(st for st in stages if st.name == replicate(FINAL[study][0], 1))
    tasks = next(st.inputs for st in stages if st.name.startswith("finetune-"))
    seeds_ = [ft_seeds(s, r) for r in range(1, R + 1)]
    lrs = (f"lr {s['lrs'][0]:g} (fixed, not chosen)" if len(s["lrs"]) == 1 else
           f"lr {', '.join(f'{lr:g}' for lr in s['lrs'])} (each replicate's chosen on the other replicates' dev)")
    rows = [("study", f"`--study={study}`: {TITLES[study]}"),
            ("scale", f"`{rep['scale']}`: `train.py --recipe={s['recipe']}`"),
            ("model", model_line(first.run_dir)),
            ("replicates", f"{R} pretraining run(s) per arm: replicate r trains with seed {SEED} + r - 1 and data "
                           f"order {DATA_SEED} + r - 1, the same for every arm"),
            ("tokens", budgets(rep, study, s) + "; every run's in the appendix"),
            ("fine-tuning", f"{', '.join(Path(str(t)).name for t in tasks)}; {fine_tuning_budget(ft)}; "
                            f"{ft['max_len']} tokens; {lrs}; {len(seeds_[0].split(','))} seeds per model, "
                            f"replicate and lr, each replicate's own, shared by its arms ({'; '.join(seeds_)})"),
            ("stages", f"{len(stages)}, all finished; plan fingerprint `{rep['fingerprint'][:12]}`"),
            ("code", f"source digest `{rep['code'][:16]}` (every script and machinery module){commit_words(rep)}; "
                     + (", ".join(f"{name} {version}" for name, version in rep["versions"].items())
                        or "package versions not recorded (a plan written before they were)"))]
    if study == "detour":
        k = rep["cka"]["before"].get("controls", {}).get("k", 0)
        rows.insert(5, ("CKA", f"{s['cka']['n']} held-out texts x {len(s['cka']['seeds'].split(','))} draws, "
                               f"{s['cka']['max_len']} tokens; {R} MLM-CLM pairs; band: {k} seed control(s), MLM "
                               f"replicate r against MLM trained on its data order with seed {CONTROL_SEED} more "
                               f"(no two controls share a run)"))
        a = rep["needle"]["args"]
        rows.insert(6, ("needle", f"{a['n']} held-out examples per length x depth, lengths "
                                  f"{', '.join(map(str, a['lengths']))} (up to the trained {a['lengths'][-1]}), depths "
                                  f"{', '.join(f'{d}%' for d in a['depths'])}; every final model of every replicate"))
    return rows


def fine_tuning_budget(ft):
    """What each (task, seed) of fine-tuning trained on and was scored on, in words."""
    steps = (f"{ft['steps']} optimizer steps of {ft.get('batch_size', 16)}"
             + (f" (at most {ft['epochs']} epochs)" if "epochs" in ft else "")
             if "steps" in ft else f"{ft.get('epochs', 'the default')} epoch(s)")
    train = f"{ft['train_subset']} train examples" if "train_subset" in ft else "all train examples"
    dev = f"{ft['dev_subset']} dev examples" if "dev_subset" in ft else "all dev examples"
    carve = f" (a dev set under {ft['dev_min']} takes examples from train)" if ft.get("dev_min") else ""
    test = f"{ft['test_subset']} test examples" if "test_subset" in ft else "every test example"
    scored = f"dev scored {ft['evals']} times" if "evals" in ft else (
        "dev scored 4 times" if "steps" in ft else "dev scored after every epoch")  # eval.py's defaults
    return f"{steps}, {train}; chosen on {dev}{carve}, {scored}; {test}"


def budgets(rep, study, s):
    runs, one = rep["runs"], lambda name: runs[replicate(name, 1)]["tokens"]
    if study == "biphasic":
        return (f"B = {one('mlm'):,} ({s['steps']} steps) for every model from scratch, E = "
                f"{one('cpt-from-mlm'):,} ({s['extra_steps']} steps) more for every continued one")
    start = f"start model {runs['start']['tokens']:,} (general text, one run); " if "start" in runs else ""
    return f"{start}Phase 1 {one('clm'):,} per arm; decay {one('clm-decay'):,}"


# -----------------------------------------------------------------------------
# Command line.


def parse(argv):
    parser = Parser(description=__doc__)
    parser.add_argument("--study", choices=STUDIES, default="detour", help="which comparison (see above)")
    parser.add_argument("--scale", choices=DETOUR, required=True, help="smoke: the pipeline in minutes; cpu: about 2-3 "
                        "h of 2 CPU cores; paper: the papers' budgets on the GPUs present")
    parser.add_argument("--replicates", type=positive_int, default=None, help="pretraining runs per arm, paired "
                        "across arms (default: the scale's, 2 at smoke, 3 at cpu and paper; the detour's CKA band "
                        "needs 3)")
    parser.add_argument("--out", required=True, help="the experiment directory (plan, runs, logs, report); new, "
                        "empty, or made by this same command")
    parser.add_argument("--jobs", type=positive_int, default=None, help="stages run side by side (CPU: one per core; "
                        "default: 1)")
    parser.add_argument("--gpus", type=positive_int, default=None, help="processes per training, through torchrun "
                        "when more than 1 (default: the GPUs present at --scale=paper, else 1)")
    parser.add_argument("--start", default=None, help="detour: the start checkpoint, a model directory or a hub id "
                        "(default: answerdotai/ModernBERT-base at --scale=paper; smoke and cpu pretrain their own)")
    parser.add_argument("--data", default=str(DATA), help="the studies' data: a folder that holds corpus/, heldout/ "
                        "and tasks/ as `python data.py fetch --out=DIR` writes them from their public sources "
                        "(default: data/bio, where `data.py fetch` writes them; a shared/data folder beside the "
                        "repository's own folder is read instead where it exists)")
    parser.add_argument("--corpus", nargs="+", help="the training corpus: .jsonl, .txt or .parquet files (default: "
                        f"DATA/{sources.CORPUS})")
    parser.add_argument("--tasks", nargs="+", help="fine-tuning task folders, train/dev/test .jsonl or .tsv (default: "
                        f"DATA/tasks/{', '.join(sources.TASKS)})")
    parser.add_argument("--dry_run", action="store_true", help="check the inputs and OUT, print every command and "
                        "what the plan can detect; run nothing, write nothing")
    parser.add_argument("--components", default=None, help="--dry_run: the report.json of a finished run whose "
                        "variance components predict what this plan detects (default: the study's cpu report in "
                        "docs/)")
    parser.add_argument("--detect", type=detect_list, default=None, help="--dry_run: true differences in points (x100 "
                        "of a task's metric, e.g. 2.8,2,1,0.3) to detect with 80%% power: says how many replicates, "
                        "seeds or test examples would, and what those replicates or seeds cost")
    a = parser.parse_args(argv)
    data = Path(a.data)
    a.corpus = a.corpus or [str(data / sources.CORPUS)]
    a.tasks = a.tasks or [str(data / "tasks" / task) for task in sources.TASKS]
    a.heldout = data / sources.HELDOUT  # the detour's CKA and needle texts: no model trains on them
    return a


# What one mode reads and the other does not: given to the other, a flag would be ignored without a word.
DRY_RUN_ONLY = {"components": "the report whose variance components the plan is projected with",
                "detect": "the differences the plan should detect"}
RUN_ONLY = {"jobs": "stages run side by side"}


def check_inputs(a):
    """Every input before anything runs: one InputError listing all that is wrong. The files of --data that are not
    there are returned: a dry run goes on without them and says so; a run is refused, saying where they come
    from."""
    other = RUN_ONLY if a.dry_run else DRY_RUN_ONLY  # the flags this mode does not read
    how = "is read by a run alone ({}): --dry_run runs nothing; leave it out" if a.dry_run else \
        "is read by --dry_run alone ({}): add --dry_run to see it, or leave it out of a run"
    given = {flag: getattr(a, flag) for flag in other if getattr(a, flag) is not None}
    problems = [f"--{flag}={','.join(map(str, v)) if isinstance(v, list) else v} {how.format(other[flag])}"
                for flag, v in given.items()]
    data = Path(a.data).resolve()
    missing = [str(p) for p in [*a.corpus, *a.tasks, *([a.heldout] if a.study == "detour" else [])]
               if Path(p).resolve().is_relative_to(data) and not Path(p).exists()]
    for i, c in enumerate(a.corpus):
        p = Path(c)
        if c in missing:
            continue
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
        if len(kinds) != 1 and t not in missing:
            problems.append(f"--tasks {t}: expected a folder with train, dev and test .jsonl (or .tsv) files")
    names = [Path(t).name for t in a.tasks]
    if len(set(names)) < len(names):
        problems.append(f"--tasks: two folders share a name ({', '.join(names)}); results are kept by task name")
    if a.start is not None and a.study != "detour":
        problems.append(f"--start={a.start}: the {a.study} study trains from scratch; --start is for --study=detour")
    elif a.start is not None and Path(a.start).exists():
        lacks = [f for f in ("config.json", "tokenizer.json") if not (Path(a.start) / f).is_file()]
        if lacks:
            problems.append(f"--start={a.start}: not a model directory (no {' or '.join(lacks)})")
    elif a.start is not None and hub_id_problem(a.start):
        problems.append(f"--start={a.start}: not found (expected a model directory or a hub id like org/name: "
                        f"{hub_id_problem(a.start)})")
    if missing and not a.dry_run:
        shown_ = ", ".join(str(Path(p).relative_to(Path(a.data))) for p in missing)
        problems.append(f"--data={a.data}: it lacks {shown_}; {sources.how_to_get(a.data)}; or --data names a "
                        f"folder that holds them (--corpus and --tasks name files of your own)")
    if problems:
        raise InputError("; ".join(problems))
    check_contents(a, missing)
    return missing


def check_contents(a, missing=()):
    """What the stages will read, read now by the code they read it with: every task folder (a task the
    fine-tuning would refuse hours later is refused here) and a local --start (its config, weights and
    tokenizer)."""
    from machinery.tasks import read_task
    from model import ModernBERTConfig
    from machinery.tokenizer import load_tokenizer
    problems = []
    for t in (t for t in a.tasks if t not in missing):
        try:
            read_task(t)
        except InputError as e:
            problems.append(f"--tasks {e}")
    if a.start is not None and Path(a.start).is_dir():
        start = Path(a.start)
        try:
            ModernBERTConfig.read(start / "config.json")
            load_tokenizer(str(start / "tokenizer.json"))
            if not (start / "model.safetensors").is_file():
                raise InputError(f"{start}: no model.safetensors (a model directory holds its weights)")
        except InputError as e:
            problems.append(f"--start {e}")
    if problems:
        raise InputError("; ".join(problems))


def main(argv=None):
    a = parse(argv)
    missing = check_inputs(a)  # the files of --data that are not there: only a dry run goes on without them
    scales, plan_of = STUDIES[a.study]
    s, out = scales[a.scale], Path(a.out).resolve()
    a.nproc, a.jobs = a.gpus or (gpu_count() if a.scale == "paper" else 1) or 1, a.jobs or 1
    if a.gpus and 0 < gpu_count() < a.gpus:  # a dry run too: it checks what the run would meet
        raise InputError(f"--gpus={a.gpus}: this machine has {gpu_count()} GPU(s)")
    a.corpus, a.tasks = [Path(c).resolve() for c in a.corpus], [Path(t).resolve() for t in a.tasks]
    a.heldout = a.heldout.resolve()
    if a.start and Path(a.start).exists():  # stages run from the repository root
        a.start = str(Path(a.start).resolve())
    a.replicates = a.replicates or s["replicates"]
    a.hub = pin_start(a, s)
    if a.dry_run:
        return dry_run(a, s, out, plan_of, missing)
    stages = plan_of(s, out, a)
    plan = fingerprint(stages, out, a.study, a.scale)
    check_out(out, plan)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "plan.json").exists():
            write_json(out / "plan.json", plan)
    except OSError as e:
        raise InputError(f"--out={a.out}: cannot write there ({e.strerror or e})") from None
    print(f"reproduce: study {a.study}, scale {a.scale}, {len(stages)} stages, {a.jobs} at a time, into {out}")
    t0 = time.time()
    run(stages, out, plan, a.jobs, usable_cores())
    check_unchanged(plan)
    report(out, a.study, a.scale, s, stages, plan, a.replicates)
    print(f"all stages finished; this invocation took {time.time() - t0:.0f} s")


def pin_start(a, s):
    """A hub id as the start model (--start, or the scale's) pinned to its revision of now: a.start becomes its
    snapshot folder, named by the commit, which every stage reads. Without it each stage would fetch whatever the id
    held when it started, and the plan's fingerprints, holding the id alone, would reuse finished stages after the
    model changed under it. Fetched here; a dry run takes the revision this machine holds, if any. Returns the id."""
    start = a.start or s.get("start")
    if a.study != "detour" or start is None or Path(start).exists():
        return None
    a.start = hub_snapshot(start, cached_only=a.dry_run) or a.start
    return start


def dry_run(a, s, out, plan_of, missing):
    """Every command with its cost in the machine's own terms, what the plan can detect (and with --detect, what
    would detect that and at what cost), what is missing; run nothing, write nothing. Without the data, OUT is not
    checked against the plan: the stages' fingerprints hash the data's content."""
    stages, finished = plan_of(s, out, a), set()
    if not missing:
        plan = fingerprint(stages, out, a.study, a.scale)
        check_out(out, plan)
        finished = {n for n in plan["stages"] if stage_record(out, n, plan["stages"][n]["fingerprint"]).get("finished")}
    else:  # no plan to check OUT against (its fingerprints read the data), but the run will write there
        check_writable(out)
    unit, hours, how = costs(a, s, stages)
    for st in stages:
        cost = f"   (~{amount(hours[st.name])} {unit})" if st.name in hours else ""
        print(f"{st.name}: {shown(st.command)}{cost}" + ("   (finished in OUT)" if st.name in finished else ""))

    def price(replicates=a.replicates, seeds=None):
        """What this plan with another number of replicates or fine-tuning seeds costs, against what it costs."""
        if a.scale == "paper" and seeds:
            return " (fine-tuning runs: the GPU-hours estimate leaves them out)"
        if not unit:
            return ""
        plan = plan_of(s, out, argparse.Namespace(**{**vars(a), "replicates": replicates}))
        other = sum(costs(a, s, plan, seeds)[1].values())
        more = other - sum(hours.values())
        if abs(more) < 1e-9:
            return f" (this plan's ~{amount(other)} {unit})"
        return f" (~{amount(other)} {unit} in all, {amount(abs(more))} {'more' if more > 0 else 'fewer'})"
    power_plan(a, s, price)
    if unit:
        print(f"{'the trainings' if a.scale == 'paper' else 'the stages'}: ~{amount(sum(hours.values()))} {unit} in "
              f"all ({how})")
    if a.start and not Path(a.start).exists():
        print(f"--start={a.start}: taken as a hub id; the run fetches its revision of then first, which every stage "
              f"reads")
    if missing:
        print(f"missing: {', '.join(missing)}; {sources.how_to_get(a.data)}. The run needs them; this plan is "
              f"shown without them")
        return print(f"{len(stages)} stages; not checked: the {len(missing)} missing input(s) above, and {out} "
                     f"against the plan (its fingerprints read them); nothing was run (--dry_run)")
    print(f"{len(stages)} stages ({len(finished)} finished in {out}); inputs checked; nothing was run (--dry_run)")


def gpu_count():
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


if __name__ == "__main__":
    run_main(main)
