"""
Benchmarks (not tests): numbers to quote, medians of a few repeats, each against a peer in the same run.

    python bench.py train [--presets=base] [--phases=clm,mlm] [--seq_lens=1024,8192] [--micro_tokens=32768]
    python bench.py data [--corpus=PATH] [--tokenizer=PATH] [--workers=1,2] [--repeats=3]
    python bench.py gpu-report [--out=gpu-report.md] [--workers=8]
    python bench.py loss [--rows=2458] [--vocab=50368] [--hidden=768]

train: full training steps (forward, backward, optimizer) of our model and of transformers'
ModernBertForMaskedLM with its fastest available attention and the same optimizer, on the same weights and
batches, the two models' steps interleaved so that a busy machine slows both alike: tokens/s, MFU
(model.flops_per_token against train.py's per-GPU peak table), peak memory (the model's weights and Adam
state, plus the most its step allocates) and the ratio to the peer. On a GPU it runs base at 1,024 and 8,192
tokens per sequence, 32,768 tokens per micro-batch (the paper's 4 x 8,192), CLM and MLM, in bf16 autocast
with both models' blocks compiled (transformers' the same way as ours, so that the ratio measures the code); on
a CPU tiny and base at 2 x 256 tokens, so that CI runs the same code. It also prints, labelled as a prediction,
the activation memory of the paper's setting (base, 4 x 8,192 tokens). transformers' ModernBERT has no causal
mode: for CLM it gets the causal masks as tensors ("sdpa+causal mask").

data: `prepare` end to end per worker count (1, 2, 4, ... up to the cores) against Hugging Face `tokenizers` on as
many threads, an Amdahl fit of the curve (the serial share) and its projection to 32 and 64 cores, labelled as
such; whether the two tokenizers' ids agree; the loader's MLM and CLM batches of 8,192-token sequences on one core
against transformers' DataCollatorForLanguageModeling. Ours and the peer's runs interleave (ours, peer, ours, ...).

loss: what train.py's --loss=fused saves: model.py's cross_entropy (the plain loss, every (rows, vocab) logit at
once) against the same loss in row chunks (machinery/kernels.py), one forward and backward of the decoder and the
loss on the same head outputs: the median time and the most memory a pass takes above its inputs (CUDA's allocator
peak; on a CPU the peak resident memory of a fresh process per measurement). Its defaults: base's decoder (vocab
50,368, 768 wide) on one 8,192-token sequence at 30% masked (2,458 rows) on a CPU, the paper's micro-batch (4 x
8,192 tokens, 9,830 rows) on a GPU.

gpu-report: the GPU acceptance in one command: `python -m pytest -m gpu` in test processes that share the GPU,
each test's result read from its JUnit XML, then `train` with its GPU defaults, alone on the GPU; one markdown
file with the date, the GPU, the versions, the commands, the suite's results (seconds per test) and the bench
table, to paste into docs/gpu.md. On an H200 with 8 test processes: 6.3 minutes.
"""
import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

from machinery.cli import (InputError, Parser, autocast, check_writable, out_of_memory, pick_device, pick_threads,
                           positive_int, run, usable_cores)
from machinery.flags import MIN_SEQ_LEN

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent / "shared"
# what gpu-report runs, as its report names them
SUITE = "python -m pytest -m gpu -rA"
BENCH = "python bench.py train --device=cuda"
GPU_DEFAULTS = dict(presets=["base"], seq_lens=[1024, 8192], micro_tokens=[32768])
CPU_DEFAULTS = dict(presets=["tiny", "base"], seq_lens=[256], micro_tokens=[512])
LOADER_SEQ_LEN = 8192  # the data bench's loader reads the paper's sequences


def bench_data(args):
    """Prepare's throughput per worker count against Hugging Face tokenizers on as many threads, an Amdahl fit of
    the curve and its projection; then the loader against transformers' collator. Each pair of measurements is
    interleaved (ours, peer, ours, peer, ...), so that load from other processes hits both alike."""
    import contextlib
    import io

    import torch
    from tokenizers import Tokenizer as HFTokenizer  # a test oracle, never a dependency of data.py

    import data
    from machinery.prepare import find_sources, read_documents

    files = [f for source in find_sources([args.corpus]) for f in source.files]
    texts = [text for f in files for text in read_documents(f)]  # prepare's reader: its errors, by line
    ours = data.load_tokenizer(args.tokenizer)
    cpu, quiet = torch.device("cpu"), contextlib.redirect_stdout(io.StringIO())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "d"
        # prepare first: its checks of the corpus (documents enough for both splits) come before any timing
        try:
            with quiet, contextlib.redirect_stderr(io.StringIO()):
                meta = data.prepare([args.corpus], ours, out, workers=1)
        except InputError as e:
            raise InputError(f"--corpus={args.corpus}: data.py prepare refuses it: {e}") from None
        splits = meta["splits"]
        if splits["train"]["tokens"] < LOADER_SEQ_LEN:
            raise InputError(f"--corpus={args.corpus}: {splits['train']['tokens']:,} train tokens, fewer than one "
                             f"{LOADER_SEQ_LEN:,}-token sequence of the loader's bench; give a larger corpus")
        tokens, mb = splits["train"]["tokens"] + splits["val"]["tokens"], sum(map(len, map(str.encode, texts))) / 1e6
        hf = HFTokenizer.from_file(str(args.tokenizer))
        same = sum(a == e.ids for a, e in zip(ours.encode_batch(texts), hf.encode_batch(texts, add_special_tokens=False)))
        print(f"corpus {args.corpus}: {len(texts):,} documents, {mb:.1f} MB of text, {tokens:,} tokens; "
              f"{usable_cores()} usable cores; median of {args.repeats}, interleaved with the peer")
        print(f"identical ids {same}/{len(texts)} (data.py's tokenizer against Hugging Face tokenizers)")

        def prepare(workers):
            with quiet, contextlib.redirect_stderr(io.StringIO()):
                data.prepare([args.corpus], ours, out, workers=workers)
        peers = [Peer(files, args.tokenizer, n) for n in args.workers]
        try:
            steps = [step for n, peer in zip(args.workers, peers) for step in (lambda n=n: prepare(n), peer.encode)]
            results = [seconds for seconds, _ in interleaved(steps, cpu, 1, args.repeats)]
        finally:
            for peer in peers:
                peer.close()
        print_prepare(args.workers, results[::2], results[1::2], tokens)

        # the loader on one core, as each training process has its own
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        torch.set_num_threads(1)
        print_loader(loader_rows(out, args.tokenizer, args.repeats), args.repeats)
        print_reads(loader_reads(out, args.repeats))


