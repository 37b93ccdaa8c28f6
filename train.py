"""Continued pretraining of ModernBERT: MLM, the CLM detour and the MLM decay, on 1 to N processes.

    python train.py                        # the embedded demo: tiny model on data/demo, minutes on a CPU
    torchrun --nproc_per_node=4 train.py --phase=clm --init_from=answerdotai/ModernBERT-base --data=data/bio --out_dir=out/clm
    torchrun --nproc_per_node=4 train.py --phase=decay --init_from=out/clm --out_dir=out/clm-decay

A phase (SPEC §3) picks the objective, the attention mask, the masking rate and the schedule; every
other value is the paper's recipe unless a flag says otherwise. `--phase=decay --init_from=RUN` keeps
the weights, the Adam moments, the step counter and the data position of RUN and restarts only the
schedule. Importing this file has no side effects: tests use its optimizer and schedules.
"""
import base64
import contextlib
import dataclasses
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
from model import BACKEND_NAMES, ModernBERT, ModernBERTConfig, resolve_checkpoint, write_json

# -----------------------------------------------------------------------------
# Configuration: the paper's recipe as typed defaults; a phase preset, the demo, the run we start
# from and the command line override them, in that order.


@dataclass
class Config:
    phase: str = "mlm"  # mlm (the baseline) | clm (the detour) | decay (the short MLM return)
    init_from: str = "scratch"  # scratch (a preset) | a Hugging Face directory or hub id | a run directory of ours
    preset: str = "base"  # architecture when init_from=scratch
    data: str = "data/demo"  # a directory written by `python data.py prepare`
    out_dir: str = ""  # default out/<phase>
    tokens: int = 10_000_000_000  # this phase's budget; decay: 0 means 10% of the Phase-1 tokens of init_from
    seq_len: int = 8192  # documents packed into 8,192-token sequences
    batch_size: int = 384  # global sequences per optimizer step (3.1M tokens)
    micro_batch_size: int = 4  # sequences per process per forward; accumulation makes up the rest
    lr: float = 2e-4  # peak learning rate
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    weight_decay: float = 1e-5  # decoupled: p *= 1 - (lr_t / lr) * wd, none on ndim <= 1
    schedule: str = "constant"  # constant (linear warmup, then constant) | 1-sqrt (decay to final_lr_frac)
    warmup_tokens: int = 100_000_000
    final_lr_frac: float = 0.1  # the decay ends at 10% of the peak
    mask_rate: float = 0.3  # MLM masking rate; 0 means next-token prediction (CLM)
    causal: bool = False  # causal attention mask (the detour)
    grad_clip: float = 1.0  # max global grad norm (our choice; 0 disables)
    dropout: float = 0.0  # on the attention output projection (SPEC §1, our choice)
    separate_documents: bool = False  # the paper lets attention cross document boundaries
    seed: int = 17  # training seed: init, masking, dropout
    data_seed: int = 42  # data order, shared by the twins (CLM and MLM see the same sequences)
    freeze: str = ""  # blocks to freeze: 0-7 | 8-14 | 0,2,5 | low | mid
    eval_interval: int = 250  # steps between validation losses (and one at the end)
    eval_sequences: int = 64  # fixed validation windows
    save_interval: int = 500  # steps between checkpoints (and one at the end)
    log_interval: int = 1
    max_steps: int = 0  # stop (with a checkpoint) after this many steps in this invocation; 0: run to the budget
    resume: bool = False  # continue out_dir exactly where it stopped
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "bfloat16"  # autocast dtype on CUDA (bfloat16 or float32); CPU runs fp32
    compile: bool = True  # torch.compile each block (CUDA only)
    backend: str = "auto"  # attention: auto | flash | flex | sdpa


PHASES = {
    "mlm": dict(mask_rate=0.3, causal=False, schedule="constant", warmup_tokens=100_000_000),
    "clm": dict(mask_rate=0.0, causal=True, schedule="constant", warmup_tokens=100_000_000),
    "decay": dict(mask_rate=0.15, causal=False, schedule="1-sqrt", warmup_tokens=0, tokens=0),
}
# With neither --data nor --init_from: the embedded demo, sized for a laptop CPU.
DEMO = dict(preset="tiny", seq_len=256, batch_size=16, micro_batch_size=16, tokens=1_250_000, lr=2e-3,
            warmup_tokens=100_000, eval_interval=50, eval_sequences=16, save_interval=0, log_interval=10,
            compile=False)
