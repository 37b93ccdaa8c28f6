"""The paper's whole comparison in one command: data, a start model, the CLM detour and its MLM twin with
seed controls, the decays, the freeze interventions, layer-wise CKA, fine-tuning, and a report.

    python reproduce.py --scale=smoke --out=out/smoke --jobs=2    # 75 s on 2 idle CPU cores: the pipeline works
    python reproduce.py --scale=cpu --out=out/cpu --jobs=2        # the largest experiment for ~90 min of 2 CPU cores
    python reproduce.py --scale=paper --out=out/paper --dry_run   # SPEC §3 on the GPUs present: print, check, stop

Every stage is an ordinary command of data.py, train.py or eval.py, printed before it runs (its output goes to
OUT/logs/STAGE.log), so this file doubles as the recipe written out. A finished stage is skipped, an
interrupted training resumes (--resume), independent arms run side by side up to --jobs, and the command may
be run again after any interruption: it continues where it stopped.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent / "shared" / "data"  # where the real data lives beside a checkout (never copied in)

# -----------------------------------------------------------------------------
# Scales. Budgets are tokens; `arm` is one Phase-1 run (the detour, its twin, each control, each freeze arm).

SCALES = {
    "smoke": dict(recipe="smoke", tokenizer="bytes", general_bytes=200_000, start_tokens=30_720, arm_tokens=10_240,
                  controls=3, cka_n=32, cka_seeds="42,43,44", cka_max_len=128, ft_seeds="42,43,44,45,46", ft_epochs=1,
                  ft_train=32, ft_eval=16, ft_max_len=64, ft_lr=1e-3),
    "cpu": dict(recipe="cpu", tokenizer=8192, general_bytes=2_000_000, start_tokens=2_000_000, arm_tokens=1_000_000,
                controls=3, cka_n=300, cka_seeds="42,43,44", cka_max_len=256, ft_seeds="42,43,44,45,46", ft_epochs=2,
                ft_train=500, ft_eval=200, ft_max_len=128, ft_lr=5e-4),  # a small model fine-tunes at a larger lr
    "paper": dict(recipe="paper", tokenizer="answerdotai/ModernBERT-base", start="answerdotai/ModernBERT-base",
                  arm_tokens=10_000_000_000, controls=3, cka_n=500, cka_seeds="42,43,44", cka_max_len=512,
                  ft_seeds="42,43,44,45,46",
                  ft_epochs=None, ft_train=None, ft_eval=None, ft_max_len=512, ft_lr=5e-5),
}
CONTROL_SEEDS = (18, 19, 20, 21, 22)  # the twins train with seed 17 (SPEC §3); a control differs only in its seed
TASKS = ("ncbi_disease", "chemprot", "pubmedqa")
# The Phase-1 arms: (name, phase, extra flags). SPEC §3's freeze interventions are arms and decays like the others.
ARMS = [("clm", "clm", []), ("mlm", "mlm", []), ("clm-freeze-low", "clm", ["--freeze=low"]),
        ("clm-freeze-mid", "clm", ["--freeze=mid"])]
# Method names for tables and figures (a run directory's name is not a method's).
METHODS = {"mlm": "MLM", "clm": "CLM detour", "clm-freeze-low": "CLM, low blocks frozen",
           "clm-freeze-mid": "CLM, middle blocks frozen", "clm-decay-freeze-low": "CLM, low blocks frozen in the decay"}
METHODS |= {f"{k}-decay": v for k, v in list(METHODS.items()) if k != "clm-decay-freeze-low"}
FINETUNED = ["mlm-decay", "clm-decay", "clm-freeze-low-decay", "clm-freeze-mid-decay", "clm-decay-freeze-low"]


@dataclass
class Stage:
    name: str
    command: list
    needs: list = field(default_factory=list)
    run_dir: str = ""  # a training stage's run directory: an interrupted one continues with --resume
    threaded: bool = True  # takes --threads (train.py and eval.py do; data.py's commands need one core)
    solo: bool = False  # nothing can run beside it (the start model): it gets every core


def python(script, *args):
    return [sys.executable, str(HERE / script), *map(str, args)]


def trainer(nproc):
    """One process per GPU through torchrun; a plain process on a CPU."""
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                str(HERE / "train.py")]
    return python("train.py")


def plan(scale, out, corpus, start, nproc):
    """Every stage of the comparison, in an order that respects `needs`."""
    s = SCALES[scale]
    runs, data_dir = out / "runs", out / "data"
    stages, prep = [], []
    if start is None:  # no pretrained ModernBERT offline: our own start model learns general text first
        stages.append(Stage("data-general", python("data.py", "docstrings", "--out", out / "general.jsonl",
                                                   "--max_bytes", s["general_bytes"]), threaded=False))
    tokenizer = s["tokenizer"]
    if isinstance(tokenizer, int):  # a small vocabulary, so that a small model is not mostly embedding
        stages.append(Stage("tokenizer", python("data.py", "tokenizer", "--input", out / "general.jsonl", *corpus,
                                                "--vocab_size", tokenizer, "--out", out / "tokenizer.json"),
                            ["data-general"], threaded=False))
        tokenizer, prep = out / "tokenizer.json", ["tokenizer"]
    stages.append(Stage("data-bio", python("data.py", "prepare", "--input", *corpus, "--tokenizer", tokenizer,
                                           "--out", data_dir / "bio", "--val_fraction", 0.02), prep, threaded=False))
    train = [*trainer(nproc), f"--recipe={s['recipe']}"]
    if start is None:  # pretrain the start model on general text, with MLM
        stages.append(Stage("data-general-prepare", python("data.py", "prepare", "--input", out / "general.jsonl",
                                                           "--tokenizer", tokenizer, "--out", data_dir / "general",
                                                           "--val_fraction", 0.02), ["data-general", *prep],
                            threaded=False))
        stages.append(Stage("start", [*train, "--phase=mlm", f"--data={data_dir / 'general'}",
                                      f"--tokens={s['start_tokens']}", f"--out_dir={runs / 'start'}"],
                            ["data-general-prepare"], str(runs / "start"), solo=True))
        start, start_stage = runs / "start", ["start"]
    else:
        start_stage = []
    arm = [*train, f"--init_from={start}", "--weights_only", f"--data={data_dir / 'bio'}",
           f"--tokens={s['arm_tokens']}"]
    arms = [(name, phase, flags) for name, phase, flags in ARMS]
    arms += [(f"mlm-seed{seed}", "mlm", [f"--seed={seed}"]) for seed in CONTROL_SEEDS[:s["controls"]]]
    for name, phase, flags in arms:
        stages.append(Stage(name, [*arm, f"--phase={phase}", *flags, f"--out_dir={runs / name}"],
                            ["data-bio", *start_stage], str(runs / name)))
    decays = [(f"{name}-decay", name, []) for name, _, _ in arms] + [("clm-decay-freeze-low", "clm", ["--freeze=low"])]
    for name, parent, flags in decays:
        stages.append(Stage(name, [*train, "--phase=decay", f"--init_from={runs / parent}", *flags,
                                   f"--out_dir={runs / name}"], [parent], str(runs / name)))

    heldout = SHARED / "heldout" / "pubmedqa_abstracts.jsonl"
    controls = [f"mlm-seed{seed}" for seed in CONTROL_SEEDS[:s["controls"]]]
    for when, suffix in (("before", ""), ("after", "-decay")):
        pair = [f"mlm{suffix}", f"clm{suffix}", *(c + suffix for c in controls)]
        stages.append(Stage(f"cka-{when}", python(
            "eval.py", "cka", runs / pair[0], runs / pair[1], *(f"--control={runs / c}" for c in pair[2:]),
            f"--texts={heldout}", f"--n={s['cka_n']}", f"--seeds={s['cka_seeds']}", f"--max_len={s['cka_max_len']}",
            "--names=MLM,CLM", f"--out={out / f'cka-{when}.json'}"), pair))
    subsets = [f"--{k}={s[f'ft_{k}']}" for k in ("epochs",) if s["ft_epochs"]] + \
        ([f"--train_subset={s['ft_train']}", f"--eval_subset={s['ft_eval']}"] if s["ft_train"] else [])
    for name in FINETUNED:
        stages.append(Stage(f"finetune-{name}", python(
            "eval.py", "finetune", runs / name, *(f"--task={SHARED / 'tasks' / t}" for t in TASKS),
            f"--seeds={s['ft_seeds']}", f"--max_len={s['ft_max_len']}", f"--lr={s['ft_lr']}", *subsets,
            f"--out={out / 'finetune' / f'{name}.json'}"), [name]))
    return stages


# -----------------------------------------------------------------------------
# Running: a finished stage leaves OUT/stages/NAME.json; up to --jobs stages run at once.


def shown(command):
    """The command as a reader would type it: `python train.py ...` from the repository root."""
    return shlex.join(str(c).replace(str(HERE) + os.sep, "") for c in command).replace(sys.executable, "python", 1)


def launch(stage, out, threads):
    command, verb = stage.command, "run"
    if stage.run_dir and any(Path(stage.run_dir + suffix, "state.json").exists() for suffix in ("", ".tmp", ".old")):
        trainer_end = command.index(str(HERE / "train.py")) + 1  # an interrupted training continues exactly
        command, verb = [*command[:trainer_end], "--resume", f"--out_dir={stage.run_dir}"], "resume"
    if stage.threaded:
        command = [*command, f"--threads={threads}"]
    print(f"[{verb}]{' ' * (7 - len(verb))}{stage.name}: {shown(command)}", flush=True)
    log = open(out / "logs" / f"{stage.name}.log", "a")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=HERE, env=env), log


def run(stages, out, jobs, cores):
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "stages").mkdir(exist_ok=True)
    done = {s.name for s in stages if (out / "stages" / f"{s.name}.json").exists()}
    for s in stages:
        if s.name in done:
            print(f"[skip]   {s.name}: finished", flush=True)
    running, failed = {}, []
    while len(done) < len(stages) and not failed:
        ready = [s for s in stages if s.name not in done and s.name not in running and all(n in done for n in s.needs)]
        for stage in ready[:max(0, jobs - len(running))]:
            # fixed per stage, so that a rerun computes the same numbers (results depend on the thread count)
            threads = cores if stage.solo else max(1, cores // jobs)
            running[stage.name] = (stage, *launch(stage, out, threads), time.time())
        time.sleep(0.05)
        for name, (stage, proc, log, t0) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            if proc.returncode:
                failed.append(name)
                tail = (out / "logs" / f"{name}.log").read_text().splitlines()[-15:]
                print(f"[failed] {name} (exit {proc.returncode}); the end of {out / 'logs' / (name + '.log')}:\n  "
                      + "\n  ".join(tail), flush=True)
                continue
            seconds = time.time() - t0
            (out / "stages" / f"{name}.json").write_text(json.dumps({"seconds": seconds, "command": stage.command}))
            done.add(name)
            print(f"[done]   {name} ({seconds:.1f} s)", flush=True)
    for stage, proc, log, _ in running.values():  # a failure stops the others' successors, not the others
        proc.wait()
        log.close()
    if failed:
        print(f"error: stage(s) {', '.join(failed)} failed; fix the cause and run the same command again",
              file=sys.stderr)
        raise SystemExit(1)


# -----------------------------------------------------------------------------
# The report: OUT/report.json and OUT/report.md, and figures with method names.


def read_log(run_dir):
    path = Path(run_dir) / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def mean_std(values):
    n = len(values)
    mean = sum(values) / n
    return mean, (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else 0.0


def finetune_tables(out):
    """Per task and model: mean ± std of the primary test metric over seeds; and the paired difference CLM - MLM
    (decayed models, seed by seed: the same seed is the same classifier init and data order)."""
    from eval import paired_difference  # imports torch: only the report needs it
    table = {}
    for path in sorted((out / "finetune").glob("*.json")):
        for task, r in json.loads(path.read_text())["tasks"].items():
            scores = {seed: run["test"][r["primary"]] for seed, run in r["seeds"].items()}
            mean, std = mean_std(list(scores.values()))
            table.setdefault(task, {"metric": r["primary"]})[path.stem] = dict(mean=mean, std=std, seeds=scores)
    paired = {}
    if (out / "finetune" / "mlm-decay.json").exists() and (out / "finetune" / "clm-decay.json").exists():
        paired = paired_difference(out / "finetune" / "mlm-decay.json", out / "finetune" / "clm-decay.json")
    return table, paired


def cka_table(path):
    """Per layer: the twins' divergence, the seed controls' mean, std and range, the ratio, outside the band."""
    r = json.loads(Path(path).read_text())
    c = r["controls"]
    return [dict(layer=layer, divergence=r["divergence"][i], control_mean=r["control_divergence"][i],
                 control_std=c["std"][i], control_min=c["min"][i], control_max=c["max"][i], ratio=r["ratio"][i],
                 outside_band=r["outside_band"][i]) for i, layer in enumerate(r["layers"])]


def figures(out, report):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: the report has tables and no figures (pip install matplotlib)")
        return []
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for when, style in (("before", "-o"), ("after", "--s")):
        rows = report["cka"].get(when)
        if not rows:
            continue
        layers = [r["layer"] for r in rows]
        axes[0].plot(layers, [r["ratio"] for r in rows], style, label=f"CLM vs MLM, {when} the decay")
        axes[0].fill_between(layers, [r["control_min"] / r["control_mean"] for r in rows],
                             [r["control_max"] / r["control_mean"] for r in rows], alpha=0.15)
        axes[1].plot(layers, [r["divergence"] for r in rows], style, label=f"CLM vs MLM, {when}")
        axes[1].errorbar(layers, [r["control_mean"] for r in rows], yerr=[r["control_std"] for r in rows], fmt=style,
                         alpha=0.6, capsize=3, label=f"MLM seed controls, {when}")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(xlabel="layer", ylabel="divergence / seed-control divergence", yscale="log",
                title="Divergence ratio (band: seed controls)")
    axes[1].set(xlabel="layer", ylabel="1 - linear CKA", yscale="log", title="Divergence from the MLM twin")
    for name, curve in report["curves"].items():
        axes[2].plot([p[0] for p in curve], [p[1] for p in curve], label=METHODS.get(name, name))
    axes[2].set(xlabel="Phase-1 tokens", ylabel="validation MLM loss (15% masked)",
                title="Phase 1: MLM quality along the way")
    for ax in axes:
        ax.legend(fontsize=7)
    for ax in axes[:2]:
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    path = out / "report.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return [path.name]


def report(out, scale, stages):
    arms = [s.name for s in stages if s.run_dir]
    losses = {}
    for name in arms:
        vals = [r for r in read_log(out / "runs" / name) if "val_mlm" in r]
        if vals:
            losses[name] = dict(val_mlm=vals[-1]["val_mlm"], val_clm=vals[-1]["val_clm"], step=vals[-1]["step"])
    curves = {name: [(r["tokens"], r["val_mlm"]) for r in read_log(out / "runs" / name) if "val_mlm" in r]
              for name, _, _ in ARMS}
    table, paired = finetune_tables(out)
    rep = dict(scale=scale, cka={w: cka_table(out / f"cka-{w}.json") for w in ("before", "after")
                                 if (out / f"cka-{w}.json").exists()},
               finetune=table, paired_clm_minus_mlm=paired, validation=losses, curves=curves,
               seconds={s.name: json.loads((out / "stages" / f"{s.name}.json").read_text())["seconds"] for s in stages
                        if (out / "stages" / f"{s.name}.json").exists()})
    rep["figures"] = figures(out, rep)
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    (out / "report.md").write_text(markdown(rep))
    print(f"report: {out / 'report.md'}, {out / 'report.json'}" + "".join(f", {out / f}" for f in rep["figures"]))


def markdown(rep):
    lines = [f"# The CLM detour against MLM, scale `{rep['scale']}`", ""]
    for when, rows in rep["cka"].items():
        lines += [f"## Layer-wise CKA {when} the decay", "",
                  "| layer | CLM vs MLM divergence | seed controls mean ± std "
                  "| ratio | outside the band |", "|---|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['divergence']:.3e} | {r['control_mean']:.3e} ± {r['control_std']:.1e} | "
                  f"{r['ratio']:.2f} | {'yes' if r['outside_band'] else 'no'} |" for r in rows] + [""]
    lines += ["## Fine-tuning (test, mean ± std over seeds, x100)", ""]
    models = [m for m in FINETUNED if any(m in row for row in rep["finetune"].values())]
    lines += ["| task | metric | " + " | ".join(METHODS[m] for m in models) + " |",
              "|---|---|" + "---|" * len(models)]
    for task, row in rep["finetune"].items():
        cells = [f"{100 * row[m]['mean']:.2f} ± {100 * row[m]['std']:.2f}" if m in row else "-" for m in models]
        lines.append(f"| {task} | {row['metric']} | " + " | ".join(cells) + " |")
    lines += ["", "Paired difference CLM - MLM (same fine-tuning seeds): "
              + "; ".join(f"{t} {100 * p['mean']:+.2f} ± {100 * p['std']:.2f} (CLM ahead on "
                          f"{sum(d > 0 for d in p['difference'])} of {len(p['seeds'])} seeds)"
                          for t, p in rep["paired_clm_minus_mlm"].items()), ""]
    lines += ["## Validation losses at the end of each run", "", "| run | MLM (15%) | CLM |", "|---|---|---|"]
    lines += [f"| {n} | {v['val_mlm']:.4f} | {v['val_clm']:.4f} |" for n, v in rep["validation"].items()] + [""]
    lines += ["## Wall time per stage", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {n} | {s:.1f} |" for n, s in rep["seconds"].items()]
    lines += [f"| total | {sum(rep['seconds'].values()):.1f} |", ""]
    lines += [f"![figures]({f})" for f in rep["figures"]]
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------
# Command line.


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--scale", choices=SCALES, required=True)
    parser.add_argument("--out", required=True, help="the experiment directory (runs, logs, report)")
    parser.add_argument("--jobs", type=int, default=1, help="stages run side by side (CPU: one per core)")
    parser.add_argument("--start", default=None, help="start checkpoint (paper: answerdotai/ModernBERT-base)")
    parser.add_argument("--corpus", nargs="+", default=[str(SHARED / "corpus" / "e3c_en_clinical_cases.jsonl")],
                        help="the domain corpus (.jsonl/.txt/.parquet)")
    parser.add_argument("--gpus", type=int, default=None, help="processes per training (default: the GPUs present)")
    parser.add_argument("--dry_run", action="store_true",
                        help="print every command and check the inputs; train nothing")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    problems = [f"--corpus {c}: not found" for c in args.corpus if not Path(c).is_file()]
    needed = [SHARED / "heldout" / "pubmedqa_abstracts.jsonl", *(SHARED / "tasks" / t for t in TASKS)]
    problems += [f"{p}: not found (held-out texts and tasks live in ../shared/data)" for p in needed if not p.exists()]
    if args.jobs < 1:
        problems.append(f"--jobs={args.jobs}: expected >= 1")
    if out.is_file():
        problems.append(f"--out={args.out}: a file, expected a directory")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        raise SystemExit(2)
    nproc = args.gpus if args.gpus is not None else gpu_count() if args.scale == "paper" else 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    start = args.start or SCALES[args.scale].get("start")
    stages = plan(args.scale, out, args.corpus, start, max(1, nproc))
    if args.dry_run:
        for s in stages:
            print(f"{s.name}: {shown(s.command)}")
        print(f"{len(stages)} stages; inputs checked; nothing was run (--dry_run)")
        return
    print(f"reproduce: scale {args.scale}, {len(stages)} stages, {args.jobs} at a time, into {out}")
    t0 = time.time()
    run(stages, out, args.jobs, cores)
    report(out, args.scale, stages)
    print(f"all stages finished; this invocation took {time.time() - t0:.0f} s")


def gpu_count():
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


if __name__ == "__main__":
    main()
