"""
Benchmarks (not tests): numbers to quote, medians of a few repeats, each against a peer in the same run.

    python bench.py train [--presets base,large] [--phases clm,mlm] [--seq_lens 8192,1024] [--micro_tokens 8192,16384,32768]
    python bench.py data [--corpus PATH] [--tokenizer PATH] [--threads N] [--repeats R]

train: full training steps (forward, backward, optimizer) of our model and of transformers'
ModernBertForMaskedLM with its fastest available attention and the same optimizer, on the same
weights and batches, the two models' steps interleaved so that a busy machine slows both alike:
tokens/s, MFU (model.flops_per_token), the step's memory above the resident weights, and the ratio
to the peer. On a CPU it runs tiny and base at 2 x 256 tokens, so CI exercises it. It also prints,
labelled as a prediction, the activation memory of the paper's setting (base, 8192 tokens, micro-batch 4).
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


def interleaved(steps, device, warmup, repeats):
    """Median seconds per step of each function, called in turn (a, b, a, b, ...) so that load from other
    processes hits all alike; on CUDA also the step's peak memory above what was allocated before it, in GB."""
    import torch
    cuda = device.type == "cuda"
    times, memory = [[] for _ in steps], [0.0 for _ in steps]
    for i in range(warmup + repeats):
        for k, step in enumerate(steps):
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize(device)
                memory[k] = max(memory[k], (torch.cuda.max_memory_allocated(device) - before) / 1e9)
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return [(statistics.median(t), m if cuda else None) for t, m in zip(times, memory)]


def measure(args, preset, phase, seq_len, micro):
    """One row: ours and the peer on the same weights, batch and optimizer, their steps interleaved."""
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
    row = dict(preset=preset, phase=phase, seq_len=seq_len, micro=micro, tokens=micro * seq_len,
               backend=ours.attention_backend(device))
    flops = ours.flops_per_token(seq_len, causal, 1.0 if causal else 0.3)
    peak = peak_flops(device)

    # the peer: same weights; sparse prediction for MLM (its own fastest setting); explicit masks for CLM
    attn = args.peer_attention
    if attn == "auto":
        flash = device.type == "cuda" and __import__("importlib").util.find_spec("flash_attn") is not None
        attn = "flash_attention_2" if flash and not causal else "sdpa"
    hf_cfg = transformers.ModernBertConfig(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures",
                                           "model_type", "layer_types", "rope_parameters", "mask_token_id")},
                                           sparse_prediction=not causal, attn_implementation=attn)
    peer = transformers.ModernBertForMaskedLM(hf_cfg).to(device)
    peer.load_state_dict(ours.state_dict())
    masks = causal_masks(seq_len, cfg.window, device) if causal else None
    row["peer_attention"] = attn
    forwards = {"ours": lambda: ours(x, labels=y, causal=causal)[1],
                "peer": lambda: peer(input_ids=x, labels=y, attention_mask=masks).loss}
    for name, model in (("ours", ours), ("peer", peer)):
        with torch.no_grad(), autocast:
            row[f"loss_{name}"] = forwards[name]().item()
        model.train()
    if args.compile:
        for block in ours.model.layers:  # regional compilation, as train.py does
            block.compile()

    def training_step(model, forward):
        opt = AdamW(ModernBERT.param_groups(model), 2e-4)

        def step():
            with autocast:
                loss = forward()
            loss.backward()
            opt.step(2e-4)
            for p in model.parameters():
                p.grad = None
        return step

    try:
        results = interleaved([training_step(ours, forwards["ours"]), training_step(peer, forwards["peer"])],
                              device, args.warmup, args.steps)
    except torch.cuda.OutOfMemoryError:
        results = None
    for name, result in zip(("ours", "peer"), results or [None, None]):
        if result is None:
            row[name] = "OOM"
            continue
        seconds, memory = result
        row[name] = dict(tokens_per_s=micro * seq_len / seconds, ms=seconds * 1e3, memory_gb=memory,
                         mfu=flops * micro * seq_len / seconds / peak if peak else None)
    del ours, peer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def activation_memory(cfg, seq_len, micro, mask_rate=0.3):
    """PREDICTION, on paper: bytes kept for backward in one micro-batch under bf16 autocast with the flash
    backend (nothing quadratic in seq_len). Per token and block: the fp32 block input and mlp_norm input
    (4d + 4d), the bf16 copies Wqkv and Wi read (2d + 2d), qkv (6d, alive through v), rotated q and k (2d + 2d),
    the attention output (2d) and its log-sum-exp (4H), Wi's output (4I, alive through GELU's input and the
    gate), GELU's output (2I) and mlp.Wo's input (2I): 24d + 8I + 4H bytes, less 4d in block 0 (no attn_norm).
    Plus the embeddings and final_norm (12d per token), the head on the predicted rows (12d) and the loss's
    fp32 weight gradient. tests/test_backends.py checks the per-token part against autograd's saved tensors."""
    d, i, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    tokens = seq_len * micro
    per_token = cfg.num_hidden_layers * (24 * d + 8 * i + 4 * h) - 4 * d + 12 * d + mask_rate * 12 * d
    return tokens * per_token + 4 * cfg.vocab_size * d


