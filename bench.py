"""
Benchmarks (not tests): numbers to quote, medians of a few repeats, each against a peer in the same run.

    python bench.py train [--presets base,large] [--phases clm,mlm] [--seq_lens 8192,1024] [--micro_tokens 8192,16384,32768]
    python bench.py data [--corpus PATH] [--tokenizer PATH] [--threads N] [--repeats R]

train: full training steps (forward, backward, optimizer) of our model and of transformers'
ModernBertForMaskedLM with its fastest available attention and the same optimizer, on the same
weights and batches: tokens/s, MFU (model.flops_per_token), peak memory, and the ratio to the peer.
On a CPU it runs the tiny preset, so CI exercises it.
data: tokenizer throughput against Hugging Face `tokenizers` on the same threads (and whether the ids agree),
`prepare` end to end, and the loader's MLM batches of 8192-token sequences on one core.
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parent.parent / "shared"


def timed(fn, repeats):
    """(median seconds, last result) of fn() over `repeats` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def bench_data(args):
    # the Rust thread pool reads these when `tokenizers` first runs: set them before importing it
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    import torch
    from tokenizers import Tokenizer as HFTokenizer  # a test oracle, never a dependency of data.py

    import data

    texts = [json.loads(line)["text"] for line in open(args.corpus, encoding="utf-8")]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"corpus {args.corpus}: {len(texts):,} documents, {mb:.1f} MB of text; {args.threads} threads, "
          f"median of {args.repeats}")

    ours, hf = data.load_tokenizer(args.tokenizer), HFTokenizer.from_file(str(args.tokenizer))
    t_ours, ids_ours = timed(lambda: ours.encode_batch(texts, num_threads=args.threads), args.repeats)
    t_one, _ = timed(lambda: ours.encode_batch(texts, num_threads=1), args.repeats)
    t_hf, ids_hf = timed(lambda: [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)], args.repeats)
    same = sum(a == b for a, b in zip(ids_ours, ids_hf))
    print(f"encode_batch  data.py {mb / t_ours:6.2f} MB/s ({mb / t_one:.2f} on 1 thread) | HF tokenizers "
          f"{mb / t_hf:6.2f} MB/s | ratio {t_hf / t_ours:.2f}x | identical ids {same}/{len(texts)}")

    with tempfile.TemporaryDirectory() as tmp:
        t_prep, meta = timed(lambda: data.prepare([args.corpus], str(args.tokenizer), Path(tmp) / "d",
                                                  workers=args.threads), args.repeats)
        print(f"prepare       {mb / t_prep:6.2f} MB/s of text end to end ({meta['splits']['train']['tokens']:,} "
              f"train tokens)")

        # the loader on one core, as each training process has its own
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        torch.set_num_threads(1)
        loader = data.Loader(Path(tmp) / "d", seq_len=8192, batch_size=4, micro_batch_size=4, objective="mlm",
                             mask_rate=0.3)
        n = 20
        t_load, _ = timed(lambda: [loader.next() for _ in range(n)], args.repeats)
        print(f"Loader        {n * 4 * 8192 / t_load / 1e6:6.2f} M tokens/s (MLM 30%, 4 x 8192 per micro-batch, "
              f"{t_load / n * 1e3:.1f} ms each, one core)")


# ----------------------------------------------------------------------------
# Training steps: ours against transformers