class Peer:
    """A process that tokenizes the corpus with Hugging Face tokenizers on `threads` threads (its Rust thread pool is
    sized once per process), once per line it reads: the peer of prepare on as many workers. It gets the texts
    in memory and does no more than encode_batch; prepare also reads, splits, shuffles and writes."""

    def __init__(self, files, tokenizer, threads):
        env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true"}
        self.process = subprocess.Popen([sys.executable, "-c", "import bench; bench.serve_peer()", str(tokenizer),
                                         *map(str, files)], cwd=HERE, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.encode()  # its warm-up: the thread pool started, the texts read

    def encode(self):
        self.process.stdin.write("encode\n")
        self.process.stdin.flush()
        if not self.process.stdout.readline():
            raise RuntimeError(f"the Hugging Face tokenizers peer stopped (exit status {self.process.wait()})")

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def serve_peer():
    """The Peer's side: argv holds the tokenizer.json and the corpus's files."""
    from tokenizers import Tokenizer as HFTokenizer

    from machinery.prepare import read_documents
    hf = HFTokenizer.from_file(sys.argv[1])
    texts = [text for f in sys.argv[2:] for text in read_documents(f) if text.strip()]
    for _ in sys.stdin:
        ids = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
        print(sum(map(len, ids)) + 2 * len(ids), flush=True)


def worker_counts(cores):
    """1, 2, 4, ... and the cores themselves: a curve for the fit."""
    return sorted({1 << i for i in range(cores.bit_length()) if 1 << i <= cores} | {cores})


def amdahl(counts, seconds):
    """(a, b) of T(n) = a + b / n fitted to the measured times by least squares: a is the part no worker shares."""
    import numpy as np
    A = np.stack([np.ones(len(counts)), 1 / np.array(counts, float)], 1)
    (a, b), *_ = np.linalg.lstsq(A, np.array(seconds), rcond=None)
    return float(a), float(b)


PROJECTED_CORES, PROJECTED_TOKENS = (32, 64), 10e9  # the paper's data: 10B tokens


def print_prepare(counts, ours, peer, tokens):
    head = f"{'workers':>7} | {'prepare tok/s':>13} | {'speed-up':>8} | {'HF encode_batch tok/s':>21} | {'ours/peer':>9}"
    print("\nprepare end to end (read, tokenize, split, shuffle, write), against Hugging Face tokenizers' "
          "encode_batch alone\non as many threads (texts in memory)\n" + head + "\n" + "-" * len(head))
    for n, t, p in zip(counts, ours, peer):
        print(f"{n:>7} | {tokens / t:>13,.0f} | {ours[0] / t:>7.2f}x | {tokens / p:>21,.0f} | {p / t:>8.2f}x")
    if len(counts) < 2:
        print("one worker count measured: no curve to fit")
        return
    a, b = amdahl(counts, ours)
    print(f"Amdahl fit T(n) = {a:.3f} s + {b:.3f} s / n: serial share {a / (a + b):.1%} of the one-worker time "
          f"(the fixed costs of this {tokens:,}-token corpus included: the share shrinks as a corpus grows)")
    for n in PROJECTED_CORES:
        rate = tokens / (a + b / n)
        print(f"PROJECTION (the fit extrapolated, not measured): {n} cores {rate:,.0f} tokens/s, "
              f"{PROJECTED_TOKENS / 1e9:.0f}B tokens in {PROJECTED_TOKENS / rate / 60:.1f} min")


LOADER_BATCHES, LOADER_MICRO = 20, 4  # micro-batches per measurement, sequences per micro-batch


def loader_rows(data_dir, tokenizer, repeats):
    """(objective, ours tok/s, peer tok/s) for MLM at 30% and CLM: data.Loader against transformers'
    DataCollatorForLanguageModeling (mlm=True, and mlm=False for CLM) on the same windows of train.bin."""
    import numpy as np
    import torch
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    import data
    T, B, n = LOADER_SEQ_LEN, LOADER_MICRO, LOADER_BATCHES
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer), cls_token="[CLS]", sep_token="[SEP]",
                                 pad_token="[PAD]", mask_token="[MASK]")
    meta = data.load_meta(data_dir)
    tokens = np.memmap(Path(data_dir) / "train.bin", dtype=meta["dtype"], mode="r")
    rows = []
    for objective in data.OBJECTIVES:
        ours = data.Loader(data_dir, seq_len=T, batch_size=B, micro_batch_size=B, objective=objective,
                           mask_rate=0.3)
        order = data.Loader(data_dir, seq_len=T, batch_size=B, micro_batch_size=B).windows  # ours's windows
        collate = DataCollatorForLanguageModeling(hf, mlm=objective == "mlm", mlm_probability=0.3,
                                                  return_tensors="pt")
        position = iter(range(0, 1 << 62, B))

        def peer():
            for _ in range(n):
                start = next(position)
                windows = order(np.arange(start, start + B))
                collate([torch.from_numpy(tokens[w * T:(w + 1) * T].astype(np.int64)) for w in windows])
        (t_ours, _), (t_peer, _) = interleaved([lambda: [ours.next() for _ in range(n)], peer],
                                               torch.device("cpu"), 1, repeats)
        rows.append((objective, n * B * T / t_ours, n * B * T / t_peer))
    return rows


