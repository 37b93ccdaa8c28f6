"""What a training run prints and logs: where it starts and its plan, a record and a line per step (with
MFU against a per-GPU peak), the summary at the end with the commands that go on from the run, and the model
card. A reader of the recipe may skip this file."""
import dataclasses
import json
import os
import shlex
import signal
import sys
from dataclasses import dataclass, field

import torch

from machinery import cli, flags, kernels, tracking
from machinery.cli import InputError, autocast, changed_versions, launcher
from machinery.curves import run_dir_of, saved_config
from machinery.hf import RELOAD_TOLERANCE, check_saved, hub_id_problem
from machinery.rundir import ROOT, RunDir, code_version, continuation_dir, latest_state

# Dense bf16 FLOP/s per GPU, for MFU (NVIDIA's datasheets, half their "with sparsity" figures), looked up by a
# part of the device name, the first that matches: the PCIe and NVL boards before the SXM parts whose names they
# contain ("NVIDIA H100 80GB HBM3" and "NVIDIA H200" are SXM).
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H100": 989e12, "H200": 989e12,
              "A100": 312e12}


def peak_of(name):
    """The peak of a device named `name` (torch.cuda.get_device_name), or None for a GPU the table lacks."""
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def peak_flops(device):
    """The GPU's dense bf16 peak from PEAK_FLOPS, or None (a CPU, an unknown GPU: no MFU)."""
    return peak_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


# What each field of train.py's Carries (a row of STARTS) is called in a run's first line.
CARRIED = dict(weights="weights", moments="Adam's moments", adam_t="Adam's t", data_position="data position",
               rng="RNG streams", history="the runs before it", phase="the phase's step and tokens")


# What each of model.py's LOSSES is called in a run's first lines.
LOSS_WORDS = {"plain": "model.py's cross_entropy (--loss=fused computes it in row chunks: less memory)",
              "fused": "fused (model.py's cross_entropy in row chunks, machinery/kernels.py)"}


@dataclass
class Run:
    """Everything train.py's loop reads and changes, built once by its setup()."""
    cfg: object  # train.py's Config
    how: str  # a row of STARTS: fresh | weights | handoff | resume
    model: object  # model.py's ModernBERT
    ddp_model: torch.nn.Module  # the model itself on one process
    optimizer: object  # train.py's AdamW
    loader: object  # data.py's Loader
    objective: object  # data.py's OBJECTIVES entry: whether it attends causally, whether mask_rate applies
    frozen: set  # parameter names the optimizer skips
    meta: dict  # the data's meta.json
    tokenizer: object
    run_dir: RunDir  # None on ranks other than 0: rank 0 writes
    tracker: object  # machinery/tracking.py's Trackers: --log_to: rank 0's, none on the others
    device: torch.device
    rank: int
    world: int
    accum: int  # micro-batches per optimizer step on each process
    phase_step: int  # optimizer steps of this phase (Adam's t counts every phase: optimizer.t)
    phase_tokens: int  # tokens of this phase
    schedule_start: int  # tokens of the schedule run before this phase
    history: list  # the runs this one continues: [{phase, tokens, dir}]
    code: dict  # the code version, saved with every checkpoint
    earlier_code: list  # [{until_step, code}]: the code of this phase's steps before a resume under other code
    wrote: dict = field(default_factory=dict)  # side jobs of the last save: {"loss.png": drawn, "README.md": written}
    reloaded: dict = None  # what hf.check_saved found at this invocation's first save (None: not yet checked)


