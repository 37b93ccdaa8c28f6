"""Continued pretraining of ModernBERT: MLM, the CLM detour and the MLM decay, on 1 to N processes.

    python train.py                                  # the demo recipe: a tiny model on data/demo, minutes on a CPU
    torchrun --nproc_per_node=4 train.py --phase=clm # the same demo, on 4 processes (same global batch)
    python train.py --phase=decay --init_from=out/demo-clm
    torchrun --nproc_per_node=4 train.py --recipe=paper --phase=clm --init_from=answerdotai/ModernBERT-base \
        --data=data/bio --out_dir=out/clm

A recipe names a scale (the paper's, the demo's, ...), a phase (SPEC §3) the objective and the schedule;
flags override both. Where a run starts is one of four cases, printed at start: a fresh model; weights
only (a Hugging Face checkpoint, or a run with --weights_only: fresh optimizer and data position); a
phase hand-off from one of our runs (weights, Adam moments, step counter and data position; only the
schedule restarts); or --resume (everything, bit for bit). Importing this file has no side effects.
"""
import base64
import contextlib
import dataclasses
import datetime
import fcntl
import gc
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import data
import freeze
from model import BACKEND_NAMES, ModernBERT, ModernBERTConfig, read_config, resolve_checkpoint, write_json


class TrainError(ValueError):
    """A bad flag or input file, or a run that cannot go on: `error: <message>`, exit status 2, no traceback."""


# -----------------------------------------------------------------------------
# Configuration: the paper's recipe as typed defaults (SPEC §3).


@dataclass
class Config:
    recipe: str = "demo"  # paper (SPEC §3) | demo (a laptop CPU, data/demo) | smoke | cpu (reproduce.py's scales)
    phase: str = "mlm"  # mlm (the baseline) | clm (the detour) | decay (the short MLM return)
    init_from: str = "scratch"  # scratch (a --preset) | a Hugging Face directory or hub id | a run directory of ours
    weights_only: bool = False  # from a run of ours, take the weights alone: fresh optimizer, fresh data position
    preset: str = "base"  # architecture when init_from=scratch: tiny | mini | small | base | large
    data: str = ""  # a directory written by `python data.py prepare`
    out_dir: str = ""  # default out/<phase> (paper), out/<recipe>-<phase> (the others)
    tokens: int = 10_000_000_000  # this phase's budget; decay: 0 means 10% of the Phase-1 tokens of init_from
    seq_len: int = 8192  # documents packed into 8,192-token sequences
    batch_size: int = 384  # global sequences per optimizer step (3.1M tokens)
    micro_batch_size: int = 4  # sequences per process per forward; 0: batch_size / processes (no accumulation)
    objective: str = "mlm"  # mlm | clm, set by the phase: clm means a causal mask and next-token labels
    mask_rate: float = 0.3  # MLM masking rate (80% [MASK], 10% random, 10% kept)
    lr: float = 2e-4  # peak learning rate
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    weight_decay: float = 1e-5  # decoupled: p *= 1 - (lr_t / lr) * wd, none on ndim <= 1
    schedule: str = "constant"  # constant (linear warmup, then constant) | 1-sqrt (decay to final_lr_frac)
    warmup_tokens: int = 100_000_000
    final_lr_frac: float = 0.1  # the decay ends at 10% of the peak
    grad_clip: float = 1.0  # max global grad norm (our choice; 0 disables)
    dropout: float = 0.0  # on the attention output projection (SPEC §1, our choice)
    separate_documents: bool = False  # the paper lets attention cross document boundaries
    seed: int = 17  # training seed: init, masking, dropout
    data_seed: int = 42  # data order, shared by the twins (CLM and MLM see the same sequences)
    freeze: str = ""  # blocks to freeze: 0-7 | 8-14 | 0,2,5 | low | mid
    eval_interval: int = 250  # steps between validation losses (and one at the end)
    eval_sequences: int = 64  # fixed validation windows
    save_interval: int = 500  # steps between checkpoints (and one at the end); 0: only at the end
    log_interval: int = 1
    max_steps: int = 0  # stop (with a checkpoint) after this many steps in this invocation; 0: run to the budget
    resume: bool = False  # continue out_dir exactly where it stopped
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # CPU intra-op threads per process; 0: $OMP_NUM_THREADS, else the idle cores / local processes
    dtype: str = "bfloat16"  # autocast dtype on CUDA (bfloat16 or float32); CPU runs fp32
    compile: bool = True  # torch.compile each block (CUDA only)
    backend: str = "auto"  # attention: auto | flash | flex | sdpa
    ddp_timeout: int = 900  # seconds a process waits for the others before the job stops (a stalled rank)


# Scales: the values a recipe changes. The paper's is the defaults above.
RECIPES = {
    "paper": {},
    "demo": dict(data="data/demo", preset="tiny", seq_len=256, batch_size=16, micro_batch_size=0, tokens=1_250_000,
                 lr=2e-3, warmup_tokens=100_000, eval_interval=50, eval_sequences=16, save_interval=50,
                 log_interval=10, compile=False),
    "smoke": dict(preset="tiny", seq_len=128, batch_size=8, micro_batch_size=0, tokens=100_000, lr=2e-3,
                  warmup_tokens=10_000, eval_interval=5, eval_sequences=8, save_interval=25, log_interval=10,
                  compile=False),
    "cpu": dict(preset="mini", seq_len=256, batch_size=32, micro_batch_size=0, tokens=2_000_000, lr=1e-3,
                warmup_tokens=200_000, eval_interval=25, eval_sequences=16, save_interval=50, log_interval=25,
                compile=False),
}
# Phases (SPEC §3): the objective and the schedule. The decay's budget, 0, means 10% of the Phase-1 run's.
PHASES = {
    "mlm": dict(objective="mlm", mask_rate=0.3, schedule="constant"),
    "clm": dict(objective="clm", schedule="constant"),
    "decay": dict(objective="mlm", mask_rate=0.15, schedule="1-sqrt", warmup_tokens=0, tokens=0),
}
# What a phase hand-off inherits from the run it continues: the same model, data, batch and optimizer.
INHERITED = ("recipe", "preset", "data", "seq_len", "batch_size", "micro_batch_size", "lr", "beta1", "beta2", "eps",
             "weight_decay", "grad_clip", "dropout", "separate_documents", "seed", "data_seed", "dtype")