def read_bytes():
    """Bytes this process has caused to be fetched from storage (Linux's /proc/self/io), page faults included."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def loader_reads(data_dir, repeats):
    """(advise, bytes read from storage per byte the windows hold, tok/s) for the loader with and without telling
    the kernel its reads are random, interleaved, train.bin dropped from the page cache before each measurement
    (posix_fadvise DONTNEED: the cold read a training's first epoch makes of a corpus larger than memory). None
    where the system cannot say (no /proc/self/io, or no posix_fadvise)."""
    import numpy as np
    import data
    if not (os.path.exists("/proc/self/io") and hasattr(os, "posix_fadvise")):
        return None
    path, T, B, n = Path(data_dir) / "train.bin", LOADER_SEQ_LEN, LOADER_MICRO, LOADER_BATCHES
    itemsize = np.dtype(data.load_meta(data_dir)["dtype"]).itemsize
    results = {True: [], False: []}
    for _ in range(repeats):
        for advise in (False, True):
            loader = data.Loader(data_dir, seq_len=T, batch_size=B, micro_batch_size=B, objective="clm",
                                 advise=advise)  # its checks read the file: dropped from the cache after them
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)  # pages written but not yet on disk would stay in the cache
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            before, start = read_bytes(), time.perf_counter()
            for _ in range(n):
                loader.next()
            seconds, fetched = time.perf_counter() - start, read_bytes() - before
            results[advise].append((fetched / (n * B * T * itemsize), n * B * T / seconds))
    return [(advise, *np.median(np.array(rows), 0)) for advise, rows in results.items()]


def print_reads(rows):
    if rows is None:
        return print("\nLoader reads: not measured (needs Linux's /proc/self/io and posix_fadvise)")
    head = f"{'kernel told':>24} | {'bytes read / bytes used':>23} | {'tok/s':>12}"
    print(f"\nLoader reads from a cold page cache: train.bin dropped from it before each measurement of "
          f"{LOADER_BATCHES} micro-batches of {LOADER_MICRO} x {LOADER_SEQ_LEN} tokens (np.memmap, windows in the "
          f"seeded order)\n" + head + "\n" + "-" * len(head))
    for advise, ratio, speed in rows:
        told = "random, these windows" if advise else "nothing (read-ahead)"
        print(f"{told:>24} | {ratio:>23.2f} | {speed:>12,.0f}")


def print_loader(rows, repeats):
    head = f"{'objective':>9} | {'data.Loader tok/s':>17} | {'HF collator tok/s':>17} | {'ratio':>6}"
    print(f"\nLoader: {LOADER_MICRO} x {LOADER_SEQ_LEN} tokens per micro-batch, {LOADER_BATCHES} per measurement, one "
          f"core; the peer: transformers' DataCollatorForLanguageModeling on the same windows (mlm_probability "
          f"0.3; mlm=False for CLM)\n" + head + "\n" + "-" * len(head))
    for objective, ours, peer in rows:
        name = "mlm 30%" if objective == "mlm" else objective
        print(f"{name:>9} | {ours:>17,.0f} | {peer:>17,.0f} | {ours / peer:>5.2f}x")


# ----------------------------------------------------------------------------
# Training steps: ours against transformers


def batch(vocab, micro, seq_len, phase, device, seed=0):
    """Random ids and labels: MLM labels 30% of positions (and the first of a sequence that drew none: a loss
    over no label is 0 for ours and NaN for the peer), CLM labels the next token."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab - 100, (micro, seq_len), generator=g)  # the top ids are the special tokens
    if phase == "clm":
        y = torch.cat([x[:, 1:], torch.full((micro, 1), -100)], 1)
    else:
        chosen = torch.rand(micro, seq_len, generator=g) < 0.3
        chosen[:, 0] |= ~chosen.any(1)
        y = torch.where(chosen, x, -100)
    return x.to(device), y.to(device)


def causal_masks(seq_len, window, device):
    """transformers has no causal mode; its ModernBERT takes explicit masks per layer type (True = attend)."""
    import torch
    i = torch.arange(seq_len, device=device)
    causal = i[None, :] <= i[:, None]
    local = causal & (i[:, None] - i[None, :] <= window)
    return {"full_attention": causal[None, None], "sliding_attention": local[None, None]}


def allocated(device):
    import torch
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def interleaved(steps, device, warmup, repeats):
    """Median seconds per step of each function, called in turn (a, b, a, b, ...) so that load from other
    processes hits all alike; on CUDA also the most each timed step allocated above what was allocated before it."""
    import torch
    cuda = device.type == "cuda"
    times, memory = [[] for _ in steps], [0 for _ in steps]
    for i in range(warmup + repeats):
        for k, step in enumerate(steps):
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            before = allocated(device)
            t0 = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize(device)
            if i >= warmup:  # the warm-up's compilation and autotuning allocate what the steps never need again
                times[k].append(time.perf_counter() - t0)
                if cuda:
                    memory[k] = max(memory[k], torch.cuda.max_memory_allocated(device) - before)
    return [(statistics.median(t), m) for t, m in zip(times, memory)]


def measure(args, preset, phase, seq_len, micro):
    """One row: ours and the peer on the same weights, batch and optimizer, their steps interleaved."""
    import torch
    import transformers

    from machinery.hf import config_to_hf
    from machinery.kernels import backend_for, compile_blocks
    from model import ModernBERT, ModernBERTConfig
    from train import AdamW, peak_flops

    device = args.device
    torch._dynamo.reset()  # each row compiles afresh: dynamo runs eager past 8 graphs of one function
    torch.manual_seed(0)
    cfg = ModernBERTConfig.from_preset(preset)
    x, y = batch(cfg.vocab_size, micro, seq_len, phase, device)
    y_host = y.cpu()  # ours reads its labels on the host, as train.py gives them (no device sync)
    causal = phase == "clm"

    def on_device(make):
        """A model on the device with its optimizer, and the bytes both keep there (weights, Adam state)."""
        before = allocated(device)
        model = make().to(device)
        return model, AdamW(ModernBERT.param_groups(model), 2e-4), allocated(device) - before

    ours, ours_opt, ours_resident = on_device(lambda: ModernBERT(cfg, args.backend, args.loss))
    attn = args.peer_attention
    if attn == "auto":  # its fastest: flash-attn where installed (it has no causal mode), else SDPA
        flash = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
        attn = "flash_attention_2" if flash and not causal else "sdpa"
    # the peer: same weights; sparse prediction for MLM (its own fastest setting); explicit masks for CLM
    hf_cfg = transformers.ModernBertConfig(**{k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures",
                                           "model_type", "layer_types", "rope_parameters", "mask_token_id")},
                                           sparse_prediction=not causal, attn_implementation=attn)
    peer, peer_opt, peer_resident = on_device(lambda: transformers.ModernBertForMaskedLM(hf_cfg))
    peer.load_state_dict(ours.state_dict())
    masks = causal_masks(seq_len, cfg.window, device) if causal else None
    forwards = {"ours": lambda: ours(x, labels=y_host, causal=causal)[1],
                "peer": lambda: peer(input_ids=x, labels=y, attention_mask=masks).loss}
    # transformers' ModernBERT has no causal mode: it gets the causal (and sliding-window) masks as tensors
    with autocast(device):  # the backend the steps run: auto's pick depends on the dtype
        backend = backend_for(ours, device)
    row = dict(preset=preset, phase=phase, seq_len=seq_len, micro=micro, tokens=micro * seq_len,
               backend=backend, peer_attention=attn + "+causal mask" * causal)
    for name, model in (("ours", ours), ("peer", peer)):
        with torch.no_grad(), autocast(device):
            row[f"loss_{name}"] = forwards[name]().item()
        model.train()
    if args.compile:  # regional compilation, as train.py does; the peer too, so that the ratio is the code's
        compile_blocks(ours)
        for block in peer.model.layers:
            block.compile()

    def training_step(model, opt, forward):
        def step():
            with autocast(device):
                loss = forward()
            loss.backward()
            opt.step(2e-4)
            for p in model.parameters():
                p.grad = None
        return step

    results = interleaved([training_step(ours, ours_opt, forwards["ours"]),
                           training_step(peer, peer_opt, forwards["peer"])], device, args.warmup, args.steps)
    flops = ours.flops_per_token(seq_len, causal, 1.0 if causal else 0.3)
    peak = peak_flops(device)
    for name, result, resident in (("ours", results[0], ours_resident), ("peer", results[1], peer_resident)):
        seconds, memory = result
        row[name] = dict(tokens_per_s=micro * seq_len / seconds, ms=seconds * 1e3,
                         memory_gb=(resident + memory) / 2**30 if device.type == "cuda" else None,
                         mfu=flops * micro * seq_len / seconds / peak if peak else None)
    return row