def start(how, carries, cfg, phase_step, source, state, schedule_from, learning_rate):
    """The line that says how the run starts and what it carries over (`carries`: its row of train.STARTS); for a
    resume with a new budget, or a hand-off, a line on what happens to the schedule."""
    where = {"resume": f"resume {cfg.out_dir} at phase step {phase_step}", "handoff": f"phase hand-off from {source}",
             "weights": f"weights from {source}", "fresh": f"a fresh {cfg.preset} model (seed {cfg.seed})"}[how]
    kept = [words for name, words in CARRIED.items() if getattr(carries, name)]
    fresh = [words for name, words in CARRIED.items() if not getattr(carries, name)]
    print(f"{where}; carries over: {', '.join(kept) or 'nothing'}"
          + (f"; fresh: {', '.join(fresh)}" if kept and fresh else ""))
    saved = state["config"] if state else {}
    if how == "resume" and not carries.rng and not saved.get("micro_batch_size"):  # on another number of processes
        print(f"note: --micro_batch_size=0 gives each of the {len(state['rng'])} processes before a micro-batch of "
              f"another size than now: a step's gradient, the mean of its micro-batches' mean losses, weighs the "
              f"masked tokens otherwise (the same sequences, close to the run it was, not bit for bit)")
    now = code_version() if how == "resume" else {}  # resume promises bit for bit: with this code and packages
    if now and state["code"].get("sha256") != now["sha256"]:
        print(f"warning: the code changed since {cfg.out_dir}'s checkpoint was written (a script or a module of "
              f"machinery/): the resumed run goes on with this code, not bit for bit with the run it was (its "
              f"state.json keeps the code of the steps before: earlier_code)", file=sys.stderr)
    changed = changed_versions(state["code"].get("versions"), now["versions"]) if now else ""
    if changed:
        print(f"warning: packages changed since {cfg.out_dir}'s checkpoint was written ({changed}): the resumed "
              f"run goes on with these, not bit for bit with the run it was (its state.json keeps those of the steps "
              f"before: earlier_code)", file=sys.stderr)
    then = state["code"].get("sha256") if how == "handoff" else None  # the code of the steps a hand-off continues
    here = code_version()["sha256"] if then else None
    if then and then != here:  # an edit between the phases: often the ablation itself
        print(f"note: {cfg.init_from} was written by other code (a script or a module of machinery/ changed since: "
              f"code {then} then, {here} now): the phases of this model ran different code, "
              f"each run's state.json keeps its own")
    if how == "resume" and saved["tokens"] != cfg.tokens:
        print(f"its budget goes from {saved['tokens']:,} to {cfg.tokens:,} tokens; the {phase_step} steps run keep "
              f"their learning rates")
    if how == "handoff" and schedule_from:
        print(f"the {cfg.schedule} schedule goes on from token {schedule_from:,} of {cfg.schedule_tokens:,}: "
              f"no second warmup")
    elif how == "handoff" and cfg.warmup_tokens:
        parent = dataclasses.replace(cfg, **saved)
        peak = parent.phase == cfg.phase and at_its_peak(parent, state["schedule_tokens_done"], cfg.tokens,
                                                         learning_rate)
        kept = (f". To go on with {cfg.init_from}'s schedule instead (its peak rate from the first step), pass "
                f"--warmup_tokens=0" if peak else "")
        print(f"the schedule starts again: the learning rate warms up from 0 over {cfg.warmup_tokens:,} tokens (a "
              f"hand-off continues its parent's schedule only where both give the same --schedule and "
              f"--schedule_tokens; {cfg.init_from} ran {saved['schedule']} over "
              f"{saved['schedule_tokens'] or 'its own --tokens'}){kept}")


def architecture(config, source, unlike):
    """The shape and attention settings the run trains (model.py's config), whether they are kept from a checkpoint
    (`source`), and a warning where this code would build a fresh model otherwise (`unlike`: {field: (kept,
    fresh)}), which a continued run does not apply."""
    c = config
    globals_ = [i for i, kind in enumerate(c.layer_types) if kind == "full_attention"]
    print(f"architecture: {c.num_hidden_layers} blocks {c.hidden_size} wide, {c.num_attention_heads} heads, GLU MLP "
          f"{c.intermediate_size} wide with {c.hidden_activation}; global attention in block(s) "
          f"{', '.join(map(str, globals_))} (global_attn_every_n_layers={c.global_attn_every_n_layers}), local "
          f"elsewhere: a window of {c.local_attention} tokens ({c.window} each side); RoPE theta "
          f"{c.global_rope_theta:,g} global, {c.local_rope_theta:,g} local; attention dropout {c.attention_dropout}"
          + (f"; kept from {source}, as its weights are" if source else ""))
    if unlike:
        kept = ", ".join(f"{key}={old!r}" for key, (old, _) in unlike.items())
        new = ", ".join(f"{key}={value!r}" for key, (_, value) in unlike.items())
        print(f"warning: this code builds a fresh model with {new}; this run keeps {kept} from {source} (a run that "
              f"continues a checkpoint keeps its architecture): to train yours, start from scratch", file=sys.stderr)