def print_prediction():
    from model import ModernBERTConfig
    cfg = ModernBERTConfig.from_preset("base")
    for phase, rate in (("mlm", 0.3), ("clm", 1.0)):
        gb = activation_memory(cfg, 8192, 4, rate) / 2 ** 30
        params = 149_655_232 * (4 + 4 + 8) / 2 ** 30  # fp32 weights, gradients, two Adam moments
        print(f"PREDICTION (on paper, not measured): base {phase}, 4 x 8192 tokens, bf16 autocast, flash backend: "
              f"activations {gb:.1f} GiB + weights, gradients and Adam moments {params:.1f} GiB")


def bench_train(args):
    import torch
    cpu = args.device == "cpu"
    presets = args.presets or (["tiny", "base"] if cpu else ["base", "large"])
    seq_lens = args.seq_lens or ([256] if cpu else [8192, 1024])
    micro_tokens = args.micro_tokens or ([512] if cpu else [8192, 16384, 32768])
    print(f"torch {torch.__version__}, device {args.device}"
          f"{' (' + torch.cuda.get_device_name(args.device) + ')' if not cpu else ''}, {torch.get_num_threads()} "
          f"threads, {args.warmup} warm-up + median of {args.steps} interleaved steps, compile={args.compile}")
    print_prediction()
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


# ----------------------------------------------------------------------------
# Command line: every flag and input file checked before any model is built


class BenchError(ValueError):
    """A bad flag or input file: main() prints it as one `error: ...` line and exits with code 2."""