def out_of_memory_row(args, preset, phase, seq_len, micro):
    """The row of a setting that did not fit: its sizes, and OOM where the numbers would be."""
    return dict(preset=preset, phase=phase, seq_len=seq_len, micro=micro, tokens=micro * seq_len, backend="-",
                peer_attention=args.peer_attention, ours="OOM", peer="OOM", loss_ours=None, loss_peer=None)


def activation_memory(cfg, seq_len, micro, mask_rate=0.3):
    """PREDICTION, on paper: bytes kept for backward in one micro-batch under bf16 autocast with the flash
    backend (nothing quadratic in seq_len). Per token and block: the fp32 block input and mlp_norm input
    (4d + 4d), the bf16 copies Wqkv and Wi read (2d + 2d), qkv (6d, alive through v), rotated q and k (2d + 2d),
    the attention output (2d) and its log-sum-exp (4H), Wi's output (4I, alive through GELU's input and the
    gate), GELU's output (2I) and mlp.Wo's input (2I): 24d + 8I + 4H bytes, less 4d in block 0 (no attn_norm).
    Plus the embeddings and final_norm (12d per token), the head on the predicted rows (12d) and the loss's
    fp32 weight gradient. tests/test_backends.py checks the per-token part against autograd's saved tensors
    on a CPU, tests/test_gpu.py against the CUDA allocator."""
    d, i, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    tokens = seq_len * micro
    per_token = cfg.num_hidden_layers * (24 * d + 8 * i + 4 * h) - 4 * d + 12 * d + mask_rate * 12 * d
    return tokens * per_token + 4 * cfg.vocab_size * d