PER_INVOCATION = ("resume", "max_steps", "device")  # never taken from a saved configuration
FIELDS = {f.name: f.type.__name__ for f in dataclasses.fields(Config)}  # "int", "float", "bool", "str"


def parse_value(key, text):
    kind = FIELDS[key]
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if kind == "int":  # token counts read best as 10e9, 10_000_000_000 or 10B
            scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}.get(text[-1:].lower(), 1)
            number = float(text[:-1] if scale > 1 else text) * scale
            if not math.isfinite(number) or number != int(number):
                raise ValueError
            return int(number)
        if kind == "float":
            return float(text)
        return text
    except ValueError:
        raise TrainError(f"--{key}={text!r} is not a valid {kind}") from None


def parse_flags(argv):
    """--key=value or --key value (a bare --flag sets a bool); unknown keys are an error."""
    flags, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise TrainError(f"unexpected argument {arg!r}; flags look like --key=value")
        key, eq, value = arg[2:].partition("=")
        if key not in FIELDS:
            raise TrainError(f"unknown flag --{key}; known flags: {', '.join(FIELDS)}")
        if not eq:
            if FIELDS[key] == "bool" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                value = "true"
            elif i + 1 < len(argv):
                i, value = i + 1, argv[i + 1]
            else:
                raise TrainError(f"--{key} needs a value")
        flags[key] = parse_value(key, value)
        i += 1
    return flags


def resolve_config(flags, saved=None, start_run=None):
    """Defaults < recipe < phase < what a hand-off inherits from start_run < flags. `saved`: a resumed run's config."""
    if saved is not None:
        values = {k: v for k, v in saved.items() if k in FIELDS and k not in PER_INVOCATION}
        return Config(**{**values, **flags})
    inherited = {k: v for k, v in start_run["config"].items() if k in INHERITED} if start_run else {}
    recipe = flags.get("recipe", inherited.get("recipe", Config.recipe))
    phase = flags.get("phase", Config.phase)
    for name, value, known in (("recipe", recipe, RECIPES), ("phase", phase, PHASES)):
        if value not in known:
            raise TrainError(f"--{name}={value!r}; expected one of {', '.join(known)}")
    cfg = Config(**{**RECIPES[recipe], **PHASES[phase], **inherited, **flags})
    default_dir = f"out/{cfg.phase}" if cfg.recipe == "paper" else f"out/{cfg.recipe}-{cfg.phase}"
    cfg.out_dir = os.path.normpath(cfg.out_dir or default_dir)  # out/run/ and out/run are the same run
    if cfg.phase == "decay" and cfg.tokens == 0:  # 10% of the Phase-1 budget (SPEC §3)
        if start_run is None:
            raise TrainError("--phase=decay needs --tokens, or --init_from a run directory of this trainer "
                             "(its budget then defaults to 10% of that run's tokens)")
        cfg.tokens = start_run["phase_tokens"] // 10
    return cfg


