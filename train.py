"""Continued pretraining of ModernBERT: MLM, the CLM detour and the MLM decay, on 1 to N processes.

    python train.py                                  # the demo's start model, out/demo-mlm: minutes
    python train.py --phase=clm --init_from=out/demo-mlm --weights_only  # the detour: demo-mlm-clm
    python train.py --phase=decay --init_from=out/demo-mlm-clm   # its decay: out/demo-mlm-clm-decay
    python train.py --resume --out_dir=out/demo-mlm --tokens=2M  # a run made longer, its schedule kept
    torchrun --nproc_per_node=4 train.py --phase=clm # any command on 4 processes: same global batch
    python train.py --help                           # every flag, its default and its meaning

A recipe names a scale (the paper's, the demo's, ...), a phase the objective and the schedule
(RECIPE.md states the paper's numbers); flags override both. A run starts in one of four ways,
printed at start: a fresh model; weights only (a Hugging Face checkpoint, or a run with
--weights_only); a phase hand-off from one of our runs (weights, Adam's moments and t, data position);
or --resume (everything, bit for bit). Importing this file has no side effects.
"""
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass

from machinery import flags

if __name__ == "__main__":  # the flags, checked before torch is imported: a typo is answered in a second
    flags.check_command_line(__file__)

import torch
import torch.distributed as dist

import data
import freeze
from machinery import cli, datacli, kernels, progress, rundir, tracking
from machinery.progress import PEAK_FLOPS, peak_flops  # noqa: F401 (bench.py reads them from here)
from machinery.rundir import GracefulStop, RunDir, check_savable, code_record, rng_state, set_rng_state
from model import BACKENDS, IGNORE_INDEX, LOSSES, PRESETS, ModernBERT, ModernBERTConfig

# -----------------------------------------------------------------------------
# Configuration: the paper's recipe as typed defaults. `--help` prints these comments.


@dataclass
class Config:
    # what to train, from where, to where
    recipe: str = "demo"  # a scale of RECIPES: paper | demo (a laptop CPU) | smoke | cpu
    phase: str = "mlm"  # a row of PHASES: mlm (the baseline) | clm (the detour) | decay
    init_from: str = "scratch"  # scratch | a Hugging Face directory or hub id | a run of ours
    weights_only: bool = False  # a run of ours as weights alone: fresh optimizer and data position
    preset: str = "base"  # a fresh model's architecture: tiny | mini | small | base | large
    data: str = ""  # a directory written by `python data.py prepare`
    out_dir: str = ""  # default out/<phase> (paper), out/<recipe>-<phase> (the others)
    resume: bool = False  # continue out_dir exactly where it stopped
    max_steps: int = 0  # this invocation stops (saved) after this many steps; 0: the budget
    # the budget and the batch
    tokens: int = 10_000_000_000  # this phase's budget; decay: 0 means 10% of the run it continues
    seq_len: int = 8192  # documents packed into windows of this many tokens
    batch_size: int = 384  # global sequences per optimizer step (the paper's: 3.1M tokens)
    micro_batch_size: int = 4  # sequences per process per forward; 0: batch_size / processes
    # the objective
    objective: str = "mlm"  # set by the phase: mlm, or clm (a causal mask and next-token labels)
    mask_rate: float = 0.3  # MLM's share of tokens predicted (80% [MASK], 10% random, 10% kept); the phase sets it
    separate_documents: bool = False  # no attention across packed documents (the paper allows it)
    freeze: str = ""  # unchanged: blocks 0-7 | 8-14 | 0,2,5 | low | mid; embeddings (tied: output too)
    # the optimizer and the schedule
    lr: float = 2e-4  # peak learning rate
    allow_high_lr: bool = False  # accept an --lr above 1e-2
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.98  # Adam's second-moment decay
    eps: float = 1e-6  # Adam's denominator floor
    weight_decay: float = 1e-5  # decoupled: p *= 1 - (lr_t / lr) * wd, none on biases and norms
    schedule: str = "constant"  # a row of SCHEDULES (the phase sets it: constant, or 1-sqrt for the decay)
    warmup_tokens: int = 100_000_000  # linear warmup from 0 at the start of a schedule
    final_lr_frac: float = 0.1  # a decay's last step's rate, as a share of the peak
    decay_frac: float = 0.1  # wsd: the decay's share of the schedule's budget
    decay_tokens: int = 0  # wsd: the decay's length in tokens; overrides decay_frac when > 0
    schedule_tokens: int = 0  # one schedule's budget (0: --tokens); a later phase may continue it
    grad_clip: float = 1.0  # max global gradient norm (our choice; 0 disables)
    dropout: float = 0.0  # on the attention output projection (our choice)
    seed: int = 17  # training seed: init, masking, dropout
    data_seed: int = 42  # data order, shared by the twins: CLM and MLM see the same sequences
    # validation, checkpoints and logs
    eval_interval: int = 250  # steps between validation losses (and one at the end)
    eval_sequences: int = 64  # fixed validation windows
    save_interval: int = 500  # steps between checkpoints (and one at the end); 0: only at the end
    keep: int = 3  # checkpoints kept in out_dir/checkpoints, newest first
    log_interval: int = 1  # steps between printed lines
    log_to: str = ""  # log.jsonl's records live to tensorboard, wandb and/or trackio too (comma-separated)
    # the model card, out_dir/README.md in Hugging Face's format, rewritten at each save until you edit it
    license: str = ""  # a Hugging Face license id (apache-2.0, mit, ...); empty: none stated
    language: str = ""  # the data's language codes (en, or en,de); empty: none stated
    base_model: str = ""  # a hub id; empty: --init_from's hub id, or the base of the run it continues
    hub_id: str = ""  # where the model will be published (USER/NAME): the card's "Use" loads it; empty: the run folder
    # hardware
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # CPU threads per process; 0: $OMP_NUM_THREADS or idle cores / local processes
    dtype: str = "bfloat16"  # autocast dtype on CUDA (bfloat16 or float32); a CPU runs fp32
    compile: bool = True  # torch.compile each block (CUDA only)
    deterministic: bool = True  # inductor's kernel settings chosen, not timed: --resume repeats bit for bit
    backend: str = "auto"  # attention: auto, or a row of BACKENDS
    loss: str = "plain"  # plain: model.py's cross_entropy as written | fused: the same in row chunks (less memory)
    ddp_timeout: int = 900  # seconds a process waits for the others before the job stops