def print_prediction():
    import torch

    from model import ModernBERT, ModernBERTConfig
    cfg = ModernBERTConfig.from_preset("base")
    with torch.device("meta"):
        params = ModernBERT(cfg).num_params() * (4 + 4 + 8) / 2**30  # fp32 weights, gradients, two Adam moments
    for phase, rate in (("mlm", 0.3), ("clm", 1.0)):
        gb = activation_memory(cfg, 8192, 4, rate) / 2**30
        print(f"PREDICTION (on paper, not measured): base {phase}, 4 x 8192 tokens, bf16 autocast, flash backend: "
              f"activations {gb:.1f} GiB + weights, gradients and Adam moments {params:.1f} GiB")


def bench_train(args, rows=None):
    """The table, row by row; the rows, appended to `rows` as they are measured (a failure keeps those done)."""
    import torch
    torch.set_num_threads(args.threads)
    gpu = f" ({torch.cuda.get_device_name(args.device)})" if args.device.type == "cuda" else ""
    print(f"torch {torch.__version__}, device {args.device}{gpu}, {torch.get_num_threads()} threads, {args.warmup} "
          f"warm-up + median of {args.steps} interleaved steps, compile={args.compile}")
    print_prediction()
    head = (f"{'preset':6} {'phase':5} {'seq':>5} {'micro':>5} {'attn':>5} | {'ours tok/s':>11} {'MFU':>6} "
            f"{'GiB':>6} | {'peer tok/s':>11} {'MFU':>6} {'GiB':>6} {'peer attn':>17} | {'ratio':>6} | "
            f"{'loss ours':>9} {'peer':>9}")
    print(head + "\n" + "-" * len(head))
    rows = [] if rows is None else rows
    for preset in args.presets:
        for seq_len in args.seq_lens:
            for phase in args.phases:
                for tokens in args.micro_tokens:
                    micro = max(1, tokens // seq_len)
                    try:
                        row = measure(args, preset, phase, seq_len, micro)
                    except Exception as e:  # a row too large for the device: the sweep goes on
                        if not out_of_memory(e):
                            raise
                        row = out_of_memory_row(args, preset, phase, seq_len, micro)
                    if args.device.type == "cuda":
                        torch.cuda.empty_cache()  # what the row's models and batch held
                    rows.append(row)
                    print(format_row(row), flush=True)
    too_large = [f"{r['preset']} {r['phase']} {r['micro']} x {r['seq_len']}" for r in rows if r["ours"] == "OOM"]
    if too_large:
        message = (f"out of memory on {args.device} in {len(too_large)} of {len(rows)} rows ({', '.join(too_large)} "
                   f"tokens): lower --micro_tokens or --seq_lens, or choose smaller --presets")
        if len(too_large) == len(rows):
            raise InputError(message)
        print(f"note: {message}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def cells(m):
    """tokens/s, MFU and peak GiB of one side of a row, as text ('OOM' fills the first)."""
    if not isinstance(m, dict):
        return [m, "", ""]
    return [f"{m['tokens_per_s']:,.0f}", f"{m['mfu']:.1%}" if m["mfu"] is not None else "-",
            f"{m['memory_gb']:.1f}" if m["memory_gb"] is not None else "-"]


def ratio(r):
    both = isinstance(r["ours"], dict) and isinstance(r["peer"], dict)
    return f"{r['ours']['tokens_per_s'] / r['peer']['tokens_per_s']:.2f}x" if both else "-"


def loss(value):
    return "-" if value is None else f"{value:.4f}"


def format_row(r):
    ours, peer = ("{:>11} {:>6} {:>6}".format(*cells(r[k])) for k in ("ours", "peer"))
    return (f"{r['preset']:6} {r['phase']:5} {r['seq_len']:>5} {r['micro']:>5} {r['backend']:>5} | {ours} | "
            f"{peer} {r['peer_attention']:>17} | {ratio(r):>6} | {loss(r['loss_ours']):>9} {loss(r['loss_peer']):>9}")


# ----------------------------------------------------------------------------
# The loss: plain (model.py's cross_entropy) against fused (the same in row chunks)


def loss_pass(loss, rows, hidden, vocab, device, repeats, threads):
    """(median seconds, peak bytes above the inputs) of `repeats` forward and backward passes of one of model.py's
    LOSSES on random (rows, hidden) head outputs and a (vocab, hidden) decoder, after one untimed pass. On a CPU it
    runs in a process of its own (loss_bench starts it): the peak resident memory is the process's, and a pass on 8
    rows first loads and initialises the code the passes run (that too is resident memory, once)."""
    import resource

    import torch

    from machinery.kernels import linear_cross_entropy
    from model import cross_entropy
    torch.set_num_threads(threads)
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g).to(device).requires_grad_()
    weight = (0.02 * torch.randn(vocab, hidden, generator=g)).to(device).requires_grad_()
    bias = torch.zeros(vocab, device=device, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(device)
    compute = linear_cross_entropy if loss == "fused" else cross_entropy
    page = os.sysconf("SC_PAGE_SIZE")
    resident = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * page  # noqa: E731
    with autocast(device):
        compute(h[:8], weight, bias, targets[:8]).backward()
    h.grad = weight.grad = bias.grad = None
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = allocated(device) if cuda else resident()
    times = []
    for i in range(1 + repeats):
        t0 = time.perf_counter()
        with autocast(device):
            value = compute(h, weight, bias, targets)
        value.backward()
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
        h.grad = weight.grad = bias.grad = None
    # ru_maxrss: the process's peak resident size, in KiB on Linux
    peak = torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    return statistics.median(times), peak - before


def loss_bench(args):
    """Both losses at each --rows, alternating, each CPU measurement in a fresh process."""
    import multiprocessing
    from unittest import mock

    from model import LOSSES
    print(f"decoder {args.vocab:,} x {args.hidden} on {args.device}, {args.threads} thread(s), median of "
          f"{args.repeats} forward + backward passes after one untimed; memory: the most a pass takes above its inputs "
          f"({'the allocator' if args.device.type == 'cuda' else 'peak resident, a fresh process per measurement'})")
    print(f"{'loss':6} {'rows':>7} | {'ms':>9} | {'MiB':>9}")
    rows = []
    for n in args.rows:
        for loss in LOSSES:
            work = (loss, n, args.hidden, args.vocab, args.device, args.repeats, args.threads)
            if args.device.type == "cuda":
                seconds, peak = loss_pass(*work)
            else:  # glibc maps blocks over 1 MiB and gives them back when freed: the peak is what a pass holds
                with mock.patch.dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20)), \
                        multiprocessing.get_context("spawn").Pool(1) as pool:  # the variable is read at its start
                    seconds, peak = pool.apply(loss_pass, work)
            rows.append(dict(loss=loss, rows=n, vocab=args.vocab, hidden=args.hidden, ms=seconds * 1e3,
                             mib=peak / 2**20))
            print(f"{loss:6} {n:>7,} | {seconds * 1e3:>9.1f} | {peak / 2**20:>9.1f}", flush=True)
    return rows