def check_config(cfg, world):
    """Every flag's range, before any data is read or any weight is loaded. Returns the accumulation steps."""
    finite = lambda x: math.isfinite(x)  # noqa: E731  (NaN passes every comparison below unnoticed otherwise)
    rules = [
        (cfg.objective in ("mlm", "clm"), f"--objective={cfg.objective!r}: expected mlm or clm"),
        (cfg.schedule in ("constant", "1-sqrt"), f"--schedule={cfg.schedule!r}: expected constant or 1-sqrt"),
        (cfg.objective == "clm" or 0 < cfg.mask_rate < 1, f"--mask_rate={cfg.mask_rate}: expected 0 < rate < 1"),
        (cfg.phase != "decay" or cfg.init_from != "scratch",
         "--phase=decay needs --init_from: the run (or checkpoint) to decay from"),
        (cfg.data != "", "--data is required: a directory written by `python data.py prepare`"),
        (cfg.tokens > 0, f"--tokens={cfg.tokens}: expected a positive token budget"),
        (cfg.seq_len > 0, f"--seq_len={cfg.seq_len}: expected a positive length"),
        (cfg.batch_size > 0 and cfg.micro_batch_size >= 0,
         f"--batch_size={cfg.batch_size} must be positive and --micro_batch_size={cfg.micro_batch_size} >= 0"),
        (finite(cfg.lr) and cfg.lr > 0, f"--lr={cfg.lr}: expected a positive finite learning rate"),
        (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1,
         f"--beta1={cfg.beta1}, --beta2={cfg.beta2}: expected 0 <= beta < 1"),
        (finite(cfg.eps) and cfg.eps > 0, f"--eps={cfg.eps}: expected a positive finite number"),
        (finite(cfg.weight_decay) and cfg.weight_decay >= 0, f"--weight_decay={cfg.weight_decay}: expected >= 0"),
        (cfg.warmup_tokens >= 0, f"--warmup_tokens={cfg.warmup_tokens}: expected >= 0"),
        (0 <= cfg.final_lr_frac <= 1, f"--final_lr_frac={cfg.final_lr_frac}: expected a fraction in [0, 1]"),
        (finite(cfg.grad_clip) and cfg.grad_clip >= 0, f"--grad_clip={cfg.grad_clip}: expected >= 0 (0 disables)"),
        (0 <= cfg.dropout < 1, f"--dropout={cfg.dropout}: expected a probability in [0, 1)"),
        (cfg.seed >= 0 and cfg.data_seed >= 0, f"--seed={cfg.seed}, --data_seed={cfg.data_seed}: expected >= 0"),
        (cfg.eval_interval > 0 and cfg.log_interval > 0 and cfg.eval_sequences > 0,
         "--eval_interval, --log_interval and --eval_sequences must be positive"),
        (cfg.save_interval >= 0 and cfg.max_steps >= 0, "--save_interval and --max_steps must be >= 0 (0: at the end)"),
        (cfg.threads >= 0 and cfg.ddp_timeout > 0, "--threads must be >= 0 (0: automatic), --ddp_timeout positive"),
        (cfg.dtype in ("bfloat16", "float32"), f"--dtype={cfg.dtype!r}: expected bfloat16 or float32"),
        (cfg.backend in ("auto", *BACKEND_NAMES),
         f"--backend={cfg.backend!r}: expected auto, {', '.join(BACKEND_NAMES)}"),
        (cfg.init_from == "scratch" or cfg.recipe != "demo" or is_run(cfg.init_from),
         f"--recipe=demo trains a tiny model from scratch; --init_from={cfg.init_from} needs --recipe=paper "
         f"(SPEC §3) or another recipe"),
    ]
    for ok, message in rules:
        if not ok:
            raise TrainError(message)
    micro = cfg.micro_batch_size or cfg.batch_size // world
    accum, rest = divmod(cfg.batch_size, max(micro, 1) * world)
    if (rest or not accum) and not cfg.micro_batch_size:
        counts = ", ".join(str(n) for n in range(1, cfg.batch_size + 1) if cfg.batch_size % n == 0)
        raise TrainError(f"--batch_size={cfg.batch_size} does not split evenly over {world} processes; run on "
                         f"{counts} processes, or pass a --batch_size divisible by {world}")
    if rest or not accum:
        raise TrainError(f"--batch_size={cfg.batch_size} cannot be split into micro-batches of {micro} on {world} "
                         f"process(es); change --micro_batch_size so that batch_size = micro_batch_size x "
                         f"processes x k")
    cfg.micro_batch_size = micro
    if cfg.tokens < cfg.batch_size * cfg.seq_len and cfg.phase != "decay":
        raise TrainError(f"--tokens={cfg.tokens:,} is less than one optimizer step ({cfg.batch_size} x {cfg.seq_len} "
                         f"= {cfg.batch_size * cfg.seq_len:,} tokens); raise --tokens or lower --batch_size")
    return accum


def is_run(path):
    return any(os.path.isfile(os.path.join(d, "state.json")) for d in (path, path + ".tmp", path + ".old"))


# -----------------------------------------------------------------------------
# Optimizer and schedules.