# What a phase started from one of our runs inherits from it (the same model, data and optimizer).
INHERITED = ("preset", "data", "seq_len", "batch_size", "micro_batch_size", "lr", "beta1", "beta2", "eps",
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
            number = float(text[:-1] if scale > 1 else text)
            if number * scale != int(number * scale):
                raise ValueError
            return int(number * scale)
        return float(text) if kind == "float" else text
    except ValueError:
        raise SystemExit(f"error: --{key}={text!r} is not a valid {kind}") from None


def parse_flags(argv):
    """--key=value or --key value (a bare --flag sets a bool); unknown keys are an error."""
    flags, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise SystemExit(f"error: unexpected argument {arg!r}; flags look like --key=value")
        key, eq, value = arg[2:].partition("=")
        if key not in FIELDS:
            raise SystemExit(f"error: unknown flag --{key}; known flags: {', '.join(FIELDS)}")
        if not eq:
            if FIELDS[key] == "bool" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                value = "true"
            elif i + 1 < len(argv):
                i, value = i + 1, argv[i + 1]
            else:
                raise SystemExit(f"error: --{key} needs a value")
        flags[key] = parse_value(key, value)
        i += 1
    return flags


def resolve_config(argv):
    """Returns (config, the run we start from or None). Order: defaults < phase < demo < init run < flags."""
    flags = parse_flags(argv)
    if flags.get("resume"):  # the saved configuration, with this invocation's flags on top
        out_dir = flags.get("out_dir") or f"out/{flags.get('phase', Config.phase)}"
        saved = read_run(out_dir, "--resume")["config"]
        values = {k: v for k, v in saved.items() if k in FIELDS and k not in PER_INVOCATION}
        return Config(**{**values, **flags, "out_dir": out_dir}), None
    phase = flags.get("phase", Config.phase)
    if phase not in PHASES:
        raise SystemExit(f"error: --phase={phase!r}; expected one of {', '.join(PHASES)}")
    values = dict(PHASES[phase])
    if "data" not in flags and "init_from" not in flags:
        values.update(DEMO)
    init_run = None
    init_from = flags.get("init_from", Config.init_from)
    if os.path.exists(os.path.join(init_from, "state.json")):
        init_run = read_run(init_from, "--init_from")
        values.update({k: v for k, v in init_run["config"].items() if k in INHERITED})
    values.update(flags)
    cfg = Config(**values)
    cfg.out_dir = cfg.out_dir or f"out/{cfg.phase}"
    if cfg.phase == "decay" and cfg.tokens == 0:  # 10% of the Phase-1 budget (SPEC §3)
        if init_run is None:
            raise SystemExit("error: --phase=decay needs --tokens, or --init_from a run directory of this trainer "
                             "(its budget then defaults to 10% of that run's tokens)")
        cfg.tokens = init_run["phase_tokens"] // 10
    check_config(cfg)
    return cfg, init_run


def check_config(cfg):
    """Bad values stop here, before any data is read or weight is loaded."""
    problems = [
        (cfg.schedule in ("constant", "1-sqrt"), f"--schedule={cfg.schedule!r}: expected constant or 1-sqrt"),
        (0 <= cfg.mask_rate < 1, f"--mask_rate={cfg.mask_rate}: expected 0 <= rate < 1 (0 means CLM)"),
        (cfg.mask_rate > 0 or cfg.causal, "--mask_rate=0 (next-token prediction) needs --causal=true"),
        (cfg.mask_rate == 0 or not cfg.causal, "--causal=true with masking: MLM needs bidirectional attention"),
        (cfg.tokens > 0 and cfg.seq_len > 0 and cfg.batch_size > 0 and cfg.micro_batch_size > 0,
         "--tokens, --seq_len, --batch_size and --micro_batch_size must be positive"),
        (cfg.lr > 0 and 0 <= cfg.final_lr_frac <= 1, "--lr must be positive and --final_lr_frac within [0, 1]"),
        (cfg.dtype in ("bfloat16", "float32"), f"--dtype={cfg.dtype!r}: expected bfloat16 or float32"),
        (cfg.backend in ("auto", "flash", "flex", "sdpa"), f"--backend={cfg.backend!r}: expected auto, flash, flex or sdpa"),
    ]
    for ok, message in problems:
        if not ok:
            raise SystemExit(f"error: {message}")


def read_run(path, flag):
    """state.json of a run directory, falling back to the copy kept while a checkpoint was being swapped in."""
    for candidate in (path, path + ".old"):
        state_file = os.path.join(candidate, "state.json")
        if os.path.exists(state_file):
            if candidate != path:
                print(f"{path} is incomplete (interrupted while saving): using the previous checkpoint {candidate}")
            with open(state_file) as f:
                state = json.load(f)
            state["dir"] = candidate
            return state
    raise SystemExit(f"error: {flag}={path}: no state.json there; expected a run directory written by train.py")


# -----------------------------------------------------------------------------
# Optimizer and schedules.


class AdamW:
    """Decoupled AdamW (Composer's DecoupledAdamW, SPEC §3): Adam with bias correction, and weight decay
    scaled by the schedule, not by the learning rate: p *= 1 - (lr_t / peak_lr) * wd. Equal to
    torch.optim.AdamW(weight_decay=wd / peak_lr). Matrices decay; biases and norms (ndim <= 1) do not.
    Parameters named in `frozen` are skipped entirely: no update from stale moments, no decay."""

    def __init__(self, groups, peak_lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=1e-5):
        self.groups = [(params, weight_decay if kind == "decay" else 0.0) for kind, params in groups.items()]
        named = [name for params, _ in self.groups for name, _ in params]
        assert len(named) == len(set(named)), "every parameter belongs to exactly one group"
        self.peak_lr, self.betas, self.eps = peak_lr, betas, eps
        self.moments = {name: (torch.zeros_like(p), torch.zeros_like(p)) for params, _ in self.groups for name, p in params}
        self.steps = 0  # Adam's t, carried across phases
        self.frozen = set()

    @torch.no_grad()
    def step(self, lr):
        self.steps += 1
        beta1, beta2 = self.betas
        bias1, bias2 = 1 - beta1 ** self.steps, 1 - beta2 ** self.steps
        for params, wd in self.groups:
            live = [(p, *self.moments[n]) for n, p in params if n not in self.frozen and p.grad is not None]
            if not live:
                continue
            ps, ms, vs = (list(t) for t in zip(*live))
            gs = [p.grad for p in ps]
            if wd:
                torch._foreach_mul_(ps, 1 - lr / self.peak_lr * wd)
            torch._foreach_lerp_(ms, gs, 1 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, math.sqrt(bias2))
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(ps, ms, denom, value=-lr / bias1)

    def state_tensors(self):
        return {f"{kind}.{name}": t for name, pair in self.moments.items() for kind, t in zip(("exp_avg", "exp_avg_sq"), pair)}

    def load_state_tensors(self, tensors, steps, source):
        want = set(self.state_tensors())
        if set(tensors) != want:
            raise SystemExit(f"error: {source} does not match the model: missing {sorted(want - set(tensors))[:5]}, "
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
# Checkpoints: a Hugging Face directory plus optimizer.safetensors and state.json, written to
# OUT.tmp and swapped in by renames, so a kill at any moment leaves a complete checkpoint behind.


def save_checkpoint(out_dir, model, optimizer, state, extra_files=()):
    from safetensors.torch import save_file
    tmp, old = out_dir + ".tmp", out_dir + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in optimizer.state_tensors().items()}, os.path.join(tmp, "optimizer.safetensors"))
    for path in extra_files:  # the log, the tokenizer
        if os.path.exists(path):
            shutil.copy(path, tmp)
    write_json(os.path.join(tmp, "state.json"), state)
    if os.path.exists(out_dir):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


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
# Hardware: peak dense bf16 FLOP/s per GPU, for MFU.

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