# ----------------------------------------------------------------------------
# The GPU report: the gpu test suite and the train bench, in one markdown file


def suite_results(junit):
    """[(test, outcome, seconds, note)] from pytest's JUnit XML: outcome passed, failed, error or skipped;
    note the skip reason or the failure's first line."""
    results = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        outcome, note = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome, text = {"failure": "failed"}.get(tag, tag), (found.get("message") or found.text or "")
                note = (text.strip().splitlines() or [""])[0]
                break
        results.append((f"{module}::{case.get('name')}", outcome, float(case.get("time", 0)), note))
    return results


def cell(text, limit=200):
    """Text that stays inside one markdown table cell."""
    text = " ".join(str(text).split())
    return (text[:limit - 3] + "..." if len(text) > limit else text).replace("|", "\\|")


def suite_section(results, command, seconds):
    counts = {k: sum(r[1] == k for r in results) for k in ("passed", "failed", "error", "skipped")}
    lines = [f"## `{command}`: " + ", ".join(f"{n} {k}" for k, n in counts.items()) + f" in {seconds / 60:.1f} min",
             "", "| test | result | seconds | note |", "|---|---|---:|---|"]
    lines += [f"| {cell(t)} | {o} | {s:.1f} | {cell(n)} |" for t, o, s, n in results]
    if not results:
        lines.append("| (no JUnit results: the suite did not run to its end) | - | - | - |")
    return "\n".join(lines) + "\n"