class AdamW:
    """Decoupled AdamW (Composer's DecoupledAdamW, SPEC §3): Adam with bias correction, and weight decay
    scaled by the schedule, not by the learning rate: p *= 1 - (lr_t / peak_lr) * wd. Equal to
    torch.optim.AdamW(weight_decay=wd / peak_lr). Matrices decay; biases and norms (ndim <= 1) do not.
    Parameters named in `frozen` are skipped entirely: no update from stale moments, no decay."""

    def __init__(self, groups, peak_lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=1e-5, frozen=()):
        self.groups = [(params, weight_decay if kind == "decay" else 0.0) for kind, params in groups.items()]
        named = [name for params, _ in self.groups for name, _ in params]
        assert len(named) == len(set(named)), "every parameter belongs to exactly one group"
        self.peak_lr, self.betas, self.eps = peak_lr, betas, eps
        self.moments = {name: (torch.zeros_like(p), torch.zeros_like(p))
                        for params, _ in self.groups for name, p in params}
        self.denoms = {name: torch.empty_like(m) for name, (m, _) in self.moments.items()}  # reused every step
        self.steps = 0  # Adam's t, carried across phases
        self.frozen = set(frozen)

    @torch.no_grad()
    def step(self, lr):
        self.steps += 1
        beta1, beta2 = self.betas
        bias1, bias2 = 1 - beta1 ** self.steps, 1 - beta2 ** self.steps
        for params, wd in self.groups:
            live = [(p, *self.moments[n], self.denoms[n])
                    for n, p in params if n not in self.frozen and p.grad is not None]
            if not live:
                continue
            ps, ms, vs, denom = (list(t) for t in zip(*live))
            gs = [p.grad for p in ps]
            if wd:
                torch._foreach_mul_(ps, 1 - lr / self.peak_lr * wd)
            torch._foreach_lerp_(ms, gs, 1 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
            torch._foreach_copy_(denom, vs)
            torch._foreach_sqrt_(denom)
            torch._foreach_div_(denom, math.sqrt(bias2))
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(ps, ms, denom, value=-lr / bias1)

    def state_tensors(self):
        return {f"{kind}.{name}": t for name, pair in self.moments.items()
                for kind, t in zip(("exp_avg", "exp_avg_sq"), pair)}

    def load_state_tensors(self, tensors, steps, source):
        want = set(self.state_tensors())
        if set(tensors) != want:
            raise TrainError(f"{source} does not match the model: missing {sorted(want - set(tensors))[:5]}, "
                             f"unexpected {sorted(set(tensors) - want)[:5]}")
        for name, (m, v) in self.moments.items():
            m.copy_(tensors[f"exp_avg.{name}"])
            v.copy_(tensors[f"exp_avg_sq.{name}"])
        self.steps = steps


def learning_rate(cfg, tokens):
    """The schedule as a function of the tokens this phase has seen before the step (SPEC §3)."""
    if cfg.schedule == "constant":  # linear warmup over warmup_tokens, then constant
        return cfg.lr * min(1.0, tokens / cfg.warmup_tokens) if cfg.warmup_tokens else cfg.lr
    progress = min(1.0, tokens / cfg.tokens)  # 1-sqrt: from the peak down to final_lr_frac of it
    return cfg.lr * (cfg.final_lr_frac + (1 - cfg.final_lr_frac) * (1 - math.sqrt(progress)))


# -----------------------------------------------------------------------------
# Checkpoints. A run directory OUT is a Hugging Face model directory plus optimizer.safetensors and
# state.json. A save writes OUT.tmp (every file fsynced, state.json last, listing the others' sizes), then
# renames OUT -> OUT.old, OUT.tmp -> OUT, and deletes OUT.old. At every instant one of the three is complete;
# `recover` makes the newest complete one OUT again. A folder is deleted only if it carries our MARKER.

MARKER = ".train_py"  # "this folder was created by train.py and may be replaced by it"
STATE_KEYS = ("phase", "step", "phase_step", "phase_tokens", "loader", "rng", "config", "files", "history")


def read_state(folder):
    """state.json of a complete checkpoint in `folder`, else None (missing, unreadable or files of another size)."""
    try:
        with open(os.path.join(folder, "state.json")) as f:
            state = json.load(f)
        complete = isinstance(state, dict) and all(k in state for k in STATE_KEYS) and all(
            os.path.getsize(os.path.join(folder, name)) == size for name, size in state["files"].items())
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return state if complete else None


def owned(folder):
    return os.path.isfile(os.path.join(folder, MARKER))


def remove_run_dir(folder):
    """Delete one of our (flat) checkpoint folders; the marker goes last, so a kill midway leaves it ours."""
    if not os.path.exists(folder):
        return
    if not owned(folder):
        raise TrainError(f"{folder} exists and was not written by train.py; move it away (nothing was deleted)")
    for name in os.listdir(folder):
        if name != MARKER:
            os.remove(os.path.join(folder, name))
    os.remove(os.path.join(folder, MARKER))
    os.rmdir(folder)


def recover(out_dir):
    """Make the newest complete checkpoint among OUT, OUT.tmp and OUT.old be OUT, and remove the others.
    Returns its state, or None when there is none. Each rename is atomic, so any kill here is recoverable too."""
    found = [(s["step"], s["phase_step"], i, d) for i, d in enumerate((out_dir, out_dir + ".tmp", out_dir + ".old"))
             if (s := read_state(d)) is not None]
    if not found:
        return None
    *_, best = max(found, key=lambda f: (f[0], f[1], -f[2]))  # ties go to OUT
    if best != out_dir:
        print(f"{out_dir}: the newest complete checkpoint is {best} (a save was interrupted): moving it into place")
        remove_run_dir(out_dir)
        os.rename(best, out_dir)
    for other in (out_dir + ".tmp", out_dir + ".old"):
        remove_run_dir(other)
    return read_state(out_dir)


def lock_run_dir(out_dir):
    """An exclusive lock beside OUT (OUT itself is renamed by saves), held until the process ends."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        handle = open(out_dir + ".lock", "a+")
    except OSError as e:
        raise TrainError(f"--out_dir={out_dir}: cannot create the run directory there ({e.strerror})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise TrainError(f"--out_dir={out_dir}: another train.py is writing this run (it holds {out_dir}.lock)") \
            from None
    return handle


def append_log(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def fsync_file(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(out_dir, model, optimizer, state, tokenizer):
    """Write the checkpoint to OUT.tmp, then swap it in. A failure (a full disk) leaves OUT as it was."""
    from safetensors.torch import save_file
    tmp, old = out_dir + ".tmp", out_dir + ".old"
    tensors = [*model.parameters(), *optimizer.state_tensors().values()]
    if not all(torch.isfinite(t).all() for t in tensors):  # never write a poisoned checkpoint over a good one
        raise TrainError(f"non-finite weights or moments at step {state['phase_step']}; nothing saved, "
                         f"{out_dir} is kept")
    try:
        remove_run_dir(tmp)
        os.makedirs(tmp)
        open(os.path.join(tmp, MARKER), "w").close()
        model.save_pretrained(tmp)
        moments = {k: v.contiguous() for k, v in optimizer.state_tensors().items()}
        save_file(moments, os.path.join(tmp, "optimizer.safetensors"))
        tokenizer.save_pretrained(tmp)
        if os.path.exists(os.path.join(out_dir, "log.jsonl")):
            shutil.copy(os.path.join(out_dir, "log.jsonl"), tmp)
        files = sorted(n for n in os.listdir(tmp) if n not in (MARKER, "log.jsonl"))  # the log grows after the save
        for name in files:
            fsync_file(os.path.join(tmp, name))
        sizes = {n: os.path.getsize(os.path.join(tmp, n)) for n in files}
        write_json(os.path.join(tmp, "state.json"), {**state, "files": sizes})
        fsync_file(os.path.join(tmp, "state.json"))
    except OSError as e:
        with contextlib.suppress(OSError, TrainError):
            remove_run_dir(tmp)
        raise TrainError(f"could not write the checkpoint {tmp} ({e.strerror or e}); {out_dir} is kept as it was") \
            from None
    remove_run_dir(old)
    if os.path.exists(out_dir):
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    dir_fd = os.open(os.path.dirname(os.path.abspath(out_dir)), os.O_RDONLY)
    os.fsync(dir_fd)  # the renames themselves reach the disk
    os.close(dir_fd)
    remove_run_dir(old)


def rng_state(device):
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device.type == "cuda":
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return state


def set_rng_state(state, device):
    decode = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(decode(state["cpu"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(decode(state["cuda"]), device)


def all_gather(obj, world):
    """Every rank's obj. A collective: every rank must call it at the same point."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def code_version():
    """The git commit when there is one, and a hash of the code that ran (it may be uncommitted)."""
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in ("model.py", "data.py", "train.py", "freeze.py"):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"git": commit or None, "sha256": digest.hexdigest()[:16]}