def absent(how, settings, given, inherited, removed=None):
    """One line per setting the checkpoint a run continues lacks ({name: default}) and the run takes from it, at its
    default: any a resume does, those a hand-off inherits (`inherited`), none that a flag gives (`given`); and one
    per setting a hand-off's parent was saved with that this code no longer has (`removed`: {name: value})."""
    where = {"resume": "this run", "handoff": "the run it continues"}.get(how)
    for name, value in settings.items():
        if where and name not in given and (how == "resume" or name in inherited):
            print(f"{name}: not in {where} (its checkpoint was written before the setting existed), its default "
                  f"{value!r}")
    for name, value in (removed or {}).items() if how == "handoff" else ():
        print(f"{name}={value!r}: a setting of {where} that train.py's Config no longer has (removed since its "
              f"checkpoint was written): this run goes on without it")


def at_its_peak(cfg, done, more, learning_rate):
    """Whether the run of `cfg`, `done` tokens into its schedule, would train `more` tokens at its peak rate if
    its budget grew by that much, every step it ran keeping its rate (a constant schedule past its warmup). Then a
    hand-off to its phase with --warmup_tokens=0 takes the same steps as `--resume --tokens` would (bar the
    dropout streams), into a run directory of its own."""
    per_step = cfg.batch_size * cfg.seq_len
    longer = dataclasses.replace(cfg, tokens=cfg.tokens + more)
    return flags.first_changed_rate(cfg, longer, done, per_step, learning_rate) is None and \
        all(learning_rate(longer, t) == cfg.lr for t in range(done, done + more, per_step))


MEMORISED = 4  # epochs of its data past which a run warns that it will memorise them; the longer: hint stops there


def plan(r, total_steps):
    """The resolved configuration, versions, device, model, objective, schedule and batch arithmetic."""
    cfg = r.cfg
    per_step = cfg.batch_size * cfg.seq_len
    epochs = total_steps * cfg.batch_size / r.loader.n_windows
    # a hand-off goes on from its parent's data position: the epochs read before this phase count too
    seen = (r.loader.sequence - r.phase_step * cfg.batch_size) / r.loader.n_windows
    gpu = f" ({torch.cuda.get_device_name(r.device)})" if r.device.type == "cuda" else ""
    print(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, device {r.device}{gpu}, {r.world} "
          f"process(es), {torch.get_num_threads()} CPU thread(s) each (--threads)")
    with autocast(r.device, cfg.dtype):  # the backend the steps will run: auto's pick depends on the dtype
        backend = kernels.backend_for(r.model, r.device)
    compiled = f"compiled by {r.model.compiled_with}" if r.model.compiled_with else "eager"
    kernel = kernels.BACKENDS[backend].library()
    print(f"model: {r.model.num_params():,} parameters, attention: {backend}" + (f" ({kernel})" if kernel else "")
          + f", blocks {compiled}, loss: {LOSS_WORDS[r.model.loss]}")
    caveat = kernels.resume_caveat(backend, r.device, kernels.compiler_is_deterministic())
    if caveat:  # what --resume can promise on this machine
        print(f"warning: a --resume of this run continues within rounding, not bit for bit: {caveat}",
              file=sys.stderr)
    objective = (f"{cfg.objective.upper()}" + (f" at {cfg.mask_rate:.0%}" if r.objective.masked else "") +
                 (", causal mask" if r.objective.causal else ", bidirectional"))
    print(f"recipe {cfg.recipe}, phase {cfg.phase}: {objective}; schedule {cfg.schedule} over "
          f"{cfg.schedule_tokens or cfg.tokens:,} tokens, this phase from token {r.schedule_start:,} of it; "
          f"frozen blocks: {cfg.freeze or 'none'}")
    print(f"batch: {cfg.batch_size} sequences = {cfg.batch_size // r.accum // r.world} micro x {r.accum} "
          f"accumulation x {r.world} process(es); {per_step:,} tokens/step; {total_steps:,} steps = "
          f"{total_steps * per_step:,} tokens, {epochs:.2f} epochs of {cfg.data}"
          + (f", from epoch {seen:.2f} (where the run it continues stopped)" if seen else ""))
    for line in tracking.where(cfg.log_to, cfg.out_dir):
        print(f"tracked: {line}")
    if seen + epochs > MEMORISED:
        print(f"warning: the budget is {epochs:,.1f} epochs of {cfg.data}" + (f", {seen + epochs:,.1f} with the runs "
              f"before it" if seen else "") + ": the model will memorise it; lower --tokens or prepare more data")