def bench_section(rows, args, command, failure=None):
    precision = "bf16 autocast" if args.device.type == "cuda" else "fp32"
    lines = [f"## `{command}`: ours against transformers on the same device, weights, batch and optimizer",
             "", f"{args.warmup} warm-up steps, then the median of {args.steps}; the two models' steps interleaved; "
             f"{precision}; both models' blocks compiled: {args.compile}. Peak GiB: the model's weights and Adam state "
             f"plus the most its step allocated. MFU: model.flops_per_token (attention included) against the "
             f"GPU's dense bf16 peak. Loss: both models on the same first batch, before training.", "",
             "| preset | phase | seq x micro | ours: attention | tok/s | MFU | peak GiB | transformers: attention "
             "| tok/s | MFU | peak GiB | ratio | loss ours / transformers |",
             "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['phase']} | {r['seq_len']:,} x {r['micro']} | {r['backend']} | "
                     + " | ".join(cells(r["ours"])) + f" | {r['peer_attention']} | " + " | ".join(cells(r["peer"]))
                     + f" | {ratio(r)} | {loss(r['loss_ours'])} / {loss(r['loss_peer'])} |")
    if failure:
        lines += ["", f"The bench stopped: `{cell(failure, 400)}`"]
    return "\n".join(lines) + "\n"


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment(device):
    """What ran the report: GPU, versions and the code's commit, as (name, value) pairs."""
    import torch
    p = torch.cuda.get_device_properties(device)

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return [("GPU", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}"),
            ("PyTorch", f"{torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})"),
            ("Triton", version("triton")), ("transformers", version("transformers")),
            ("flash-attn", version("flash-attn")), ("Python", sys.version.split()[0]), ("code", commit + dirty)]


def gpu_report(args):
    """Runs the gpu test suite in a subprocess (its output streams to the terminal), then the train bench with
    its GPU defaults in this process; writes one markdown file, whatever failed. Exit status 1 if anything did."""
    started = datetime.datetime.now(datetime.timezone.utc)
    suite = SUITE if (args.workers or 1) == 1 else f"{SUITE} -n {args.workers}"
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "gpu.xml"
        t0 = time.perf_counter()
        code = subprocess.run([sys.executable, *suite.split()[1:], f"--junitxml={junit}"], cwd=HERE).returncode
        seconds = time.perf_counter() - t0
        results = suite_results(junit) if junit.is_file() else []
    train_args = parser().parse_args([*BENCH.split()[2:], f"--threads={args.threads}"])
    resolve(train_args)
    rows, failure = [], None
    try:
        bench_train(train_args, rows)
    except Exception as e:  # the report still says what the suite found, and the rows measured
        traceback.print_exc()
        failure = f"{type(e).__name__}: {e}"
    minutes = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60
    header = [f"# GPU acceptance, {started:%Y-%m-%d %H:%M} UTC", "",
              f"`python bench.py gpu-report --out={args.out}`: {minutes:.1f} minutes in all.", "",
              "| | |", "|---|---|"] + [f"| {k} | {cell(v)} |" for k, v in environment(train_args.device)]
    Path(args.out).write_text("\n".join(header) + "\n\n" + suite_section(results, suite, seconds) + "\n"
                              + bench_section(rows, train_args, BENCH, failure))
    bad = [r for r in results if r[1] in ("failed", "error")]
    print(f"wrote {args.out}: {len(results)} tests, {len(bad)} failed; {len(rows)} bench rows"
          + (f"; the bench stopped ({failure.splitlines()[0][:200]})" if failure else ""))
    return 1 if bad or code not in (0, 5) or failure or not results else 0


# ----------------------------------------------------------------------------
# Command line: every flag and input file checked before any model is built


def names(known):
    """argparse type: a comma-separated list of names, each one of `known`."""
    def parse(text):
        values = [v for v in text.split(",") if v]
        unknown = [v for v in values if v not in known]
        if unknown or not values:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; expected some of {', '.join(known)}")
        return values
    return parse


def counts(top=None, least=1):
    """argparse type: a comma-separated list of integers in [least, top]."""
    def parse(text):
        try:
            values = [int(v) for v in text.split(",") if v]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values or not all(least <= v <= (top or v) for v in values):
            raise argparse.ArgumentTypeError(f"expected integers in [{least}, {top or 'any'}], got {text}")
        return values
    return parse


def flag_bool(text):
    if text.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise argparse.ArgumentTypeError("expected true or false")
    return text.lower() in ("1", "true", "yes")