# torch.compile's backend for the blocks, by device type. A CPU runs them eager: inductor's C++ build takes
# minutes there, for steps that take milliseconds. The tests add a CPU entry that traces without generating code.
COMPILERS = {"cuda": "inductor"}
# Scales: the values a recipe changes. The paper's is the defaults above.
RECIPES = {
    "paper": {},
    "demo": dict(data="data/demo", preset="tiny", seq_len=256, batch_size=16, micro_batch_size=0,
                 tokens=1_250_000, lr=2e-3, warmup_tokens=100_000, eval_interval=50,
                 eval_sequences=16, save_interval=50, log_interval=10, compile=False),
    "smoke": dict(preset="tiny", seq_len=128, batch_size=8, micro_batch_size=0, tokens=100_000,
                  lr=2e-3, warmup_tokens=10_000, eval_interval=5, eval_sequences=8,
                  save_interval=25, log_interval=10, compile=False),
    "cpu": dict(preset="mini", seq_len=256, batch_size=32, micro_batch_size=0, tokens=2_000_000,
                lr=1e-3, warmup_tokens=200_000, eval_interval=25, eval_sequences=16,
                save_interval=50, log_interval=25, compile=False),
}
# Phases: the objective and the schedule. The paper: MLM at 30% or CLM, warmup then constant; then
# the decay, MLM at 15% from the peak down to 10% of it (1-sqrt) over 10% of Phase 1's tokens.
PHASES = {
    "mlm": dict(objective="mlm", mask_rate=0.3, schedule="constant"),
    "clm": dict(objective="clm", schedule="constant"),
    "decay": dict(objective="mlm", mask_rate=0.15, schedule="1-sqrt", warmup_tokens=0, tokens=0),
}
# What a phase hand-off inherits from the run it continues: the same model, data, batch, optimizer,
# validation windows and model card.
INHERITED = ("recipe", "preset", "data", "seq_len", "batch_size", "micro_batch_size", "lr", "beta1",
             "beta2", "eps", "weight_decay", "grad_clip", "dropout", "separate_documents", "seed",
             "data_seed", "dtype", "eval_sequences", "license", "language")