# -----------------------------------------------------------------------------
# Evaluation, hardware and printing.


@torch.no_grad()
def evaluate(model, cfg, meta, device, autocast):
    """Fixed validation windows: MLM loss at 15% and CLM loss, whatever the phase, so phases compare."""
    model.eval()
    losses = {}
    for name, objective, rate in (("val_mlm", "mlm", 0.15), ("val_clm", "clm", 0.0)):
        total = []
        for x, y in data.val_batches(cfg.data, cfg.seq_len, cfg.eval_sequences, cfg.micro_batch_size, objective, rate):
            docs = data.document_ids(x, meta["sep_id"]).to(device) if cfg.separate_documents else None
            with autocast:
                total.append(model(x.to(device), labels=y, causal=objective == "clm", doc_ids=docs)[1].float())
        losses[name] = torch.stack(total).mean().item()
    model.train()
    return losses


PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s per GPU, for MFU


def peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def pick_device(requested, local_rank):
    if requested == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise TrainError(f"--device={requested!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        raise TrainError(f"--device={requested}: not available here (CUDA available: {torch.cuda.is_available()})")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def pick_threads(requested):
    """Intra-op threads of this CPU process. PyTorch's default, a thread per core in every process, oversubscribes
    a machine that runs anything else: on 2 cores next to one busy process the demo took 1.8x the wall time and
    2.4x the CPU time with 2 threads than with 1 (README). So: the cores that are idle now, shared by the
    processes torchrun starts here. The resolved number is saved, so --resume keeps it (bit-identical results)."""
    if requested:
        return requested
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    idle = cores - round(os.getloadavg()[0])
    return max(1, min(cores, idle) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


# -----------------------------------------------------------------------------
# Where a run starts: checks and loading, each failure a one-line error naming the file or flag.


def next_batch(loader, device):
    """Ids go to the device from pinned memory, so the copy overlaps the GPU's work; labels stay on the
    host, where the model finds the positions to predict without a device sync."""
    x, y = loader.next()
    return (x.pin_memory().to(device, non_blocking=True), y) if device.type == "cuda" else (x, y)


def recover_readonly(path):
    """The state of the run directory `path` starts from (complete checkpoint among path, .tmp, .old), or None
    when `path` is not one of our runs (a Hugging Face checkpoint or hub id)."""
    if not is_run(path):
        return None
    found = [(s["step"], s["phase_step"], d) for d in (path, path + ".tmp", path + ".old") if (s := read_state(d))]
    if not found:
        raise TrainError(f"--init_from={path}: its state.json is incomplete or unreadable, and no complete "
                         f"checkpoint is in {path}.tmp or {path}.old")
    *_, best = max(found)
    return {**read_state(best), "dir": best}


def check_fresh_out_dir(out_dir):
    """A new run never overwrites anything: OUT holds no checkpoint, and nothing but what a killed start left."""
    if is_run(out_dir):
        raise TrainError(f"{out_dir} already holds a checkpoint; pass --resume to continue it, "
                         f"or choose another --out_dir")
    for folder in (out_dir, out_dir + ".tmp", out_dir + ".old"):
        if os.path.isfile(folder):
            raise TrainError(f"--out_dir={out_dir}: {folder} is a file, not a directory")
        if os.path.isdir(folder) and os.listdir(folder) and not owned(folder):
            raise TrainError(f"--out_dir={out_dir}: {folder} exists and was not written by train.py; "
                             f"choose another --out_dir")
    os.makedirs(out_dir, exist_ok=True)
    if not os.access(out_dir, os.W_OK):
        raise TrainError(f"--out_dir={out_dir}: not writable")
    open(os.path.join(out_dir, MARKER), "w").close()


def resolve_source(init_from):
    """A Hugging Face directory, or a hub id (fetched). A path that does not exist is not taken for a hub id."""
    looks_like_path = init_from.startswith(("/", ".", "~")) or init_from.count("/") != 1
    if not os.path.isdir(init_from) and looks_like_path:
        raise TrainError(f"--init_from={init_from}: no such directory (expected scratch, a checkpoint directory, "
                         f"or a hub id like answerdotai/ModernBERT-base)")
    try:
        return resolve_checkpoint(init_from)
    except (FileNotFoundError, RuntimeError) as e:
        raise TrainError(f"--init_from={init_from}: {e}") from None


def read_model_config(source):
    path = os.path.join(source, "config.json")
    try:
        return read_config(path)
    except OSError as e:
        raise TrainError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:  # names the file and the field
        raise TrainError(str(e)) from None


def load_or_fail(load, path):
    try:
        load(path)
    except Exception as e:  # safetensors raises its own error types for a truncated or garbage file
        raise TrainError(f"{path}: cannot load the weights ({type(e).__name__}: {str(e)[:200]})") from None


def load_optimizer(optimizer, start_run, device):
    from safetensors.torch import load_file
    path = os.path.join(start_run["dir"], "optimizer.safetensors")
    load_or_fail(lambda p: optimizer.load_state_tensors(load_file(p, device=str(device)), start_run["step"], p), path)


def check_data_fits_model(meta, config, cfg):
    """Data prepared with another tokenizer would train garbage: compare ids before any compute."""
    ids = {"cls": config.cls_token_id, "sep": config.sep_token_id, "pad": config.pad_token_id,
           "mask": config.mask_token_id}
    wrong = [f"{k}: data {meta[k + '_id']} vs model {v}" for k, v in ids.items() if meta[k + "_id"] != v]
    if meta["vocab_size"] > config.vocab_size or wrong:
        raise TrainError(f"{os.path.join(cfg.data, 'meta.json')} does not match the model of --init_from="
                         f"{cfg.init_from}: vocabulary {meta['vocab_size']} vs {config.vocab_size}"
                         + (f"; special ids {', '.join(wrong)}" if wrong else "")
                         + ". Prepare the data with the model's tokenizer.")
    if cfg.seq_len > config.max_position_embeddings:
        raise TrainError(f"--seq_len={cfg.seq_len} is longer than the model's max_position_embeddings "
                         f"({config.max_position_embeddings})")


def configure(flags, start, master, world):
    """The checked configuration, the run we start from (None for fresh or a Hugging Face checkpoint), the
    accumulation steps, and the lock on OUT. Rank 0 repairs an interrupted save before anyone reads OUT."""
    if start == "resume":
        if not flags.get("out_dir"):
            raise TrainError("--resume needs --out_dir: the run directory to continue")
        out_dir = os.path.normpath(flags["out_dir"])
        lock = lock_run_dir(out_dir) if master else None
        start_run = all_gather(recover(out_dir) if master else None, world)[0]  # a collective: every rank calls it
        if start_run is None:
            raise TrainError(f"--resume --out_dir={out_dir}: no complete checkpoint there (nor in .tmp or .old)")
        start_run["dir"] = out_dir
        cfg = resolve_config({**flags, "out_dir": out_dir}, saved=start_run["config"])
        return cfg, check_config(cfg, world), start_run, lock
    start_run = None
    if start != "fresh":
        start_run = recover_readonly(flags["init_from"])
    cfg = resolve_config(flags, start_run=start_run if start == "handoff" else None)
    accum = check_config(cfg, world)  # before OUT is created
    lock = lock_run_dir(cfg.out_dir) if master else None
    if master:
        check_fresh_out_dir(cfg.out_dir)
    return cfg, accum, start_run, lock


# -----------------------------------------------------------------------------
# The run.


def main(argv=None):
    # ---- configuration and distributed setup --------------------------------------------------------
    flags = parse_flags(sys.argv[1:] if argv is None else argv)
    ddp = "RANK" in os.environ  # torchrun sets RANK; one code path for 1 and N processes
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(flags.get("device", Config.device), int(os.environ.get("LOCAL_RANK", 0)))
    master = rank == 0
    print0 = print if master else (lambda *a, **k: None)
    if ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=flags.get("ddp_timeout", Config.ddp_timeout)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    init_from = flags.get("init_from", Config.init_from)
    if flags.get("resume"):
        start = "resume"  # everything of OUT's last checkpoint, bit for bit
    elif init_from == "scratch":
        start = "fresh"
    elif is_run(init_from) and not flags.get("weights_only"):
        start = "handoff"  # weights, Adam moments, step counter and data position; the schedule restarts
    else:
        start = "weights"  # a Hugging Face checkpoint, or our run's weights alone
    cfg, accum, start_run, lock = configure(flags, start, master, world)  # lock: held (open) until the process ends
    cfg.threads = pick_threads(cfg.threads)
    torch.set_num_threads(cfg.threads)

    out_dir = cfg.out_dir

    # ---- data ---------------------------------------------------------------------------------------
    if cfg.recipe == "demo" and cfg.data == RECIPES["demo"]["data"] and master and \
            not os.path.exists(os.path.join(cfg.data, "meta.json")):
        print0(f"{cfg.data} is missing: building the embedded demo corpus")
        data.prepare_demo(cfg.data)
    all_gather(None, world)  # a barrier: the other ranks wait for the demo corpus
    meta = data.load_meta(cfg.data)
    tokenizer = data.load_tokenizer(meta["tokenizer"])
    data.check_tokenizer(meta, tokenizer)
    loader = data.Loader(cfg.data, "train", cfg.seq_len, cfg.batch_size, cfg.micro_batch_size, rank, world,
                         cfg.objective, cfg.mask_rate, cfg.data_seed, cfg.seed)
    val_windows = data.count_windows(cfg.data, "val", cfg.seq_len)
    if val_windows < cfg.eval_sequences:
        raise TrainError(f"{cfg.data}/val.bin holds {val_windows} windows of {cfg.seq_len} tokens, fewer than "
                         f"--eval_sequences={cfg.eval_sequences}; lower it, or prepare with a larger --val_fraction")
    tokens_per_step = cfg.batch_size * cfg.seq_len
    total_steps = max(1, cfg.tokens // tokens_per_step)
    epochs = total_steps * tokens_per_step / (loader.n_windows * cfg.seq_len)

    # ---- model: its configuration is checked against the data and the flags before any weight is loaded
    if start == "fresh":
        source = None
    elif start_run is not None:  # one of our runs: the directory that holds its newest complete checkpoint
        source = start_run["dir"]
    else:
        source = resolve_source(init_from)
    if source is None:
        vocab = -(-meta["vocab_size"] // 64) * 64  # a multiple of 64 keeps the decoder matmul fast
        config = ModernBERTConfig.from_preset(cfg.preset, vocab_size=vocab,
                                              pad_token_id=meta["pad_id"], cls_token_id=meta["cls_id"],
                                              sep_token_id=meta["sep_id"], mask_token_id=meta["mask_id"])
    else:
        config = read_model_config(source)
    check_data_fits_model(meta, config, cfg)
    try:
        frozen_layers = freeze.parse_layers(cfg.freeze, config.num_hidden_layers)
    except ValueError as e:
        raise TrainError(str(e)) from None
    torch.manual_seed(cfg.seed)  # the same init on every rank
    model = ModernBERT(config.replace(attention_dropout=cfg.dropout), cfg.backend)
    if source is not None:
        load_or_fail(model.load_weights, os.path.join(source, "model.safetensors"))
    model.to(device)
    frozen = freeze.frozen_names(model, frozen_layers)
    optimizer = AdamW(model.param_groups(), cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay, frozen)

    # ---- where we start -----------------------------------------------------------------------------
    step, phase_tokens, history = 0, 0, []
    if start == "resume":
        print0(f"resume {out_dir} at phase step {start_run['phase_step']}: weights, Adam moments, step counter "
               f"{start_run['step']}, schedule position, data position and RNG states")
        load_optimizer(optimizer, start_run, device)
        loader.load_state_dict(start_run["loader"])
        step, phase_tokens, history = start_run["phase_step"], start_run["phase_tokens"], start_run["history"]
        if len(start_run["rng"]) == world:  # dropout streams; another world size restarts them
            set_rng_state(start_run["rng"][rank], device)
    elif start == "handoff":
        print0(f"phase hand-off from {source} ({start_run['phase']}, {start_run['phase_tokens']:,} tokens): weights, "
               f"Adam moments, step counter {start_run['step']} and data position; the schedule restarts")
        load_optimizer(optimizer, start_run, device)
        loader.load_state_dict(start_run["loader"])
        history = start_run["history"] + [dict(phase=start_run["phase"], tokens=start_run["phase_tokens"], dir=source)]
    elif start == "weights":
        print0(f"weights from {source}; a fresh optimizer, and the data from its first sequence")
    else:
        print0(f"a fresh {cfg.preset} model (seed {cfg.seed})")
    torch.manual_seed(cfg.seed + rank)  # dropout streams differ across ranks
    if cfg.compile and device.type == "cuda":
        for block in model.model.layers:  # regional compilation: one graph per block kind, compiled once
            block.compile()
    # no device_ids: DDP would otherwise move the host-side labels to the GPU (the model handles them there)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    autocast = contextlib.nullcontext()  # fp32 on a CPU, where bf16 is slow
    if device.type == "cuda" and cfg.dtype != "float32":
        autocast = torch.autocast("cuda", dtype=getattr(torch, cfg.dtype))
    flops = model.flops_per_token(cfg.seq_len, cfg.objective == "clm", cfg.mask_rate if cfg.objective == "mlm" else 1.0)
    peak = peak_flops(device)
    log_file = os.path.join(out_dir, "log.jsonl")
    if master:  # the log holds exactly the steps of the checkpoint we start from
        lines = []
        if start == "resume" and os.path.exists(log_file):
            lines = [line for line in open(log_file) if json.loads(line)["step"] <= step]
        with open(log_file, "w") as f:
            f.writelines(lines)

    print0(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    print0(f"torch {torch.__version__}, python {sys.version.split()[0]}, device {device}"
           f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, {world} process(es), "
           f"{torch.get_num_threads()} CPU thread(s) each (--threads)")
    print0(f"model: {model.num_params():,} parameters, attention: {BACKEND_NAMES[model.attention_backend(device)]}")
    print0(f"recipe {cfg.recipe}, phase {cfg.phase}: {cfg.objective.upper()}"
           f"{', causal mask' if cfg.objective == 'clm' else f' at {cfg.mask_rate:.0%}, bidirectional'}; schedule "
           f"{cfg.schedule}; frozen blocks: {frozen_layers or 'none'}")
    print0(f"batch: {cfg.batch_size} sequences = {cfg.micro_batch_size} micro x {accum} accumulation x {world} "
           f"process(es); {tokens_per_step:,} tokens/step; {total_steps:,} steps = {total_steps * tokens_per_step:,} "
           f"tokens, {epochs:.2f} epochs of {cfg.data}")
    if epochs > 4:
        print0(f"warning: the budget is {epochs:,.0f} epochs of {cfg.data} ({loader.n_windows * cfg.seq_len:,} train "
               f"tokens): the model will memorise it; lower --tokens or prepare more data")

    # ---- the loop ---------------------------------------------------------------------------------------
    params = list(model.parameters())
    stop = total_steps if not cfg.max_steps else min(total_steps, step + cfg.max_steps)
    first_step, t_start, code = step, time.time(), code_version()
    record = {}
    loader_state = loader.state_dict()  # the position a checkpoint records: before the prefetched batch
    x, y = next_batch(loader, device)
    ddp_model.train()
    while step < stop:
        t0 = time.time()
        lr = learning_rate(cfg, phase_tokens)
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            if ddp:  # all-reduce gradients only on the last micro-step (set before the forward)
                ddp_model.require_backward_grad_sync = micro == accum - 1
            docs = data.document_ids(x, meta["sep_id"]).to(device) if cfg.separate_documents else None
            with autocast:
                _, loss = ddp_model(x, labels=y, causal=cfg.objective == "clm", doc_ids=docs)
            (loss / accum).backward()
            loss_sum += loss.detach()
            if micro == accum - 1:
                loader_state = loader.state_dict()
            x, y = next_batch(loader, device)  # the next batch, prepared while the GPU works
        freeze.zero_frozen_grads(model, frozen)
        if cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if ddp:
            dist.all_reduce(loss_sum)  # a collective: the logged loss averages every rank
        loss_value, norm_value = (torch.stack([loss_sum / accum / world, grad_norm.float()])).tolist()  # one sync
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):  # checked before the weights change
            raise TrainError(f"non-finite loss {loss_value} or gradient norm {norm_value} at step {step + 1} (phase "
                             f"{cfg.phase}); stopped before the update. The last checkpoint in {out_dir} is kept "
                             f"as it was; lower --lr or check the data")
        optimizer.step(lr)
        for p in params:
            p.grad = None
        step += 1
        phase_tokens += tokens_per_step

        dt = time.time() - t0
        eta = (time.time() - t_start) / (step - first_step) * (stop - step)
        record = dict(phase=cfg.phase, step=step, tokens=phase_tokens, loss=round(loss_value, 5), lr=lr,
                      grad_norm=round(norm_value, 4), ms=round(dt * 1000, 1), tokens_per_s=round(tokens_per_step / dt),
                      mfu=round(flops * tokens_per_step / dt / world / peak, 4) if peak else None)
        if master:  # before the save, so that the checkpoint's copy of the log ends with this step
            append_log(log_file, record)
        print_step = step % cfg.log_interval == 0 or step == stop or step == first_step + 1
        if step == stop or (cfg.save_interval and step % cfg.save_interval == 0):
            # the state a checkpoint writes and a resume reads; all_gather is a collective: every rank gets here
            checkpoint_state = dict(
                phase=cfg.phase, step=optimizer.steps, phase_step=step, phase_tokens=phase_tokens,
                total_tokens=sum(h["tokens"] for h in history) + phase_tokens, loader=loader_state,
                rng=all_gather(rng_state(device), world), config=dataclasses.asdict(cfg), code=code,
                tokenizer=meta["tokenizer"], history=history)
            if master:
                save_checkpoint(out_dir, model, optimizer, checkpoint_state, tokenizer)
                print(f"saved {out_dir} at step {step}")
        # validation after the save: a crash here loses nothing
        if master and (step % cfg.eval_interval == 0 or step == total_steps):
            record.update(evaluate(model, cfg, meta, device, autocast))
            append_log(log_file, dict(phase=cfg.phase, step=step, tokens=phase_tokens, val_mlm=record["val_mlm"],
                                      val_clm=record["val_clm"]))
            print_step = True
        if print_step:
            val = f" | val mlm {record['val_mlm']:.4f} clm {record['val_clm']:.4f}" if "val_mlm" in record else ""
            mfu = f" | MFU {record['mfu']:.1%}" if peak else ""
            print0(f"{cfg.phase} step {step}/{total_steps} | loss {loss_value:.4f} | lr {lr:.2e} | grad "
                   f"{norm_value:.3f} | {dt * 1000:.0f} ms | {record['tokens_per_s']:,} tok/s{mfu}{val} | "
                   f"eta {duration(eta)}")

    # ---- summary ------------------------------------------------------------------------------------
    all_gather(None, world)  # a barrier, every rank: nobody tears the process group down while rank 0 saves
    elapsed = time.time() - t_start
    print0("-" * 100)
    if step < total_steps:
        print0(f"stopped at step {step} of {total_steps} (--max_steps) after {duration(elapsed)}; continue with:\n"
               f"    python train.py --resume --out_dir={out_dir}")
        return
    val = f"; validation MLM {record['val_mlm']:.4f}, CLM {record['val_clm']:.4f}" if "val_mlm" in record else ""
    print0(f"done: phase {cfg.phase} (recipe {cfg.recipe}), {phase_tokens:,} tokens in {step} steps, "
           f"{duration(elapsed)} this invocation\nfinal train loss {record.get('loss', float('nan')):.4f}{val}\n"
           f"the model: {out_dir}/ (a Hugging Face directory: config.json, model.safetensors, tokenizer files)\n"
           f"use it:    python -c \"from transformers import pipeline; "
           f"print(pipeline('fill-mask', model='{out_dir}')('The [MASK] of the function.'))\"")
    if cfg.phase != "decay":
        print0(f"next:      python train.py --phase=decay --init_from={out_dir}   # the MLM decay (SPEC §3)")


def cli(argv=None):
    """`error: ...` and exit status 2 for bad input, on rank 0 only; never a traceback for a user's mistake."""
    try:
        main(argv)
    except (TrainError, data.DataError) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        e.__traceback__ = None  # drop main()'s frames now: they hold the run directory's lock
        raise SystemExit(2) from None
    except RuntimeError as e:  # gloo and NCCL report a collective that waited past --ddp_timeout like this
        if not (dist.is_initialized() and "timed out" in str(e).lower()):
            raise
        print(f"error: rank {dist.get_rank()}: another process did not answer within --ddp_timeout; it stalled or "
              f"died ({str(e).splitlines()[0][-120:]}). Resume with --resume", file=sys.stderr, flush=True)
        os._exit(2)  # the process group cannot be torn down cleanly while a peer is stuck
    finally:
        if dist.is_initialized():
            gc.collect()  # DDP's reducer goes before its process group: gloo aborts if it outlives it
            dist.destroy_process_group()


if __name__ == "__main__":
    cli()