# -----------------------------------------------------------------------------
# The run.


def main(argv=None):
    cfg, init_run = resolve_config(sys.argv[1:] if argv is None else argv)

    # --- distributed setup: torchrun sets RANK; one code path for 1 and N processes ---
    ddp = "RANK" in os.environ
    want_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if ddp:
        dist.init_process_group("nccl" if want_cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ["LOCAL_RANK"])
    else:
        rank, world, local_rank = 0, 1, 0
    device = torch.device(f"cuda:{local_rank}" if want_cuda and (ddp or cfg.device == "auto") else
                          ("cuda" if want_cuda else cfg.device if cfg.device != "auto" else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    master = rank == 0
    print0 = print if master else (lambda *a, **k: None)
    try:
        train(cfg, init_run, device, rank, world, ddp, master, print0)
    except data.DataError as e:  # bad data stops with its file named, before any compute
        raise SystemExit(f"error: {e}") from None
    finally:
        if ddp:
            dist.destroy_process_group()


def train(cfg, init_run, device, rank, world, ddp, master, print0):
    accum, rem = divmod(cfg.batch_size, cfg.micro_batch_size * world)
    if rem or not accum:
        raise SystemExit(f"error: --batch_size={cfg.batch_size} is not a multiple of --micro_batch_size="
                         f"{cfg.micro_batch_size} x {world} processes")
    tokens_per_step = cfg.batch_size * cfg.seq_len
    total_steps = max(1, cfg.tokens // tokens_per_step)
    resume_state = read_run(cfg.out_dir, "--out_dir") if cfg.resume else None
    if not cfg.resume and os.path.exists(os.path.join(cfg.out_dir, "state.json")):
        raise SystemExit(f"error: {cfg.out_dir} already holds a checkpoint; pass --resume to continue it, "
                         f"or choose another --out_dir")

    # --- data: prepared shards; the demo is built on first use ---
    if cfg.data == Config.data and not os.path.exists(os.path.join(cfg.data, "meta.json")) and master:
        print0(f"{cfg.data} is missing: building the embedded demo corpus")
        data.prepare_demo(cfg.data)
    if ddp:
        dist.barrier()
    meta = data.load_meta(cfg.data)
    objective = "clm" if cfg.mask_rate == 0 else "mlm"
    loader = data.Loader(cfg.data, "train", cfg.seq_len, cfg.batch_size, cfg.micro_batch_size, rank, world,
                         objective, cfg.mask_rate, cfg.data_seed, cfg.seed)
    assert loader.accum == accum

    # --- model: from a preset, a Hugging Face checkpoint, or one of our runs ---
    torch.manual_seed(cfg.seed)  # the same init on every rank
    start = resume_state or init_run
    source = start["dir"] if start is not None else None if cfg.init_from == "scratch" else resolve_checkpoint(cfg.init_from)
    if source is not None:
        model = ModernBERT.from_pretrained(source, cfg.backend)
        if os.path.exists(os.path.join(source, "tokenizer.json")):  # the model's own tokenizer must be the data's
            data.check_tokenizer(meta, data.load_tokenizer(os.path.join(source, "tokenizer.json")))
    else:
        vocab = -(-meta["vocab_size"] // 64) * 64  # a multiple of 64 keeps the decoder matmul fast
        model = ModernBERT(ModernBERTConfig.from_preset(
            cfg.preset, vocab_size=vocab, pad_token_id=meta["pad_id"], cls_token_id=meta["cls_id"],
            sep_token_id=meta["sep_id"], mask_token_id=meta["mask_id"]), cfg.backend)
    check_data_fits_model(meta, model.config, cfg)
    model.config.attention_dropout = cfg.dropout
    for block in model.model.layers:
        block.attn.dropout = cfg.dropout
    model.to(device)
    frozen_layers = freeze.parse_layers(cfg.freeze, model.config.num_hidden_layers)
    frozen = freeze.frozen_names(model, frozen_layers)
    optimizer = AdamW(model.param_groups(), cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay)
    optimizer.frozen = frozen

    # --- where we start: fresh, a phase hand-off (weights, moments, step counter, data position), or a resume ---
    step, phase_tokens, history = 0, 0, []
    if start is not None:
        from safetensors.torch import load_file
        opt_file = os.path.join(start["dir"], "optimizer.safetensors")
        optimizer.load_state_tensors(load_file(opt_file, device=str(device)), start["step"], opt_file)
        loader.load_state_dict(start["loader"])
        history = start.get("history", [])
    if resume_state is not None:
        step, phase_tokens = resume_state["phase_step"], resume_state["phase_tokens"]
        ranks = resume_state.get("rng", [])
        if len(ranks) == world:
            set_rng_state(ranks[rank], device)
    elif init_run is not None:
        history = history + [{"phase": init_run["phase"], "tokens": init_run["phase_tokens"], "dir": init_run["dir"]}]

    torch.manual_seed(cfg.seed + rank)  # dropout streams differ across ranks
    raw_model = model
    if cfg.compile and device.type == "cuda":
        for block in model.model.layers:  # regional compilation: one graph per block kind, compiled once
            block.compile()
    if ddp:
        # no device_ids: DDP would otherwise move the host-side labels to the GPU (the model handles them there)
        model = torch.nn.parallel.DistributedDataParallel(model)
    autocast = (torch.autocast("cuda", dtype=getattr(torch, cfg.dtype)) if device.type == "cuda" and cfg.dtype != "float32"
                else contextlib.nullcontext())
    flops = raw_model.flops_per_token(cfg.seq_len, cfg.causal, cfg.mask_rate or 1.0)
    peak = peak_flops(device)

    print0(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    print0(f"torch {torch.__version__}, python {sys.version.split()[0]}, device {device}"
           f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, {world} process(es)")
    print0(f"model: {raw_model.num_params():,} parameters, attention: {raw_model.attention_backend(device)} = "
           f"{BACKEND_NAMES[raw_model.attention_backend(device)]}")
    print0(f"batch: {cfg.batch_size} sequences = {cfg.micro_batch_size} micro x {accum} accumulation x {world} "
           f"process(es); {tokens_per_step:,} tokens/step; {total_steps:,} steps for {cfg.tokens:,} tokens")
    print0(f"phase {cfg.phase}: {'CLM, causal mask' if cfg.causal else f'MLM at {cfg.mask_rate:.0%}, bidirectional'}; "
           f"schedule {cfg.schedule}; optimizer step counter starts at {optimizer.steps}"
           + (f"; frozen blocks {frozen_layers} ({sum(p.numel() for n, p in raw_model.named_parameters() if n in frozen):,} "
              f"parameters)" if frozen_layers else ""))
    if peak is None:
        print0("MFU: no peak FLOP/s known for this device; MFU is not reported")

    os.makedirs(cfg.out_dir, exist_ok=True)
    log_file = os.path.join(cfg.out_dir, "log.jsonl")
    if master and resume_state is not None:  # drop log lines written after the checkpoint we resume from
        keep = [line for line in open(os.path.join(resume_state["dir"], "log.jsonl")) if json.loads(line)["step"] <= step] \
            if os.path.exists(os.path.join(resume_state["dir"], "log.jsonl")) else []
        with open(log_file, "w") as f:
            f.writelines(keep)
    # the run directory carries its tokenizer: the checkpoint's own, else the file the data was prepared with
    tokenizer_file = next((f for f in (source and os.path.join(source, "tokenizer.json"), meta["tokenizer"])
                           if f and os.path.isfile(f)), None)

    def log(record):
        if master:
            with open(log_file, "a") as f:
                f.write(json.dumps(record) + "\n")

    def checkpoint():
        state = dict(phase=cfg.phase, step=optimizer.steps, phase_step=step, phase_tokens=phase_tokens,
                     total_tokens=sum(h["tokens"] for h in history) + phase_tokens, loader=loader_state,
                     rng=gather(rng_state(device)), config=dataclasses.asdict(cfg), code=code_version(),
                     tokenizer=meta["tokenizer"], history=history)
        if master:
            save_checkpoint(cfg.out_dir, raw_model, optimizer, state,
                            [log_file] + ([tokenizer_file] if tokenizer_file else []))
            print0(f"saved {cfg.out_dir} at step {step}")

    def gather(obj):
        if not ddp:
            return [obj]
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    def validate():
        """Fixed validation windows, rank 0 only: MLM loss at 15% and CLM loss, whatever the phase."""
        raw_model.eval()
        losses = {}
        with torch.no_grad(), autocast:
            for name, obj, rate, causal in (("val_mlm", "mlm", 0.15, False), ("val_clm", "clm", 0.0, True)):
                total = [raw_model(x.to(device), labels=y, causal=causal, doc_ids=docs(x))[1].float()
                         for x, y in data.val_batches(cfg.data, cfg.seq_len, cfg.eval_sequences, cfg.micro_batch_size,
                                                      obj, rate, seed=0)]
                losses[name] = torch.stack(total).mean().item()
        raw_model.train()
        return losses

    def docs(x):
        return data.document_ids(x, meta["sep_id"]).to(device) if cfg.separate_documents else None

    # --- the loop ---
    def next_batch():
        """Ids go to the device from pinned memory, so the copy overlaps the GPU's work; labels stay on the
        host, where the model finds the positions to predict without a device sync."""
        x, y = loader.next()
        return (x.pin_memory().to(device, non_blocking=True), y) if device.type == "cuda" else (x, y)

    model.train()
    loader_state = loader.state_dict()  # the position a checkpoint records: before the prefetched batch
    x, y = next_batch()
    params = list(raw_model.parameters())
    stop = total_steps if not cfg.max_steps else min(total_steps, step + cfg.max_steps)
    while step < stop:
        t0 = time.time()
        lr = learning_rate(cfg, phase_tokens)
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            if ddp:  # all-reduce gradients only on the last micro-step (set before the forward)
                model.require_backward_grad_sync = micro == accum - 1
            with autocast:
                _, loss = model(x, labels=y, causal=cfg.causal, doc_ids=docs(x))
            (loss / accum).backward()
            loss_sum += loss.detach()
            if micro == accum - 1:
                loader_state = loader.state_dict()
            x, y = next_batch()  # the next batch, prepared while the GPU works
        freeze.zero_frozen_grads(raw_model, frozen)
        grad_norm = (torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0 else
                     torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        optimizer.step(lr)
        for p in params:
            p.grad = None
        step += 1
        phase_tokens += tokens_per_step

        if ddp:
            dist.all_reduce(loss_sum)
        loss_value = loss_sum.item() / accum / world  # the one host sync per step
        if not math.isfinite(loss_value):
            raise SystemExit(f"error: non-finite loss {loss_value} at step {step} (phase {cfg.phase}); stopping. "
                             f"The last good checkpoint in {cfg.out_dir} is kept as it was.")
        dt = time.time() - t0
        record = dict(phase=cfg.phase, step=step, tokens=phase_tokens, loss=round(loss_value, 5), lr=lr,
                      grad_norm=round(grad_norm.item(), 4), ms=round(dt * 1000, 1), tokens_per_s=round(tokens_per_step / dt),
                      mfu=round(flops * tokens_per_step / dt / world / peak, 4) if peak else None)
        if step % cfg.eval_interval == 0 or step == total_steps:
            record.update(validate() if master else {})
        log(record)
        if step % cfg.log_interval == 0 or step == stop or "val_mlm" in record:
            print0(f"{cfg.phase} step {step}/{total_steps} | tokens {phase_tokens:,} | loss {loss_value:.4f} | lr {lr:.2e} | "
                   f"grad {record['grad_norm']:.3f} | {record['ms']:.0f} ms | {record['tokens_per_s']:,} tok/s"
                   + (f" | MFU {record['mfu']:.1%}" if peak else "")
                   + (f" | val mlm {record['val_mlm']:.4f} clm {record['val_clm']:.4f}" if "val_mlm" in record else ""))
        if step == stop or (cfg.save_interval and step % cfg.save_interval == 0):
            checkpoint()
    if step == total_steps:
        print0(f"done: phase {cfg.phase}, {phase_tokens:,} tokens in {step} steps; the model is in {cfg.out_dir}")
    else:
        print0(f"stopped at step {step} of {total_steps} (--max_steps); continue with --resume --out_dir={cfg.out_dir}")


def check_data_fits_model(meta, config, cfg):
    """Data prepared with another tokenizer would train garbage: compare ids before any compute."""
    ids = {"cls": config.cls_token_id, "sep": config.sep_token_id, "pad": config.pad_token_id, "mask": config.mask_token_id}
    wrong = [f"{k}: data {meta[k + '_id']} vs model {v}" for k, v in ids.items() if meta[k + "_id"] != v]
    if meta["vocab_size"] > config.vocab_size or wrong:
        raise SystemExit(f"error: {os.path.join(cfg.data, 'meta.json')} does not match the model of --init_from="
                         f"{cfg.init_from}: vocabulary {meta['vocab_size']} vs {config.vocab_size}"
                         + (f"; special ids {', '.join(wrong)}" if wrong else "")
                         + ". Prepare the data with the model's tokenizer.")


if __name__ == "__main__":
    main()