# What a hand-off that continues its parent's schedule inherits too: the schedule's shape.
SCHEDULE_SHAPE = ("warmup_tokens", "final_lr_frac", "decay_frac", "decay_tokens")


def resolve_config(given, saved=None, parent=None):
    """Defaults < recipe < phase < what a hand-off inherits from `parent` < flags. `saved`: a
    resumed run's configuration, which flags may change only where the numbers stay the same."""
    if saved is not None:
        return Config(**flags.resumed_settings(given, saved))
    inherited = {k: v for k, v in parent["config"].items() if k in INHERITED} if parent else {}
    recipe = given.get("recipe", inherited.get("recipe", Config.recipe))
    phase = given.get("phase", Config.phase)
    flags.check_names(dict(recipe=recipe, phase=phase), dict(recipe=RECIPES, phase=PHASES))
    cfg = Config(**{**RECIPES[recipe], **PHASES[phase], **inherited, **given})
    if parent and continues_schedule(cfg, parent["config"]):  # one schedule: one shape
        cfg = dataclasses.replace(cfg, **{k: parent["config"][k] for k in SCHEDULE_SHAPE if k not in given})
    cfg.out_dir = os.path.normpath(cfg.out_dir or rundir.default_dir(cfg.recipe, cfg.phase, cfg.init_from))
    if cfg.tokens == 0 and parent:  # the decay: 10% of the tokens of the run it continues
        cfg.tokens = parent["phase_tokens"] // 10
    return cfg


# -----------------------------------------------------------------------------
# The optimizer and the schedules.


class AdamW:
    """Decoupled AdamW (as Composer's DecoupledAdamW): Adam with bias correction, and weight decay
    scaled by the schedule, not by the learning rate: p *= 1 - (lr_t / peak_lr) * wd. Equal to
    torch.optim.AdamW(weight_decay=wd / peak_lr). Matrices decay; biases and norms (ndim <= 1) do
    not. Parameters named in `frozen` are skipped entirely: no update from stale moments, no
    decay."""

    def __init__(self, groups, peak_lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=1e-5, frozen=()):
        self.groups = [(params, weight_decay if kind == "decay" else 0.0) for kind, params in groups.items()]
        named = [name for params, _ in self.groups for name, _ in params]
        assert len(named) == len(set(named)), "every parameter belongs to exactly one group"
        self.peak_lr, self.betas, self.eps = peak_lr, betas, eps
        self.moments = {name: (torch.zeros_like(p), torch.zeros_like(p))
                        for params, _ in self.groups for name, p in params}
        self.denoms = {name: torch.empty_like(m) for name, (m, _) in self.moments.items()}  # reused
        self.t = 0  # Adam's t: the updates its moments have seen, carried across phases (not a phase's step)
        self.frozen = set(frozen)

    @torch.no_grad()
    def step(self, lr):
        self.t += 1
        beta1, beta2 = self.betas
        bias1, bias2 = 1 - beta1 ** self.t, 1 - beta2 ** self.t
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


# The shape of each schedule after the warmup: a multiplier of the peak for the step that starts t tokens into a
# schedule whose last step starts at token `end`. A shape reaches its final value at t = end: that step is run.
def constant(t, end, cfg):
    return 1.0


def one_minus_sqrt(t, end, cfg):  # from the peak at the first step down to final_lr_frac of it at the last
    return cfg.final_lr_frac + (1 - cfg.final_lr_frac) * (1 - math.sqrt(min(1.0, t / end) if end > 0 else 1.0))


def wsd(t, end, cfg):  # warmup-stable-decay: the peak, then 1-sqrt over the steps of the budget's last decay tokens
    budget = cfg.schedule_tokens or cfg.tokens
    start = min(end, budget - (cfg.decay_tokens or round(cfg.decay_frac * budget)))  # the decay's first step
    return one_minus_sqrt(t - start, end - start, cfg) if t >= start else 1.0


SCHEDULES = {"constant": constant, "1-sqrt": one_minus_sqrt, "wsd": wsd}
# The values these flags accept: the names the tables define, never typed twice.
CHOICES = dict(phase=PHASES, schedule=SCHEDULES, objective=data.OBJECTIVES, backend=("auto", *BACKENDS),
               loss=LOSSES)
FIELDS = flags.checkpoint_fields(Config)  # the settings a checkpoint's config holds