def check_args(args):
    import torch

    def require(ok, message):
        if not ok:
            raise BenchError(message)

    require(args.threads >= 1, f"--threads={args.threads}: expected at least 1")
    if args.command == "data":
        require(args.repeats >= 1, f"--repeats={args.repeats}: expected at least 1")
        require(args.corpus.is_file(), f"--corpus={args.corpus}: no such file (expected a JSONL file of texts)")
        import data
        try:
            data.load_tokenizer(args.tokenizer)
        except (OSError, ValueError) as e:
            raise BenchError(f"--tokenizer={args.tokenizer}: not a usable tokenizer ({str(e).splitlines()[0][:200]})")
        return
    from model import BACKENDS, PRESETS, pick_backend
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise BenchError(f"--device={args.device}: expected cpu, cuda or cuda:N") from None
    require(device.type in ("cpu", "cuda"), f"--device={args.device}: expected cpu, cuda or cuda:N")
    require(device.type != "cuda" or torch.cuda.is_available(), f"--device={args.device}: CUDA is not available here")
    unknown = sorted(set(args.presets or []) - set(PRESETS))
    require(not unknown, f"--presets: unknown {unknown}; expected some of {', '.join(PRESETS)}")
    require(args.phases and set(args.phases) <= {"clm", "mlm"},
            f"--phases={','.join(args.phases)}: expected clm, mlm or both")
    require(all(1 <= t <= 8192 for t in args.seq_lens or []), "--seq_lens: expected lengths in [1, 8192]")
    require(all(t >= 1 for t in args.micro_tokens or []), "--micro_tokens: expected positive token counts")
    require(args.warmup >= 0, f"--warmup={args.warmup}: expected 0 or more")
    require(args.steps >= 1, f"--steps={args.steps}: expected at least 1")
    require(args.backend == "auto" or args.backend in BACKENDS, f"--backend={args.backend}: expected auto or one of "
            f"{', '.join(BACKENDS)}")
    try:
        pick_backend(device, args.backend)
    except ValueError as e:
        raise BenchError(f"--backend={args.backend}: {e}") from None
    require(args.peer_attention in ("auto", "sdpa", "eager", "flash_attention_2"),
            f"--peer_attention={args.peer_attention}: expected auto, sdpa, eager or flash_attention_2")
    require(args.json is None or Path(args.json).parent.is_dir(), f"--json={args.json}: its directory does not exist")


def flag_list(kind):
    def parse(text):
        try:
            return [kind(v) for v in text.split(",") if v]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}") from None
    return parse


def flag_bool(text):
    if text.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise argparse.ArgumentTypeError("expected true or false")
    return text.lower() in ("1", "true", "yes")


def default_threads():
    """OMP_NUM_THREADS when set (a shared machine's budget), else the cores this process may run on."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, like every other bad input
        self.exit(2, f"error: {message}\n")


def main():
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    t = sub.add_parser("train", help="training steps of our model against transformers' ModernBertForMaskedLM")
    t.add_argument("--device", default=None, help="default cuda when available, else cpu")
    t.add_argument("--presets", type=flag_list(str), help="default base,large on GPU, tiny,base on CPU")
    t.add_argument("--phases", type=flag_list(str), default=["clm", "mlm"])
    t.add_argument("--seq_lens", type=flag_list(int), help="default 8192,1024 on GPU, 256 on CPU")
    t.add_argument("--micro_tokens", type=flag_list(int),
                   help="tokens per micro-batch, the sweep (default 8192,16384,32768 on GPU, 512 on CPU)")
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--compile", type=flag_bool, default=None,
                   help="torch.compile our blocks, as train.py does (default: on CUDA; not on a CPU, where it "
                        "measured 1.01-1.05x for 11 s or more of compilation)")
    t.add_argument("--backend", default="auto", help="our attention backend: auto, flash, flex, sdpa")
    t.add_argument("--peer_attention", default="auto",
                   help="transformers attn_implementation (auto: fastest available)")
    t.add_argument("--json", help="also write the rows to this file")
    t.set_defaults(run=bench_train)
    p = sub.add_parser("data", help="tokenizer, prepare and loader throughput")
    p.add_argument("--corpus", type=Path, default=SHARED / "data" / "corpus" / "e3c_en_clinical_cases.jsonl")
    p.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "modernbert" / "tokenizer.json")
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(run=bench_data)
    for command in (t, p):
        command.add_argument("--threads", type=int, default=default_threads(),
                             help="intra-op threads (default: OMP_NUM_THREADS, else the cores available)")
    args = parser.parse_args()
    # the Rust thread pool reads these when `tokenizers` first runs: set them before anything imports it
    os.environ["RAYON_NUM_THREADS"] = str(max(1, args.threads))
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    import torch
    if args.command == "train":
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        check_args(args)
    except BenchError as e:
        parser.exit(2, f"error: {e}\n")
    torch.set_num_threads(args.threads)
    if args.command == "train" and args.compile is None:
        args.compile = torch.device(args.device).type == "cuda"
    args.run(args)


if __name__ == "__main__":
    main()