def parser():
    from model import BACKENDS, LOSSES, PRESETS
    p = Parser(prog="bench.py", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    commands = {"train": "training steps of our model against transformers' ModernBertForMaskedLM",
                "data": "prepare throughput per worker count, and the loader's, against Hugging Face",
                "gpu-report": "the gpu test suite and the train bench, written to one markdown file",
                "loss": "model.py's cross_entropy against the same loss in row chunks (--loss=fused): time, memory"}
    t, d, g, lo = (sub.add_parser(name, help=text, description=text) for name, text in commands.items())
    t.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto: cuda when there is one")
    t.add_argument("--presets", type=names(PRESETS), help="model sizes; None: base on a GPU, tiny,base on a CPU")
    t.add_argument("--phases", type=names(("clm", "mlm")), default="clm,mlm", help="objectives to time")
    t.add_argument("--seq_lens", type=counts(8192, MIN_SEQ_LEN),
                   help="tokens per sequence; None: 1024,8192 on a GPU, 256 on a CPU")
    t.add_argument("--micro_tokens", type=counts(),
                   help="tokens per micro-batch, a sweep; None: 32768 on a GPU (the paper's 4 x 8192), 512 on a CPU")
    t.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator warm-up)")
    t.add_argument("--steps", type=positive_int, default=10, help="timed steps of each model; the median counts")
    t.add_argument("--compile", type=flag_bool, default=None,
                   help="torch.compile our blocks, as train.py does, and the peer's; None: on CUDA, not on a CPU (where it measured "
                        "1.01-1.05x for 11 s or more of compilation)")
    t.add_argument("--backend", default="auto", choices=["auto", *BACKENDS], help="our attention backend")
    t.add_argument("--loss", default="fused", choices=LOSSES,
                   help="our loss (train.py's --loss); fused: as docs/gpu.md's tables were measured")
    t.add_argument("--peer_attention", default="auto", choices=["auto", "sdpa", "eager", "flash_attention_2"],
                   help="transformers' attn_implementation (auto: flash_attention_2 where installed, else sdpa)")
    t.add_argument("--json", help="also write the rows to this file")
    d.add_argument("--corpus", type=Path, default=SHARED / "data" / "corpus",
                   help="a file of documents or a folder of them, one source, read as data.py prepare reads it")
    d.add_argument("--workers", type=counts(), help="prepare's worker counts to measure; None: 1, 2, 4, ... and the "
                                                    "usable cores")
    d.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "modernbert" / "tokenizer.json",
                   help="a tokenizer.json that data.py loads")
    d.add_argument("--repeats", type=positive_int, default=3, help="runs of each measurement; the median counts")
    g.add_argument("--out", default="gpu-report.md", help="the markdown file to write")
    g.add_argument("--workers", type=positive_int,
                   help="test processes sharing the GPU (pytest-xdist's -n); None: half the cores, at most 8, where "
                        "pytest-xdist is installed (8 on a 16-core H200: the suite in 3 min, against some 16 min of "
                        "tests one after another)")
    lo.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto: cuda when there is one")
    lo.add_argument("--rows", type=counts(), help="labelled positions, a sweep; None: 2458 on a CPU, 9830 on a GPU")
    lo.add_argument("--vocab", type=positive_int, default=50368, help="the decoder's rows (ModernBERT's vocabulary)")
    lo.add_argument("--hidden", type=positive_int, default=768, help="the head's width (base)")
    lo.add_argument("--repeats", type=positive_int, default=3, help="timed passes of each; the median counts")
    for command in (t, d, g, lo):
        command.add_argument("--threads", type=positive_int,
                             help="intra-op CPU threads; None: $OMP_NUM_THREADS, else the idle cores")
    return p


def resolve(args):
    """Check every flag and file and fill the defaults that depend on the machine; InputError names the flag."""
    if args.command == "gpu-report":
        import torch
        check_writable(args.out, "--out")
        xdist = importlib.util.find_spec("xdist") is not None
        if (args.workers or 1) > 1 and not xdist:
            raise InputError(f"--workers={args.workers}: needs pytest-xdist (pip install -r tests/requirements.txt)")
        args.workers = args.workers or (min(8, max(1, usable_cores() // 2)) if xdist else 1)
        if not torch.cuda.is_available():
            raise InputError("gpu-report needs a CUDA device, and this machine has none (torch.cuda.is_available() "
                             "is False); run it where a GPU is")
        return
    if args.command == "data":
        if not args.corpus.exists():
            raise InputError(f"--corpus={args.corpus}: no such file (expected a .jsonl, .txt or .parquet file of "
                             f"texts, or a folder of them, as data.py prepare reads)")
        args.workers = args.workers or worker_counts(usable_cores())
        if not args.tokenizer.is_file():  # the peer reads a file: no hub id, no 'bytes'
            raise InputError(f"--tokenizer={args.tokenizer}: no such file (expected a tokenizer.json)")
        import data
        from tokenizers import Tokenizer as HFTokenizer
        try:
            data.load_tokenizer(args.tokenizer)
            HFTokenizer.from_file(str(args.tokenizer))
        except Exception as e:  # OSError, ValueError, InputError, and the Rust library's own exception
            raise InputError(f"--tokenizer={args.tokenizer}: not a usable tokenizer "
                             f"({(str(e).splitlines() or [''])[0][:200]})") from None
        return
    args.device = pick_device(args.device, flag="--device")
    if args.command == "loss":
        args.rows = args.rows or [9830 if args.device.type == "cuda" else 2458]
        return
    from machinery.kernels import pick_backend
    try:
        with autocast(args.device):  # the steps' dtype: flash-attn refuses float32
            pick_backend(args.device, args.backend, training=True)
    except ValueError as e:
        raise InputError(f"--backend={args.backend}: {e}") from None
    if args.warmup < 0:
        raise InputError(f"--warmup={args.warmup}: expected 0 or more")
    if args.json is not None:
        check_writable(args.json, "--json")
    for key, value in (GPU_DEFAULTS if args.device.type == "cuda" else CPU_DEFAULTS).items():
        setattr(args, key, getattr(args, key) or value)
    if args.compile is None:
        args.compile = args.device.type == "cuda"


def main(argv=None):
    args = parser().parse_args(argv)
    args.threads = pick_threads(args.threads)
    # the Rust thread pool reads these when `tokenizers` first runs: set them before anything imports it
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    resolve(args)
    if args.command == "gpu-report":
        return gpu_report(args)  # its exit status: 1 if a test or the bench failed
    dict(train=bench_train, data=bench_data, loss=loss_bench)[args.command](args)


if __name__ == "__main__":
    sys.exit(run(main))
