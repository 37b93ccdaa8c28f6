"""What a training run prints and logs: where it starts and its plan, a record and a line per step (with
MFU against a per-GPU peak), and the summary at the end. A reader of the recipe may skip this file."""
import dataclasses
import json
import sys

import torch

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s per GPU, for MFU


def peak_flops(device):
    """The GPU's dense bf16 peak from PEAK_FLOPS, or None (a CPU, an unknown GPU: no MFU)."""
    if device.type != "cuda":
        return None
    return next((v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name(device)), None)


def start(how, cfg, step, source):
    """The one line that says how the run starts and what it carries over."""
    print({"resume": f"resume {cfg.out_dir} at phase step {step}: weights, Adam moments, step counter, "
                     f"schedule, data position and RNG states",
           "handoff": f"phase hand-off from {source}: weights, Adam moments, step counter and data position",
           "weights": f"weights from {source}; a fresh optimizer, and the data from its first sequence",
           "fresh": f"a fresh {cfg.preset} model (seed {cfg.seed})"}[how])


def plan(r, total_steps):
    """The resolved configuration, versions, device, model, objective, schedule and batch arithmetic."""
    cfg = r.cfg
    per_step = cfg.batch_size * cfg.seq_len
    epochs = total_steps * per_step / (r.loader.n_windows * cfg.seq_len)
    gpu = f" ({torch.cuda.get_device_name(r.device)})" if r.device.type == "cuda" else ""
    print(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, device {r.device}{gpu}, {r.world} "
          f"process(es), {torch.get_num_threads()} CPU thread(s) each (--threads)")
    print(f"model: {r.model.num_params():,} parameters, attention: {r.model.attention_backend(r.device)}")
    objective = "CLM, causal mask" if cfg.objective == "clm" else f"MLM at {cfg.mask_rate:.0%}, bidirectional"
    print(f"recipe {cfg.recipe}, phase {cfg.phase}: {objective}; schedule {cfg.schedule} over "
          f"{cfg.schedule_tokens or cfg.tokens:,} tokens, this phase from token {r.schedule_start:,} of it; "
          f"frozen blocks: {cfg.freeze or 'none'}")
    print(f"batch: {cfg.batch_size} sequences = {cfg.batch_size // r.accum // r.world} micro x {r.accum} "
          f"accumulation x {r.world} process(es); {per_step:,} tokens/step; {total_steps:,} steps = "
          f"{total_steps * per_step:,} tokens, {epochs:.2f} epochs of {cfg.data}")
    if epochs > 4:
        print(f"warning: the budget is {epochs:,.0f} epochs of {cfg.data}: the model will memorise it; lower "
              f"--tokens or prepare more data")


def record(r, loss, lr, grad_norm, seconds, flops, peak):
    """The log record of the step just taken; `flops` per token, `peak` per GPU (None: no MFU)."""
    per_step = r.cfg.batch_size * r.cfg.seq_len
    mfu = round(flops * per_step / seconds / r.world / peak, 4) if peak else None
    return dict(phase=r.cfg.phase, step=r.step, tokens=r.phase_tokens, loss=round(loss, 5), lr=lr,
                grad_norm=round(grad_norm, 4), ms=round(seconds * 1000, 1), tokens_per_s=round(per_step / seconds),
                mfu=mfu)


def step_line(cfg, record, total_steps, eta):
    val = f" | val mlm {record['val_mlm']:.4f} clm {record['val_clm']:.4f}" if "val_mlm" in record else ""
    mfu = f" | MFU {record['mfu']:.1%}" if record["mfu"] is not None else ""
    print(f"{cfg.phase} step {record['step']}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
          f"grad {record['grad_norm']:.3f} | {record['ms']:.0f} ms | {record['tokens_per_s']:,} tok/s{mfu}{val} | "
          f"eta {duration(eta)}")


def duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def summary(r, total_steps, signalled, elapsed):
    """How the run ended; for a finished phase, its last validation losses, where the model is, and the
    commands that use it and continue it."""
    cfg, out = r.cfg, r.cfg.out_dir
    print("-" * 100)
    if signalled or r.step < total_steps:
        why = "interrupted by a signal" if signalled else "--max_steps"
        print(f"stopped at step {r.step} of {total_steps} ({why}) after {duration(elapsed)}; saved. Continue "
              f"with:\n    python train.py --resume --out_dir={out}")
        return
    val = {}
    with open(r.run_dir.log_path) as f:
        for line in f:
            val.update({k: v for k, v in json.loads(line).items() if k.startswith("val_")})
    print(f"done: phase {cfg.phase} (recipe {cfg.recipe}), {r.phase_tokens:,} tokens in {r.step} steps, "
          f"{duration(elapsed)} this invocation; validation MLM {val.get('val_mlm', float('nan')):.4f}, "
          f"CLM {val.get('val_clm', float('nan')):.4f}\n"
          f"the model:  {out}/ (a Hugging Face directory: config.json, model.safetensors, tokenizer files)\n"
          f"its losses: {out}/loss.png (picture) and {out}/log.jsonl\n"
          f"use it:     python -c \"from transformers import pipeline; "
          f"print(pipeline('fill-mask', model='{out}')('Return the [MASK] of the list.'))\"")
    rest = (cfg.schedule_tokens or cfg.tokens) - r.schedule_start - r.phase_tokens
    if rest > 0:  # the schedule goes on in a later phase: a hand-off continues it (MLM after CLM, as the study)
        mlm = f"--phase=mlm --mask_rate={cfg.mask_rate}" if cfg.objective == "mlm" else "--phase=mlm"
        print(f"next:       python train.py {mlm} --init_from={out} --schedule={cfg.schedule} "
              f"--schedule_tokens={cfg.schedule_tokens} --tokens={rest}   # the rest of its schedule")
    elif cfg.phase != "decay" and cfg.schedule == "constant":  # a decay-free phase: the paper's recipe decays it
        print(f"next:       python train.py --phase=decay --init_from={out}   # the short MLM decay")