def record(r, loss, lr, grad_norm, seconds, flops, peak):
    """The log record of the step just taken; `flops` per token, `peak` per GPU (None: no MFU)."""
    per_step = r.cfg.batch_size * r.cfg.seq_len
    mfu = round(flops * per_step / seconds / r.world / peak, 4) if peak else None
    return dict(phase=r.cfg.phase, step=r.phase_step, tokens=r.phase_tokens, loss=round(loss, 5), lr=lr,
                grad_norm=round(grad_norm, 4), ms=round(seconds * 1000, 1), tokens_per_s=round(per_step / seconds),
                mfu=mfu)


def step_line(cfg, record, total_steps, eta):
    val = f" | val mlm {record['val_mlm']:.4f} clm {record['val_clm']:.4f}" if "val_mlm" in record else ""
    mfu = f" | MFU {record['mfu']:.1%}" if record["mfu"] is not None else ""
    print(f"{cfg.phase} step {record['step']}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
          f"grad {record['grad_norm']:.3f} | {record['ms']:.0f} ms | {record['tokens_per_s']:,} tok/s{mfu}{val} | "
          f"eta {duration(eta)}")


def start_line(r, record):
    """The validation losses before the first step of a continued run: where its curve starts (rank 0 prints)."""
    if r.rank == 0:
        print(f"{record['phase']} step 0 (before the first step) | val mlm {record['val_mlm']:.4f} clm "
              f"{record['val_clm']:.4f}")


def duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def validations(log_path):
    """The validation records of a log.jsonl ({"step": ..., "val_mlm": ..., "val_clm": ...}) in order."""
    found = []
    if os.path.isfile(log_path):
        with open(log_path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by a kill
                    continue
                if isinstance(record, dict) and "val_mlm" in record:
                    found.append(record)
    return found


def command(*flags_):
    """A train.py command line that runs as printed: this process's launcher, the script, the flags quoted."""
    return " ".join(shlex.quote(word) for word in [*launcher(os.path.join(ROOT, "train.py")), *flags_])


def continuations(r, total_steps, learning_rate):
    """The commands that go on from this run, as (label, command, what it does): --resume until the budget is
    run; then the rest of a schedule that spans phases, or a longer run and the short decay where the schedule
    allows them. Once the budget is run, a hint never changes this run (other runs may start from it): a longer
    run is a hand-off into a run directory of its own, and a hand-off names its --out_dir where the default one
    is taken."""
    cfg, out = r.cfg, r.cfg.out_dir
    per_step = cfg.batch_size * cfg.seq_len
    if r.phase_step < total_steps:
        return [("continue", command("--resume", f"--out_dir={out}"), "to the end of its budget")]
    rest = cfg.schedule_tokens - r.schedule_start - r.phase_tokens if cfg.schedule_tokens else 0
    if rest >= per_step:  # a hand-off continues the schedule (MLM after CLM, as the biphasic study)
        mlm = [f"--mask_rate={cfg.mask_rate}"] if r.objective.masked else []
        return [("next", handoff(out, "mlm", *mlm, f"--schedule={cfg.schedule}",
                                 f"--schedule_tokens={cfg.schedule_tokens}", f"--tokens={rest}"),
                 "the rest of its schedule")]
    if cfg.phase == "decay":  # the end of the recipe
        return []
    hints = []
    # as many tokens again, or as many as keep its data read at most MEMORISED times (the warning a run gives)
    room = (MEMORISED * r.loader.n_windows - r.loader.sequence) // cfg.batch_size * per_step
    longer = min(cfg.tokens, room)
    if not cfg.schedule_tokens and longer >= per_step and at_its_peak(cfg, r.schedule_start + r.phase_tokens, longer,
                                                                       learning_rate):
        same = same_objective(cfg, r.objective.masked)
        hints.append(("longer", handoff(out, cfg.phase, *same, f"--tokens={longer}", "--warmup_tokens=0",
                                        name="longer"),
                      ("as many tokens again" if longer == cfg.tokens else
                       f"{longer:,} tokens more, up to {MEMORISED} epochs of {cfg.data}")
                      + f", its schedule kept, into a run of its own: {out} stays as it is"))
    phase_tokens = r.phase_tokens + sum(h["tokens"] for h in same_phase_before(r.history, cfg.phase))
    if cfg.schedule == "constant" and phase_tokens // 10 >= per_step:  # a decay's default is 10% of its parent's
        more = [f"--tokens={phase_tokens // 10}"] if phase_tokens > r.phase_tokens else []
        hints.append(("next", handoff(out, "decay", *more), "the short MLM decay, 10% of its tokens" +
                      (f" and of the {cfg.phase} runs it continues" if more else "")))
    return hints


def same_phase_before(history, phase):
    """The runs of `phase` that the run continues directly (a longer run's chain: mlm, mlm-longer, ...)."""
    before = []
    for entry in reversed(history):
        if entry["phase"] != phase:
            break
        before.append(entry)
    return before


def same_objective(cfg, masked):
    """The flags that give a hand-off the objective of the run it continues, where its phase's preset does not:
    a hand-off inherits the model, data and optimizer (train.INHERITED), not the objective or the freezing.
    masked: whether the objective's positions are picked by mask_rate."""
    return [*([f"--objective={cfg.objective}"] if cfg.objective != cfg.phase else []),
            *([f"--mask_rate={cfg.mask_rate}"] if masked else []),
            *([f"--freeze={cfg.freeze}"] if cfg.freeze else [])]


def handoff(out, phase, *flags_, name=None):
    """A phase hand-off from the run in `out`, into out-NAME (name: the phase by default, which is train.py's
    default --out_dir), numbered -2, -3, ... where that is taken: a hint never writes into a run that exists."""
    default = where = continuation_dir(out, name or phase)
    n = 2
    while os.path.lexists(where):
        where, n = f"{default}-{n}", n + 1
    named = [f"--out_dir={where}"] if where != continuation_dir(out, phase) else []
    return command(f"--phase={phase}", f"--init_from={out}", *named, *flags_)


def summary(r, total_steps, signalled, elapsed, learning_rate):
    """How the run ended; for a finished phase, its last validation losses, where the model is, and the
    commands that go on from it."""
    cfg, out = r.cfg, r.cfg.out_dir
    hints = continuations(r, total_steps, learning_rate)
    print("-" * 100)
    if r.phase_step < total_steps:
        why = "interrupted by a signal" if signalled else "--max_steps"
        print(f"stopped at step {r.phase_step} of {total_steps} ({why}) after {duration(elapsed)}; saved. Continue "
              f"with:\n    {hints[0][1]}")
        if signalled and r.world > 1:  # torchrun's agent got the signal too, or sees its workers stop
            print("torchrun reports the stop next, with a traceback of its own and exit status 1; the checkpoint "
                  "above is complete and the command above continues it")
        return
    every = validations(r.run_dir.log_path)
    val, start = (every or [{}])[-1], next((v for v in every if v["step"] == 0), None)
    card = "README.md" if written(r, "README.md") else "no model card: it failed (the warning above says why)"
    picture = f"{out}/loss.png (picture) and " if written(r, "loss.png") else ""
    print(f"done: phase {cfg.phase} (recipe {cfg.recipe}), {r.phase_tokens:,} tokens in {r.phase_step} steps, "
          f"{duration(elapsed)} this invocation; validation MLM {val.get('val_mlm', float('nan')):.4f}, "
          f"CLM {val.get('val_clm', float('nan')):.4f}"
          + (f" (before its first step: MLM {start['val_mlm']:.4f}, CLM {start['val_clm']:.4f})"
             if start and start is not val else "") + "\n"
          f"the model:  {out}/ (a Hugging Face directory: config.json, model.safetensors, tokenizer files, "
          f"{card})\n"
          f"its losses: {picture}{out}/log.jsonl" + ("" if picture else f" (no picture: the loss picture was not "
                                                                       f"drawn at the last save, see above; python "
                                                                       f"eval.py curves {out} draws it)") + "\n"
          + "".join(f"tracked:    {line}\n" for line in tracking.where(cfg.log_to, out, r.tracker.failed)) +
          f"use it:     python -c \"from transformers import pipeline; "
          f"print(pipeline('fill-mask', model='{out}')('Return the [MASK] of the list.'))\"")
    for label, line, why in hints:
        print(f"{label + ':':<12}{line}   # {why}")


# -----------------------------------------------------------------------------
# The model card: OUT/README.md in Hugging Face's format, rewritten at each save (rundir.write_card) until edited.


def saved(r, learning_rate):
    """After a checkpoint: the loss picture and the model card, side jobs (a failure is a warning, the checkpoint is
    written already; r.wrote says which were written, so that the card and the summary name no file that failed),
    and the line that says so. The first save of an invocation is reloaded as a user would and compared with the
    model in memory (hf.check_saved: a warning if they differ); the code that ran does not change within an
    invocation, so once is enough."""
    from machinery.curves import draw_run
    drawn = []  # draw_run's path, or None without matplotlib
    r.wrote["loss.png"] = cli.side_job("the loss picture", lambda: drawn.append(draw_run(r.run_dir.path))) and \
        drawn[0] is not None
    if r.reloaded is None:  # before the card, which says what it found
        found = []
        cli.side_job("the check that the saved model reloads as it trained",
                     lambda: found.append(check_saved(r.model, r.run_dir.path)))
        r.reloaded = found[0] if found else {"failed": True}
    r.wrote["README.md"] = cli.side_job("the model card", lambda: r.run_dir.write_card(card(r, learning_rate)))
    print(f"saved {r.run_dir.path} at step {r.phase_step}", flush=True)


def written(r, name):
    """Whether the run's `name` (loss.png, README.md) is there as its last save made it: what that save's side job
    did, or, in an invocation that saved nothing, whether the file is there."""
    return r.wrote.get(name, os.path.isfile(os.path.join(r.cfg.out_dir, name)))


def finish(r, total_steps, stopped_by, elapsed, learning_rate):
    """Rank 0's summary and the run's lock let go. A run a signal stopped (`stopped_by`: its name) ends with a Stop,
    an interrupt: the script exits 128 + the signal's number, as a shell reports it, and a caller in the same
    process (a test suite) stops too, rather than taking the Ctrl-C as one test's failure."""
    if r.rank == 0:
        summary(r, total_steps, bool(stopped_by), elapsed, learning_rate)
        r.run_dir.unlock()
    if stopped_by:
        raise cli.Stop("", signal.Signals[stopped_by])


def card(r, learning_rate):
    """The model card of the run as it stands at this save: YAML front matter the hub reads, then the chain of
    phases, the data, the last validation losses and the commands that use and continue it."""
    cfg, out = r.cfg, r.cfg.out_dir
    total_steps = cfg.tokens // (cfg.batch_size * cfg.seq_len)
    chain = [*({**h, "config": saved_config(h["dir"])} for h in r.history),
             {"phase": cfg.phase, "tokens": r.phase_tokens, "dir": out, "config": dataclasses.asdict(cfg)}]
    meta = {"library_name": "transformers", "pipeline_tag": "fill-mask",
            **({"base_model": cfg.base_model} if cfg.base_model else {}),
            **({"license": cfg.license} if cfg.license else {}),
            **({"language": cfg.language.split(",")} if cfg.language else {}),
            "tags": ["modernbert", "fill-mask", "train.py", "phases-" + "-".join(c["phase"] for c in chain)]}
    every = validations(r.run_dir.log_path)
    val, start = (every or [{}])[-1], next((v for v in every if v["step"] == 0), None)
    lines = ["---", *yaml_lines(meta), "---", "", f"# {os.path.basename(out)}", "",
             f"A ModernBERT encoder ({cfg.preset or 'custom'} architecture, {r.model.num_params():,} parameters) "
             f"trained by train.py, {r.phase_step} of {total_steps} steps of its phase. {loads(r.reloaded)}", "",
             "## Training", "", f"Started from {origin(chain[0]['config'])}.", "",
             "| phase | objective | tokens | schedule | run |", "|---|---|---|---|---|",
             *(row(c) for c in chain), "",
             f"Batch {cfg.batch_size} x {cfg.seq_len} tokens, AdamW (peak lr {cfg.lr:g}, betas {cfg.beta1}, "
             f"{cfg.beta2}, weight decay {cfg.weight_decay:g}), seeds {cfg.seed} (model, masks) and {cfg.data_seed} "
             f"(data order).", "",
             "## Data", "", f"Prepared by `data.py` ({r.meta['vocab_size']:,}-token vocabulary):", "",
             "| source | documents | training tokens | sha256 |", "|---|---|---|---|",
             *data_rows(r.meta), "",
             "## Validation", ""]
    if "val_mlm" in val:
        lines += [f"At step {val['step']}, on the first {cfg.eval_sequences} windows of {cfg.seq_len} tokens of the "
                  f"validation split: MLM loss (15% masked) {val['val_mlm']:.4f}, CLM loss {val['val_clm']:.4f}."
                  + (f" Before the first step of this phase (where it started): MLM {start['val_mlm']:.4f}, CLM "
                     f"{start['val_clm']:.4f}." if start and start is not val else "")]
    else:
        lines += ["None yet."]
    hints = continuations(r, total_steps, learning_rate)
    lines += ["", *use(cfg), "", *intended_use(r, chain, val), "", *license_lines(cfg), "", "## Continue", "",
              *(["```bash", *(f"{line}   # {why}" for _, line, why in hints), "```"] if hints else
                ["Nothing: the recipe ends with this phase."]), "",
              "`log.jsonl` holds every step's record" + (", `loss.png` draws them" if written(r, "loss.png") else
                                                          " (`python eval.py curves RUN` draws them)")
              + "; `checkpoints/` (with the optimizer state) is what `--resume` reads, not needed to use the model.",
              "",
              "This card is rewritten at each save until you edit it; an edited card is yours and stays as it is."]
    return "\n".join(lines)


def loads(found):
    """The card's sentence on loading the model, from what hf.check_saved found (`found`: {loader: difference}) after
    this invocation's first save."""
    how = "`transformers` (`AutoModelForMaskedLM`, `pipeline(\"fill-mask\")`)"
    if found.get("failed"):
        return (f"It is written for {how}; whether it reloads as it trained was not checked (the check failed: the "
                f"run's output says why).")
    ours, theirs = found["model.py"], found.get("transformers")
    if not ours <= RELOAD_TOLERANCE:  # NaN too
        return (f"**It does not reload as the model that trained**: reloaded, even by model.py, its logits on a test "
                f"sequence differ from the trained model's by {ours:.2g} of the largest (a module or attribute changed "
                f"after the model was built, which config.json does not hold).")
    if theirs is None:
        return (f"It is written for {how}; whether transformers loads it as it trained was not checked (transformers "
                f"was not installed where it trained).")
    if theirs <= RELOAD_TOLERANCE:  # NaN is not
        return f"It loads with {how} as it trained (checked after a save: the same logits on a test sequence)."
    return (f"**transformers loads it as another model**: on a test sequence its logits differ from the trained "
            f"model's by {theirs:.2g} of the largest (model.py computed something config.json does not describe, "
            f"such as an activation edited in place of the hidden_activation field); this repository's model.py "
            f"(`ModernBERT.from_pretrained`) loads it as it trained.")


def use(cfg):
    """The card's "Use" section, a snippet that runs as written: it loads the hub id where --hub_id names one (what
    a reader of the card on the hub can load), else the folder train.py wrote, from the directory it ran in (a
    hub id the user never chose would wait for the network and fail). The other in a sentence, with the upload."""
    # W&B's local files (--log_to=wandb, now or in an earlier invocation) are no part of the model, and its
    # wandb-metadata.json holds the user's e-mail, host and user names and git remote
    wandb = os.path.isdir(os.path.join(cfg.out_dir, "wandb")) or "wandb" in map(str.strip, cfg.log_to.split(","))
    upload = (f"`hf upload {cfg.hub_id or 'USER/NAME'} {shlex.quote(cfg.out_dir)} --exclude \"checkpoints/*\""
              + (' --exclude "wandb/*"' if wandb else "") + "`")
    here = "" if os.path.isabs(cfg.out_dir) else ", from the directory it ran in"
    if cfg.hub_id:
        where = (f"Published with {upload}. Before it is uploaded, `model={json.dumps(cfg.out_dir)}` loads the "
                 f"folder train.py wrote{here}.")
    else:
        where = (f"`{cfg.out_dir}` is the folder train.py wrote{here}. To publish it: {upload}, with your hub "
                 f"repository for USER/NAME; trained with `--hub_id=USER/NAME`, this snippet loads it from the hub.")
    return ["## Use", "", "```python", "from transformers import pipeline",
            f"fill = pipeline(\"fill-mask\", model={json.dumps(cfg.hub_id or cfg.out_dir)})",
            "print(fill(\"Return the [MASK] of the list.\"))", "```", "", where]


def intended_use(r, chain, val):
    """What the model is for and what it is not, from the run: its size, the tokens and data it saw (and how
    often), the context it was trained at, and what was measured and what was not."""
    cfg, meta = r.cfg, r.meta
    tokens = sum(c["tokens"] for c in chain)
    earlier = chain[0]["config"].get("init_from", "scratch") != "scratch"
    sources = ", ".join(s.get("name", "?") for s in meta.get("sources") or [] if isinstance(s, dict)) or cfg.data
    read = r.loader.sequence / r.loader.n_windows  # epochs of its data, across the hand-offs that carry the position
    measured = ("validation MLM and CLM losses on held-out windows of the same data (above)" if "val_mlm" in val
                else "nothing yet")
    return ["## Intended use and limitations", "",
            f"A research and teaching model: {r.model.num_params():,} parameters, trained by the phases above on "
            f"{tokens:,} tokens" + (" (after the training of the model it started from)" if earlier else "")
            + f", in windows of {cfg.seq_len} tokens, on `{cfg.data}` ({sources}; "
            f"{meta['splits']['train']['tokens']:,} training tokens, read {read:.2f} times"
            + (": it may reproduce passages of it" if read > 1 else "") + "). It is meant for studying continued "
            "pretraining (how the phases above change a model) and for fill-mask and fine-tuning experiments on "
            "text like its data.", "",
            f"Measured: {measured}. Not evaluated: any downstream task (no fine-tuning result is recorded with "
            f"it), text unlike its data, inputs longer than {cfg.seq_len} tokens, and bias, toxicity or factual "
            f"accuracy. A model of this size and data is not fit to make decisions about people or to state "
            f"facts."]


def license_lines(cfg):
    """The card's license: the one --license named, or a line saying that none was given and what that means."""
    if cfg.license:
        return ["## License", "", f"`{cfg.license}` (the front matter's `license`, from train.py's --license). The "
                f"data it was trained on keeps its own terms."]
    return ["## License", "", "**No license was given** (train.py's --license was empty), so the front matter names "
            "none and the hub shows this model without one: nobody else can tell whether they may use it. Before "
            "publishing, add `license:` to the front matter (or train with --license=ID, e.g. apache-2.0), "
            "choosing one that the data's own terms allow."]


def base_model(init_from, state):
    """The card's base model where --base_model names none: the one of the run of ours we start from (`state`:
    its checkpoint's), or --init_from's hub id; none for a fresh model or a local directory, whose hub id is
    unknown, nor for what is no hub id (a path that is not there: --init_from says so)."""
    if state is not None:
        return state["config"].get("base_model", "")  # none in a checkpoint written before it existed
    local = init_from == "scratch" or os.path.isdir(init_from) or hub_id_problem(init_from)
    return "" if local else init_from


def yaml_lines(meta):
    """Front matter as YAML: a JSON string is a YAML double-quoted scalar, so no YAML library is needed."""
    lines = []
    for key, value in meta.items():
        if isinstance(value, list):
            lines += [f"{key}:", *(f"- {json.dumps(v)}" for v in value)]
        else:
            lines.append(f"{key}: {json.dumps(value)}")
    return lines


def origin(config):
    """Where the first run of the chain started: a fresh model, a checkpoint, or a run of ours (--weights_only)."""
    if config.get("init_from", "scratch") == "scratch":
        return f"a fresh `{config.get('preset', '?')}` model" if config else "an earlier run"
    try:
        state = latest_state(config["init_from"])
    except InputError:  # damaged since: its name alone
        state = None
    what = f" (a run of train.py: {state['phase']}, {state['phase_tokens']:,} tokens)" if state else ""
    return f"the weights of `{config['init_from']}`{what}"


def row(c):
    config = c["config"]
    if not config:
        return f"| {c['phase']} | | {c['tokens']:,} | | `{run_dir_of(c['dir'])}` |"
    objective = {"clm": "CLM", "mlm": f"MLM {config['mask_rate']:.0%}"}.get(config["objective"], config["objective"])
    warmup = f", warmup {config['warmup_tokens']:,}" if config["warmup_tokens"] else ""
    budget = config["schedule_tokens"] or config["tokens"]
    return f"| {c['phase']} | {objective} | {c['tokens']:,} | {config['schedule']} over {budget:,}{warmup} | " \
           f"`{run_dir_of(c['dir'])}` |"


def data_rows(meta):
    """A row per source of meta.json (data.py records them; an older meta.json may not)."""
    per_source = meta["splits"]["train"].get("per_source") or {}
    sources = [s for s in meta.get("sources") or [] if isinstance(s, dict)]
    return [f"| {s.get('name', '?')} | {s.get('documents', 0):,} | "
            f"{per_source.get(s.get('name'), {}).get('tokens', 0):,} | `{str(s.get('sha256', ''))[:16]}` |"
            for s in sources] or [f"| (not recorded) | | {meta['splits']['train']['tokens']:,} | |"]