def learning_rate(cfg, t):
    """The learning rate of the step that starts t tokens into the schedule (which may span phases): the warmup
    from 0 at t = 0, times the shape, whose last value is the last step's (a decay ends at its floor)."""
    step = cfg.batch_size * cfg.seq_len
    end = max(0, ((cfg.schedule_tokens or cfg.tokens) // step - 1) * step)  # where the schedule's last step starts
    warmup = min(1.0, t / cfg.warmup_tokens) if cfg.warmup_tokens else 1.0
    return cfg.lr * warmup * SCHEDULES[cfg.schedule](t, end, cfg)


def token_sum(loss, labels):
    """(the summed loss of a batch's labelled tokens, their count), from the batch's mean loss. Summed
    over batches and processes, then divided: the mean over tokens for any batch size and number of
    processes (a mean of batch means weighs a short batch as a full one). Labels stay on the host."""
    n = (labels != IGNORE_INDEX).sum().item()
    return loss.detach().double() * n, n  # no labelled token: the model's loss is 0, and so is this


@torch.no_grad()
def validation_losses(model, data_dir, seq_len, n_sequences, batch_size, device,
                      dtype="bfloat16", doc_sep_id=None, rank=0, world=1):
    """MLM loss at 15% masking and CLM loss on the first n_sequences windows of val.bin, whatever the phase trains, so
    that phases and runs compare on the same numbers: each the mean over every labelled token of those windows, for any
    batch size and number of processes: a collective, in which each of `world` ranks scores every world-th batch."""
    was_training = model.training
    model.eval()  # never a DDP wrapper: its forward may broadcast buffers, which a rank with fewer batches misses
    sums = torch.zeros(2, 2, dtype=torch.float64, device=device)  # per objective: summed loss, labelled tokens
    for i, (objective, rate) in enumerate((("mlm", 0.15), ("clm", 0.0))):
        for x, y in data.val_batches(data_dir, seq_len, n_sequences, batch_size, objective, rate,
                                     rank=rank, world_size=world):
            docs = None if doc_sep_id is None else data.document_ids(x, doc_sep_id).to(device)
            with cli.autocast(device, dtype):
                _, loss = model(x.to(device), labels=y, causal=data.OBJECTIVES[objective].causal, doc_ids=docs)
            summed, n = token_sum(loss, y)
            sums[i, 0] += summed
            sums[i, 1] += n
    model.train(was_training)
    (mlm, n_mlm), (clm, n_clm) = cli.all_reduce(sums, world).tolist()  # every rank's, one with no batch too
    return {"val_mlm": mlm / max(n_mlm, 1), "val_clm": clm / max(n_clm, 1)}


# -----------------------------------------------------------------------------
# Where a run starts, told here once. The flags pick one of four ways (start_point): --resume; else --init_from:
# scratch (a fresh model), a run of ours (a phase hand-off, or its weights alone with --weights_only), anything else
# (a Hugging Face checkpoint's weights). Its row of STARTS says what it carries over: build_model takes the
# weights, restore() Adam's moments and t, the data position and the RNG streams, schedule_start its place in the
# schedule; the run's first lines print all of it. The rest of this section reads and checks.


@dataclass(frozen=True)
class Carries:
    weights: bool  # the model (else a fresh --preset model from --seed)
    moments: bool  # Adam's first and second moments
    adam_t: bool  # Adam's t, which its bias correction counts from
    data_position: bool  # the next window of the data order (else its first)
    rng: bool  # the dropout streams: with the rest, the run goes on bit for bit
    history: bool  # the runs before it; a hand-off adds the one it continues
    phase: bool  # this phase's step, tokens, place in its schedule and run directory: the same phase goes on


STARTS = {  # what each of the four ways carries over
    #                  weights moments adam_t data_position rng    history phase
    "fresh":   Carries(False,  False,  False, False,        False, False,  False),
    "weights": Carries(True,   False,  False, False,        False, False,  False),  # Hugging Face's, or --weights_only
    "handoff": Carries(True,   True,   True,  True,         False, True,   False),  # the next phase of a run of ours
    "resume":  Carries(True,   True,   True,  True,         True,  True,   True),
}


def start_point(given, master, world, local_world):
    """(how, cfg, state, run_dir): how the run starts, its checked configuration, the state it
    starts from (None: a fresh model or a Hugging Face one), and rank 0's run directory, locked."""
    init_from, out_dir = given.get("init_from", Config.init_from), given.get("out_dir", "")
    if given.get("resume"):
        how = "resume"  # everything of out_dir's newest checkpoint, bit for bit
    elif init_from == "scratch":
        how = "fresh"
    elif RunDir.is_run(init_from):  # a run of ours: a hand-off, unless its weights alone
        how = "weights" if given.get("weights_only") else "handoff"
    else:
        how = "weights"  # a Hugging Face checkpoint
    flags.check_weights_only(given, how)
    run_dir = state = None
    if how == "resume":  # its own run directory and newest checkpoint
        run_dir, state = rundir.resume_from(out_dir, master, lambda s: cli.all_gather(s, world)[0], PHASES, FIELDS)
    else:
        state = rundir.newest_state(init_from, PHASES, FIELDS)  # None unless a run of ours
    absent, removed = flags.absent_settings(state, Config, how) if state else ({}, {})  # every rank: added, removed
    if master:
        progress.absent(how, absent, given, INHERITED, removed)  # said once
    if how == "resume":  # the budget may grow, the schedule kept
        cfg = resolve_config({**given, "out_dir": os.path.normpath(out_dir)}, saved=state["config"])
        flags.check_new_budget(Config(**state["config"]), cfg, state, learning_rate)
    else:
        cfg = resolve_config(given, parent=state if how == "handoff" else None)
        if "preset" in given and STARTS[how].weights:  # weights keep their shape: only the checkpoint's own
            flags.check_preset(given["preset"], ModernBERTConfig.read(os.path.join(
                rundir.checkpoint_dir(cfg.init_from, state), "config.json")), cfg.init_from, PRESETS)
        if STARTS[how].data_position:  # it holds for the parent's seq_len and seeds only
            flags.check_handoff(cfg, state["config"])
        cfg.base_model = cfg.base_model or progress.base_model(cfg.init_from, state)  # the card's
    flags.check_all(cfg, how, state, Config, CHOICES, world, given)  # phases, device, backend, schedule, trackers
    cfg.threads = cli.pick_threads(cfg.threads, local_world)
    if master and not STARTS[how].phase:  # a new phase: a run directory of its own
        run_dir = RunDir.create(cfg.out_dir, locked=True)
    return how, cfg, state, run_dir


def continues_schedule(cfg, parent):
    """Whether a hand-off continues its parent's schedule (`parent`: its configuration): the same
    --schedule over the same --schedule_tokens."""
    return bool(cfg.schedule_tokens) and \
        (parent["schedule"], parent["schedule_tokens"]) == (cfg.schedule, cfg.schedule_tokens)


def schedule_start(cfg, how, state):
    """Tokens of the schedule already run: a hand-off that continues its parent's schedule goes on
    from where it stopped (no second warmup, one decay at the end); anything else starts it."""
    if STARTS[how].phase:
        return state["schedule_tokens_done"] - state["phase_tokens"]
    if how != "handoff" or not continues_schedule(cfg, state["config"]):
        return 0
    flags.check_schedule_fits(cfg, state["schedule_tokens_done"])
    return state["schedule_tokens_done"]


def fresh_config(cfg, meta):
    """A fresh model's architecture: --preset's, with the data's vocabulary and special ids."""
    vocab = -(-meta["vocab_size"] // 64) * 64  # a multiple of 64 keeps the decoder matmul fast
    return ModernBERTConfig.from_preset(cfg.preset, vocab_size=vocab, **{f"{t}_token_id": meta[f"{t}_id"]
                                                                         for t in ("pad", "cls", "sep", "mask")})


def build_model(cfg, how, state, meta, device):
    """The model, its configuration checked against the data before any weight is loaded. A model from a
    checkpoint keeps the checkpoint's architecture, as its weights do; where this code would build another (an
    edited window, activation, ...), the start says so."""
    source = rundir.checkpoint_dir(cfg.init_from, state) if STARTS[how].weights else None
    if source is None:
        config = fresh_config(cfg, meta)
    else:
        config = ModernBERTConfig.read(os.path.join(source, "config.json"))
    flags.check_data_fits_model(meta, config, cfg, source if state else None)
    torch.manual_seed(cfg.seed)  # the same init on every rank
    model = ModernBERT(config.replace(attention_dropout=cfg.dropout), cfg.backend, cfg.loss)
    if source is not None:
        model.load_weights(os.path.join(source, "model.safetensors"))
    return model.to(device), source


def restore(carries, state, optimizer, loader, device, rank):
    """Restores a row of STARTS but the weights; returns (phase step, phase tokens, the runs before this)."""
    if carries.moments:
        rundir.load_moments(optimizer.moments, state["dir"], device)
    if carries.adam_t:
        optimizer.t = state["adam_t"]
    if carries.data_position:
        loader.load_state_dict(state["loader"], f"{state['dir']}/state.json: loader")
    if carries.rng:  # the dropout streams
        set_rng_state(state["rng"][rank], device)
    history = state["history"] if carries.history else []
    if carries.phase:
        return state["phase_step"], state["phase_tokens"], history
    if carries.history:  # the run it continues comes before it
        history = history + [dict(phase=state["phase"], tokens=state["phase_tokens"], dir=state["dir"])]
    return 0, 0, history


# -----------------------------------------------------------------------------
# The run: processes, setup, the loop, checkpoints.


def across_ranks(loss_sum, labelled, stop_requested, grad_norm):
    """(the step's mean loss over every rank's labelled tokens, whether any rank was asked to stop, the gradient
    norm), as Python numbers. Every rank must stop at the same step (one that went on would wait forever in the
    next all-reduce): each adds 1 if a signal reached it, and a sum above 0 stops them all. The stop rides in the
    loss's all-reduce, the norm (the same on every rank) in its copy to the host: one collective and one host sync
    a step. The host's two numbers reach the device in one pinned copy that does not wait for it."""
    host = torch.tensor([labelled, float(stop_requested)], dtype=loss_sum.dtype, pin_memory=loss_sum.is_cuda)
    shared = torch.cat([loss_sum[None], host.to(loss_sum.device, non_blocking=True)])
    if dist.is_initialized():
        dist.all_reduce(shared)  # sums: the loss, the labelled tokens, the ranks asked to stop
    total, labelled, asked, norm = torch.cat([shared, grad_norm.double()[None]]).tolist()
    return total / max(labelled, 1), asked > 0, norm


def setup(given):
    """Everything before the first step: processes, where we start, data, model, optimizer."""
    rank, world, local_world, device = cli.init_processes(  # torchrun's processes met, each on its device
        given.get("device", Config.device), flags.ddp_timeout(given.get("ddp_timeout", Config.ddp_timeout)))
    how, cfg, state, run_dir = start_point(given, rank == 0, world, local_world)
    torch.set_num_threads(cfg.threads)
    if cfg.recipe == "demo" and cfg.data == RECIPES["demo"]["data"] and rank == 0:
        datacli.ensure_demo(data.prepare, cfg.data)  # built here when missing: no download
    cli.all_gather(None, world)  # a barrier: the other ranks wait for the demo corpus
    meta = data.load_meta(cfg.data)
    tokenizer = data.load_tokenizer(meta["tokenizer"])
    data.check_tokenizer(meta, tokenizer)
    micro = cfg.micro_batch_size or cfg.batch_size // world
    loader = data.Loader(cfg.data, "train", cfg.seq_len, cfg.batch_size, micro, rank, world,
                         cfg.objective, cfg.mask_rate, cfg.data_seed, cfg.seed, device=device)
    model, source = build_model(cfg, how, state, meta, device)
    cfg.preset = flags.preset_of(model.config, PRESETS)  # the architecture that runs, recorded as what it is
    flags.check_val_split(cfg, data.count_windows(cfg.data, "val", cfg.seq_len))
    frozen = freeze.frozen_names(model, freeze.parse_layers(cfg.freeze, model.config.num_hidden_layers))
    optimizer = AdamW(model.param_groups(), cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay, frozen)
    same_world = how != "resume" or len(state["rng"]) == world  # each process's RNG streams were saved: another
    carries = STARTS[how] if same_world else dataclasses.replace(STARTS[how], rng=False)  # number restarts them
    torch.manual_seed(cfg.seed + rank)  # dropout streams differ across ranks; a resume restores its own next
    phase_step, phase_tokens, history = restore(carries, state, optimizer, loader, device, rank)
    start = schedule_start(cfg, how, state)
    if rank == 0:
        progress.start(how, carries, cfg, phase_step, source, state, start, learning_rate)
        progress.architecture(model.config, source, source and flags.unlike_fresh(
            model.config, lambda preset: fresh_config(dataclasses.replace(cfg, preset=preset), meta), PRESETS))
    kernels.deterministic_compiler(cfg.deterministic, device)  # before anything compiles: what --resume promises
    if cfg.compile and device.type in COMPILERS:
        kernels.compile_blocks(model, COMPILERS[device.type])
    # no device_ids: DDP would move the labels to the GPU, but the model reads them on the host
    ddp_model = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    tracker = tracking.Trackers(cfg.log_to if run_dir else "", cfg.out_dir, run_dir and run_dir.run_id,
                                dataclasses.asdict(cfg), phase_step + 1 if STARTS[how].phase else 0)  # logged anew
    return progress.Run(cfg=cfg, how=how, model=model, ddp_model=ddp_model, optimizer=optimizer, loader=loader,
                        objective=data.OBJECTIVES[cfg.objective], frozen=frozen, meta=meta, tokenizer=tokenizer,
                        run_dir=run_dir, tracker=tracker, device=device, rank=rank, world=world,
                        accum=cfg.batch_size // (micro * world), phase_step=phase_step, phase_tokens=phase_tokens,
                        schedule_start=start, history=history, **code_record(state if how == "resume" else None))


def train(r):
    """The loop. A step: micro-batches whose gradients accumulate, the frozen blocks' gradients zeroed, the gradient
    clipped, one AdamW step; then its record is logged, and the model validated and saved at their intervals
    (log_and_save). Returns (budget steps, the signal that stopped it (Ctrl-C's SIGINT, SIGTERM) or None, seconds)."""
    cfg, model, params = r.cfg, r.model, list(r.model.parameters())
    per_step = cfg.batch_size * cfg.seq_len
    total_steps = cfg.tokens // per_step
    stop_at = min(total_steps, r.phase_step + cfg.max_steps) if cfg.max_steps else total_steps
    check_savable(checkpoint_state(r, []), max(0, total_steps - r.phase_step), per_step, FIELDS)  # before any step
    if r.rank == 0:
        progress.plan(r, total_steps)
    objective = r.objective  # the Run record looked it up once
    predicted = cfg.mask_rate if objective.masked else 1.0  # the share of positions through the head
    flops = model.flops_per_token(cfg.seq_len, objective.causal, predicted)
    peak = peak_flops(r.device)
    first_step, t_start, anyone_stopping = r.phase_step, time.time(), False
    if r.phase_step == 0 and STARTS[r.how].weights:  # a continued run's curve starts at its start
        progress.start_line(r, validate(r, dict(phase=cfg.phase, step=0, tokens=0)))  # every rank validates
    with GracefulStop() as signals:
        while r.phase_step < stop_at and not anyone_stopping:
            t0 = time.time()
            lr = learning_rate(cfg, r.schedule_start + r.phase_tokens)
            loss_sum, labelled = torch.zeros((), dtype=torch.float64, device=r.device), 0
            for micro in range(r.accum):
                if dist.is_initialized():  # all-reduce gradients on the last micro-step only: what DDP's
                    r.ddp_model.require_backward_grad_sync = micro == r.accum - 1  # no_sync() does, as a flag
                x, y = r.loader.next()  # (micro, T) ids on the device, labels on the host
                docs = data.document_ids(x, r.meta["sep_id"]) if cfg.separate_documents else None
                with cli.autocast(r.device, cfg.dtype):
                    _, loss = r.ddp_model(x, labels=y, causal=objective.causal, doc_ids=docs)
                # The gradient is the mean of the micro-batch means, as it always was: weighting it
                # by tokens would change every trained number. Only the logged loss is per token.
                (loss / r.accum).backward()
                r.loader.prefetch()  # the next micro-batch, prepared while the device works
                summed, n = token_sum(loss, y)
                loss_sum, labelled = loss_sum + summed, labelled + n
            freeze.zero_frozen_grads(model, r.frozen)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf)  # 0: the norm, unclipped
            # the step's loss over every rank's tokens, and whether any rank got Ctrl-C or SIGTERM: one all-reduce
            lossf, anyone_stopping, norm = across_ranks(loss_sum, labelled, signals.requested, grad_norm)
            flags.check_finite(lossf, norm, r.phase_step + 1, cfg)  # before the weights change
            r.optimizer.step(lr)
            for p in params:
                p.grad = None
            r.phase_step, r.phase_tokens = r.phase_step + 1, r.phase_tokens + per_step
            record = progress.record(r, lossf, lr, norm, time.time() - t0, flops, peak)
            eta = (time.time() - t_start) / (r.phase_step - first_step) * (stop_at - r.phase_step)
            log_and_save(r, record, total_steps, stop_at, anyone_stopping, eta, r.phase_step == first_step + 1)
    stopped_by = (signals.signal_name or "SIGINT") if anyone_stopping else None  # another rank's: Ctrl-C, likely
    return total_steps, stopped_by, time.time() - t_start


def log_and_save(r, record, total_steps, stop_at, stopping, eta, first):
    """After a step: its record in the log and the trackers; the validation losses every eval_interval steps and at
    the end of the budget; a checkpoint every save_interval steps, where this invocation stops, and when a signal
    stops the run (a save is a collective: every rank comes here); the printed line every log_interval steps, with
    each validation, and at this invocation's first and last step."""
    cfg, step = r.cfg, r.phase_step
    if r.run_dir:  # before the save, so that the log and the checkpoint agree
        r.run_dir.append_log(record)
        r.tracker.log(record)
    if step % cfg.eval_interval == 0 or step == total_steps:  # every rank: each scores its share
        record.update(validate(r, {k: record[k] for k in ("phase", "step", "tokens")}))
    if step == stop_at or stopping or (cfg.save_interval and step % cfg.save_interval == 0):
        save(r)
    if r.rank == 0 and (step % cfg.log_interval == 0 or "val_mlm" in record or step == stop_at or first):
        progress.step_line(cfg, record, total_steps, eta)


def validate(r, record):
    """The validation losses, added to `record` (phase, step, tokens), logged and tracked (rank 0)."""
    cfg = r.cfg
    sep_id = r.meta["sep_id"] if cfg.separate_documents else None
    record = {**record, **validation_losses(r.model, cfg.data, cfg.seq_len, cfg.eval_sequences,
                                            r.loader.micro_batch_size, r.device, cfg.dtype, sep_id, r.rank, r.world)}
    if r.run_dir:  # rank 0: in the checkpoint's log too
        r.run_dir.append_log(record)
        r.tracker.log(record)
    return record


def checkpoint_state(r, rng):
    """What a checkpoint's state.json holds now (rng: every rank's RNG states)."""
    return dict(phase=r.cfg.phase, adam_t=r.optimizer.t, phase_step=r.phase_step, phase_tokens=r.phase_tokens,
                total_tokens=sum(h["tokens"] for h in r.history) + r.phase_tokens, tokenizer=r.meta["tokenizer"],
                schedule_tokens_done=r.schedule_start + r.phase_tokens, loader=r.loader.state_dict(), rng=rng,
                config=dataclasses.asdict(r.cfg), code=r.code, earlier_code=r.earlier_code, history=r.history)


def save(r):
    """A checkpoint of all a resume needs, and the model card. all_gather is a collective: every rank comes here."""
    state = checkpoint_state(r, cli.all_gather(rng_state(r.device), r.world))
    if r.run_dir:
        r.run_dir.save(r.model, r.optimizer.moments, state, r.tokenizer, r.cfg.keep)
        progress.saved(r, learning_rate)  # its loss picture and model card: warnings if they fail


def main(argv=None):
    given, wants_help = flags.parse(sys.argv[1:] if argv is None else argv, Config)
    if wants_help:  # every flag with its default under the recipe and phase given, and its meaning
        return print(flags.help_text(Config, resolve_config({k: given[k] for k in ("recipe", "phase") if k in given}),
                                     __doc__))
    with rundir.undone_if_refused():  # a start stopped before its first record takes back the folder it made
        r = setup(given)
        with r.tracker, flags.out_of_memory_explained(r):  # the sizes a step tried, and what to lower
            total_steps, stopped_by, elapsed = train(r)
    cli.all_gather(None, r.world)  # a barrier: nobody tears the process group down while rank 0 saves
    progress.finish(r, total_steps, stopped_by, elapsed, learning_rate)  # the summary, the lock let go; a Stop
if __name__ == "__main__":
    cli.run(main)