def batch(vocab, micro, seq_len, phase, device, seed=0):
    """Random ids and labels: MLM labels 30% of positions, CLM labels the next token."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab - 100, (micro, seq_len), generator=g)  # the top ids are the special tokens
    if phase == "clm":
        y = torch.cat([x[:, 1:], torch.full((micro, 1), -100)], 1)
    else:
        y = torch.where(torch.rand(micro, seq_len, generator=g) < 0.3, x, -100)
    return x.to(device), y.to(device)


def causal_masks(seq_len, window, device):
    """transformers has no causal mode; its ModernBERT takes explicit masks per layer type (True = attend)."""
    import torch
    i = torch.arange(seq_len, device=device)
    causal = i[None, :] <= i[:, None]
    return {"full_attention": causal[None, None], "sliding_attention": (causal & (i[:, None] - i[None, :] <= window))[None, None]}


def time_steps(step, device, warmup, steps):
    """Median seconds of `steps` calls after `warmup`, synchronising the GPU around each; peak memory in GB."""
    import torch
    for _ in range(warmup):
        step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None)


def measure(args, preset, phase, seq_len, micro):
    """One row: ours and the peer on the same weights, batch and optimizer."""
    import contextlib

    import torch
    import transformers

    from model import ModernBERT, ModernBERTConfig
    from train import AdamW, peak_flops

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = ModernBERTConfig.from_preset(preset)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    x, y = batch(cfg.vocab_size, micro, seq_len, phase, device)
    causal = phase == "clm"
    ours = ModernBERT(cfg, args.backend).to(device)
    weights = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    row = dict(preset=preset, phase=phase, seq_len=seq_len, micro=micro, tokens=micro * seq_len,
               backend=ours.attention_backend(device))
    flops = ours.flops_per_token(seq_len, causal, 1.0 if causal else 0.3)
    peak = peak_flops(device)

    def run(model, forward, name):
        opt = AdamW(ModernBERT.param_groups(model), 2e-4)

        def step():
            with autocast:
                loss = forward(model)
            loss.backward()
            opt.step(2e-4)
            for p in model.parameters():
                p.grad = None
        try:
            seconds, memory = time_steps(step, device, args.warmup, args.steps)
        except torch.cuda.OutOfMemoryError:
            row[name] = "OOM"
            return
        row[name] = dict(tokens_per_s=micro * seq_len / seconds, ms=seconds * 1e3, memory_gb=memory,
                         mfu=flops * micro * seq_len / seconds / peak if peak else None)

    # ours
    with torch.no_grad(), autocast:
        row["loss_ours"] = ours.eval()(x, labels=y, causal=causal)[1].item()
    if args.compile and device.type == "cuda":
        for block in ours.model.layers:
            block.compile()
    run(ours.train(), lambda m: m(x, labels=y, causal=causal)[1], "ours")
    del ours

    # the peer: same weights; sparse prediction for MLM (its own fastest setting); explicit masks for CLM
    attn = args.peer_attention
    if attn == "auto":
        flash = device.type == "cuda" and __import__("importlib").util.find_spec("flash_attn") is not None
        attn = "flash_attention_2" if flash and not causal else "sdpa"
    hf_cfg = transformers.ModernBertConfig(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures",
                                           "model_type", "layer_types", "rope_parameters", "mask_token_id")},
                                           sparse_prediction=not causal, attn_implementation=attn)
    peer = transformers.ModernBertForMaskedLM(hf_cfg).to(device)
    peer.load_state_dict(weights)
    masks = causal_masks(seq_len, cfg.window, device) if causal else None
    row["peer_attention"] = attn
    with torch.no_grad(), autocast:
        row["loss_peer"] = peer.eval()(input_ids=x, labels=y, attention_mask=masks).loss.item()
    run(peer.train(), lambda m: m(input_ids=x, labels=y, attention_mask=masks).loss, "peer")
    del peer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_train(args):
    import torch
    cpu = args.device == "cpu"
    presets = args.presets or (["tiny"] if cpu else ["base", "large"])
    seq_lens = args.seq_lens or ([256] if cpu else [8192, 1024])
    micro_tokens = args.micro_tokens or ([512] if cpu else [8192, 16384, 32768])
    print(f"torch {torch.__version__}, device {args.device}"
          f"{' (' + torch.cuda.get_device_name(args.device) + ')' if not cpu else ''}, "
          f"{args.warmup} warm-up + median of {args.steps} steps, compile={args.compile and not cpu}")
    head = (f"{'preset':6} {'phase':5} {'seq':>5} {'micro':>5} {'attn':>5} | {'ours tok/s':>11} {'MFU':>6} {'GB':>6} | "
            f"{'peer tok/s':>11} {'MFU':>6} {'GB':>6} {'peer attn':>17} | {'ratio':>6} | {'loss ours':>9} {'peer':>9}")
    print(head + "\n" + "-" * len(head))
    rows = []
    for preset in presets:
        for seq_len in seq_lens:
            for phase in args.phases:
                for tokens in micro_tokens:
                    row = measure(args, preset, phase, seq_len, max(1, tokens // seq_len))
                    rows.append(row)
                    print(format_row(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def format_row(r):
    def cells(m):
        if not isinstance(m, dict):
            return f"{m or '-':>11} {'':>6} {'':>6}"
        mfu = f"{m['mfu']:.1%}" if m["mfu"] is not None else "-"
        gb = f"{m['memory_gb']:.1f}" if m["memory_gb"] is not None else "-"
        return f"{m['tokens_per_s']:>11,.0f} {mfu:>6} {gb:>6}"
    ratio = (f"{r['ours']['tokens_per_s'] / r['peer']['tokens_per_s']:.2f}x"
             if isinstance(r["ours"], dict) and isinstance(r["peer"], dict) else "-")
    return (f"{r['preset']:6} {r['phase']:5} {r['seq_len']:>5} {r['micro']:>5} {r['backend']:>5} | {cells(r['ours'])} | "
            f"{cells(r['peer'])} {r['peer_attention']:>17} | {ratio:>6} | {r['loss_ours']:>9.4f} {r['loss_peer']:>9.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    csv = lambda kind: lambda text: [kind(v) for v in text.split(",")]  # noqa: E731
    t = sub.add_parser("train", help="training steps of our model against transformers' ModernBertForMaskedLM")
    t.add_argument("--device", default="cuda" if __import__("torch").cuda.is_available() else "cpu")
    t.add_argument("--presets", type=csv(str), help="default base,large on GPU, tiny on CPU")
    t.add_argument("--phases", type=csv(str), default=["clm", "mlm"])
    t.add_argument("--seq_lens", type=csv(int), help="default 8192,1024 on GPU, 256 on CPU")
    t.add_argument("--micro_tokens", type=csv(int), help="tokens per micro-batch, the sweep (default 8192,16384,32768)")
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--compile", type=lambda v: v.lower() in ("1", "true", "yes"), default=True,
                   help="torch.compile our blocks (CUDA only), as train.py does")
    t.add_argument("--backend", default="auto", help="our attention backend: auto, flash, flex, sdpa")
    t.add_argument("--peer_attention", default="auto", help="transformers attn_implementation (auto: fastest available)")
    t.add_argument("--json", help="also write the rows to this file")
    t.set_defaults(run=bench_train)
    p = sub.add_parser("data", help="tokenizer, prepare and loader throughput")
    p.add_argument("--corpus", type=Path, default=SHARED / "data" / "corpus" / "e3c_en_clinical_cases.jsonl")
    p.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "modernbert" / "tokenizer.json")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(run=bench_data)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
