"""
Benchmarks (not tests): numbers to quote, medians of a few repeats, each against a peer in the same run.

    python bench.py train [--presets=base] [--phases=clm,mlm] [--seq_lens=1024,8192] [--micro_tokens=32768]
                          [--backend=auto] [--compile=blocks|model|none] [--deterministic=true] [--residual=fp32]
    python bench.py data [--corpus=PATH] [--tokenizer=PATH] [--workers=1,2] [--repeats=3]
    python bench.py gpu-report [--out=gpu-report.md] [--workers=8] [--minutes=9]
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
mode: for CLM it gets the causal masks as tensors ("sdpa+causal mask"). The levers of the step (--backend,
--compile=model, --deterministic=false, --residual=bf16) change ours only.

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

gpu-report: what to run first wherever a GPU is at hand, in one command and one markdown file (the date, the GPU, its
clocks as found, the versions, the commit): `python -m pytest -m gpu` in test processes that share the GPU (each
test's result kept as it ends), then alone on the GPU one attention layer through every kernel the machine has, and
the training step at the paper's 4 x 8,192 tokens with each lever against it (LEVERS), and ours against
transformers at 1,024 tokens; all within --minutes.
"""
import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from machinery import gpureport
from machinery.cli import (InputError, Parser, autocast, check_writable, out_of_memory, pick_device, pick_threads,
                           positive_float, positive_int, run, usable_cores, write_text)
from machinery.flags import MIN_SEQ_LEN

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent / "shared"
# what gpu-report runs, as its report names them
SUITE = "python -m pytest -m gpu -rA"
GPU_DEFAULTS = dict(presets=["base"], seq_lens=[1024, 8192], micro_tokens=[32768])
CPU_DEFAULTS = dict(presets=["tiny", "base"], seq_lens=[256], micro_tokens=[512])
LOADER_SEQ_LEN = 8192  # the data bench's loader reads the paper's sequences


def bench_data(args):
    """Prepare's throughput per worker count against Hugging Face tokenizers on as many threads, an Amdahl fit of
    the curve and its projection; then the loader against transformers' collator. Each pair of measurements is
    interleaved (ours, peer, ours, peer, ...), so that load from other processes hits both alike."""
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


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the train bench: the step that is timed. The defaults are train.py's on a GPU."""
    preset: str
    phase: str  # clm | mlm
    seq_len: int
    micro: int  # sequences per micro-batch
    backend: str = "auto"  # our attention backend
    compile: str = "blocks"  # blocks (as train.py: each block, the peer's too) | model (our whole encoder) | none
    deterministic: bool = True  # inductor's deterministic mode, as train.py sets it (false: kernels timed)
    residual: str = "fp32"  # the residual stream's dtype under bf16 autocast: fp32 (model.py as written) | bf16
    peer: bool = True  # time transformers' ModernBertForMaskedLM too, interleaved
    loss: str = "plain"  # ours (model.py's LOSSES), as train.py's --loss (docs/gpu.md's 2026-11-28 rows ran fused)


def measure(args, s):
    """One row: ours (and the peer, with s.peer) on the same weights, batch and optimizer, their steps interleaved."""
    import torch
    import transformers

    from machinery.hf import config_to_hf
    from machinery.kernels import backend_for, compile_blocks, deterministic_compiler
    from model import ModernBERT, ModernBERTConfig
    from train import AdamW, peak_flops

    device = args.device
    torch._dynamo.reset()  # each row compiles afresh: dynamo runs eager past 8 graphs of one function
    deterministic_compiler(s.deterministic)
    torch.manual_seed(0)
    cfg = ModernBERTConfig.from_preset(s.preset)
    x, y = batch(cfg.vocab_size, s.micro, s.seq_len, s.phase, device)
    y_host = y.cpu()  # ours reads its labels on the host, as train.py gives them (no device sync)
    causal = s.phase == "clm"

    def on_device(make):
        """A model on the device with its optimizer, and the bytes both keep there (weights, Adam state)."""
        before = allocated(device)
        model = make().to(device)
        return model, AdamW(ModernBERT.param_groups(model), 2e-4), allocated(device) - before

    ours, ours_opt, ours_resident = on_device(lambda: ModernBERT(cfg, s.backend, s.loss))
    if s.residual == "bf16":
        bf16_residual(ours)
    models = {"ours": (ours, ours_opt, ours_resident, lambda: ours(x, labels=y_host, causal=causal)[1])}
    attn = args.peer_attention
    if attn == "auto":  # its fastest: flash-attn where installed (it has no causal mode), else SDPA
        flash = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
        attn = "flash_attention_2" if flash and not causal else "sdpa"
    if s.peer:  # the same weights; sparse prediction for MLM (its own fastest setting); explicit masks for CLM
        hf_cfg = transformers.ModernBertConfig(**{k: v for k, v in config_to_hf(cfg).items() if k not in (
            "architectures", "model_type", "layer_types", "rope_parameters", "mask_token_id")},
            sparse_prediction=not causal, attn_implementation=attn)
        peer, peer_opt, peer_resident = on_device(lambda: transformers.ModernBertForMaskedLM(hf_cfg))
        peer.load_state_dict(ours.state_dict())
        # transformers' ModernBERT has no causal mode: it gets the causal (and sliding-window) masks as tensors
        masks = causal_masks(s.seq_len, cfg.window, device) if causal else None
        models["peer"] = (peer, peer_opt, peer_resident,
                          lambda: peer(input_ids=x, labels=y, attention_mask=masks).loss)
    with autocast(device):  # the backend the steps run: auto's pick depends on the dtype
        backend = backend_for(ours, device)
    row = dict(dataclasses.asdict(s), tokens=s.micro * s.seq_len, backend=backend,
               peer_attention=attn + "+causal mask" * causal if s.peer else "-", peer=None, loss_peer=None)
    for name, (model, _, _, forward) in models.items():
        with torch.no_grad(), autocast(device):
            row[f"loss_{name}"] = forward().item()
        model.train()
    if s.compile == "blocks":  # regional compilation, as train.py does; the peer too, so the ratio is the code's
        compile_blocks(ours)
        if s.peer:
            for block in peer.model.layers:
                block.compile()
    elif s.compile == "model":
        compile_encoder(ours)

    def training_step(model, opt, forward):
        def step():
            with autocast(device):
                loss = forward()
            loss.backward()
            opt.step(2e-4)
            for p in model.parameters():
                p.grad = None
        return step

    results = interleaved([training_step(model, opt, forward) for model, opt, _, forward in models.values()],
                          device, args.warmup, args.steps)
    flops = ours.flops_per_token(s.seq_len, causal, 1.0 if causal else 0.3)
    peak = peak_flops(device)
    for name, (seconds, memory), (_, _, resident, _) in zip(models, results, models.values()):
        row[name] = dict(tokens_per_s=s.micro * s.seq_len / seconds, ms=seconds * 1e3,
                         memory_gb=(resident + memory) / 2**30 if device.type == "cuda" else None,
                         mfu=flops * s.micro * s.seq_len / seconds / peak if peak else None)
    return row


def bf16_residual(model):
    """A lever: the embeddings' output cast to autocast's dtype, so that every block's two sums (x + attention,
    x + MLP) stay in it: the residual stream in bf16, not fp32, under bf16 autocast (half the bytes between the
    blocks; its norms still compute in fp32)."""
    import torch

    def cast(module, inputs, out):
        kind = out.device.type
        return out.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else out
    model.model.embeddings.norm.register_forward_hook(cast)


def compile_encoder(model, backend="inductor"):
    """torch.compile the embeddings, every block and the final norm as one function (a lever against train.py's
    compilation of each block: sums and norms fused across the blocks' boundaries; a longer compilation)."""
    import torch
    model.encode = torch.compile(model.encode, backend=backend)


def out_of_memory_row(args, s):
    """The row of a setting that did not fit: its sizes, and OOM where the numbers would be."""
    return dict(dataclasses.asdict(s), tokens=s.micro * s.seq_len, backend="-",
                peer_attention=args.peer_attention if s.peer else "-", ours="OOM", peer="OOM" if s.peer else None,
                loss_ours=None, loss_peer=None)


def attention_rows(device, B=4, T=8192, H=12, D=64, window=64, warmup=3, repeats=10):
    """One layer's attention, forward and backward in bf16 autocast's dtype, through each kernel this device has:
    model.py's backends by name, and for the global layers PyTorch's SDPA with each of its fused kernels forced
    (no mask: its flash, cuDNN and memory-efficient kernels all take one). Rows of (layer, kernel, ms, TFLOP/s by
    model.flops_per_token's count: 12 d per key and token, forward and backward), or an error instead of the
    numbers where a kernel refuses."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from machinery.kernels import BACKENDS
    from model import mask_rule, reference_attention
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(B, T, H, D, generator=g).to(device, dtype) for _ in range(4))
    layers = {"global, bidirectional": (False, False), "global, causal": (True, False),
              "local, bidirectional": (False, True), "local, causal": (True, True)}
    sdpa_kernels = {"sdpa: its flash kernel": SDPBackend.FLASH_ATTENTION, "sdpa: cuDNN": SDPBackend.CUDNN_ATTENTION,
                    "sdpa: memory-efficient": SDPBackend.EFFICIENT_ATTENTION}
    rows = []
    for layer, (causal, local) in layers.items():
        every = (T + 1) / 2 if causal else T  # a global layer's keys; a window past both ends sees no more
        keys = min(window + 1 if causal else 2 * window + 1, every) if local else every
        flops = 12 * H * D * keys * B * T
        kernels = {name: (name, contextlib.nullcontext) for name, kind in BACKENDS.items()
                   if name != "reference" and kind.trains(device) and kind.computes(device, dtype)}
        if not local and device.type == "cuda":
            kernels.update({name: ("sdpa", lambda b=b: sdpa_kernel([b])) for name, b in sdpa_kernels.items()})
        for name, (backend, context) in kernels.items():
            attn = BACKENDS[backend](B, T, device, causal, window, rule=mask_rule, reference=reference_attention)
            leaves, out_grad = [attn.unpad(t).detach().requires_grad_() for t in (q, k, v)], attn.unpad(grad)

            def step():
                with context():
                    torch.autograd.grad(attn.attend(*leaves, local), leaves, out_grad)
            try:
                (seconds, _), = interleaved([step], device, warmup, repeats)
            except Exception as e:  # a kernel this device or these shapes refuse: said in the row
                rows.append((layer, name, None, (str(e).strip().splitlines() or [type(e).__name__])[0][:160]))
                continue
            rows.append((layer, name, seconds * 1e3, flops / seconds / 1e12))
    return rows


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
    settings = [Setting(preset, phase, seq_len, max(1, tokens // seq_len), args.backend, args.compile,
                        args.deterministic, args.residual, loss=args.loss)
                for preset in args.presets for seq_len in args.seq_lens for phase in args.phases
                for tokens in args.micro_tokens]
    for s in settings:
        rows.append(measure_or_oom(args, s))
        print(format_row(rows[-1]), flush=True)
    too_large = [f"{r['preset']} {r['phase']} {r['micro']} x {r['seq_len']}" for r in rows if r["ours"] == "OOM"]
    if too_large:
        message = (f"out of memory on {args.device} in {len(too_large)} of {len(rows)} rows ({', '.join(too_large)} "
                   f"tokens): lower --micro_tokens or --seq_lens, or choose smaller --presets")
        if len(too_large) == len(rows):
            raise InputError(message)
        print(f"note: {message}")
    if args.json:
        write_text(args.json, json.dumps(rows, indent=1))
    return rows


def measure_or_oom(args, s):
    """measure(), or the row of a setting too large for the device: a sweep goes on past it."""
    import torch
    try:
        return measure(args, s)
    except Exception as e:
        if not out_of_memory(e):
            raise
        return out_of_memory_row(args, s)
    finally:
        if args.device.type == "cuda":
            torch.cuda.empty_cache()  # what the row's models and batch held


def cells(m):
    """tokens/s, MFU and peak GiB of one side of a row, as text ('OOM' fills the first; '-' where not timed)."""
    if m is None:
        return ["-", "-", "-"]
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
# The GPU report: the gpu test suite, the attention kernels and the training step's levers, in one markdown file

# What gpu-report times after the suite. The attention kernels at the paper's shape (base: 12 heads of 64), then the
# training rows in the order they run (a row the time limit leaves out is listed as not run): the paper's step as
# train.py runs it today, one lever at a time against it, then ours against transformers at 1,024 tokens.
ATTENTION = dict(B=4, T=8192, H=12, D=64)
TODAY = Setting("base", "mlm", 8192, 4, peer=False)
LEVERS = [("today's step", TODAY), ("--backend=flex+sdpa", dataclasses.replace(TODAY, backend="flex+sdpa")),
          ("today's step", dataclasses.replace(TODAY, phase="clm")),
          ("--backend=flex+sdpa", dataclasses.replace(TODAY, phase="clm", backend="flex+sdpa")),
          ("--loss=fused", dataclasses.replace(TODAY, loss="fused")),
          ("--backend=flash", dataclasses.replace(TODAY, backend="flash")),
          ("against transformers", Setting("base", "mlm", 1024, 32)),
          ("against transformers", Setting("base", "clm", 1024, 32)),
          ("a bf16 residual stream", dataclasses.replace(TODAY, residual="bf16")),
          ("flex+sdpa, bf16 residual, 8 a micro-batch", dataclasses.replace(TODAY, backend="flex+sdpa",
                                                                           residual="bf16", micro=8)),
          ("--backend=flex+sdpa against transformers", Setting("base", "mlm", 1024, 32, "flex+sdpa")),
          ("inductor times its kernels", dataclasses.replace(TODAY, deterministic=False)),
          ("8 sequences a micro-batch", dataclasses.replace(TODAY, micro=8)),
          ("the whole encoder compiled", dataclasses.replace(TODAY, compile="model"))]
ROW_SECONDS = 45  # a training row's compilation and steps, at most, on an H200 under gpu-report (a row needs this)


def attention_section(rows, shape, device):
    dtype = "bf16" if device.type == "cuda" else "fp32"
    lines = [f"## Attention kernels: one layer, forward and backward, {shape['B']} x {shape['T']:,} tokens, "
             f"{shape['H']} heads of {shape['D']}, {dtype}", "", "TFLOP/s by model.flops_per_token's count (12 d per "
             "key and token, forward and backward; a causal global layer counts half its keys, a local one 129 or 65)."
             " Median of 10 after 3 warm-ups.", "", "| layer | kernel | ms | TFLOP/s |", "|---|---|---:|---:|"]
    for layer, kernel, ms, speed in rows:
        lines.append(f"| {layer} | {kernel} | {ms:.2f} | {speed:.1f} |" if ms is not None
                     else f"| {layer} | {kernel} | refused | {gpureport.cell(speed)} |")
    return "\n".join(lines) + "\n"


def levers_section(rows, args):
    """The training rows: each against today's step of its phase and length, and against transformers."""
    lines = ["## Training steps: the levers, each against today's step", "",
             f"base, bf16 autocast, {args.warmup} warm-up steps then the median of {args.steps}; MFU against the GPU's "
             "dense bf16 peak (model.flops_per_token, attention included); peak GiB: weights and Adam state plus the "
             "most a step allocated. Loss: ours (and transformers') on the same first batch, before training.", "",
             "| row | phase | seq x micro | attention | loss | compile | inductor | residual | tok/s | MFU | peak GiB | "
             "vs today's step | transformers: attention | tok/s | ratio | loss ours / transformers |",
             "|---|---|---|---|---|---|---|---|---:|---:|---:|---:|---|---:|---:|---|"]
    today = {(r["phase"], r["seq_len"]): r for label, r in rows if label == "today's step" and r}
    for label, r in rows:
        if r is None:
            lines.append(f"| {label} | | | | | | | | not run: the time limit | | | | | | | |")
            continue
        base = today.get((r["phase"], r["seq_len"]))
        timed = isinstance(r["ours"], dict) and base and isinstance(base["ours"], dict) and base is not r
        versus = f"{r['ours']['tokens_per_s'] / base['ours']['tokens_per_s']:.2f}x" if timed else "-"
        inductor = "deterministic" if r["deterministic"] else "timed"
        lines.append(f"| {label} | {r['phase']} | {r['seq_len']:,} x {r['micro']} | {r['backend']} | {r['loss']} | "
                     f"{r['compile']} | "
                     f"{inductor} | {r['residual']} | " + " | ".join(cells(r["ours"])) + f" | {versus} | "
                     f"{r['peer_attention']} | {cells(r['peer'])[0]} | {ratio(r)} | {loss(r['loss_ours'])} / "
                     f"{loss(r['loss_peer'])} |")
    return "\n".join(lines) + "\n"


def gpu_report(args):
    """The gpu suite in processes of its own (each test's result kept as it ends), then in this process, alone on
    the GPU, the attention kernels and the training rows (LEVERS), within --minutes: the suite gets half, a training
    row starts only where ROW_SECONDS remain. One markdown file, rewritten after each part, whatever failed. Exit
    status 1 if a test, a kernel or a row failed, or the time ran out."""
    import torch
    started, start = gpureport.now(), time.monotonic()
    deadline = start + args.minutes * 60
    suite = SUITE if (args.workers or 1) == 1 else f"{SUITE} -n {args.workers}"
    command = f"python bench.py gpu-report --out={args.out} --minutes={args.minutes:g}"
    env = gpureport.environment(args.device)
    train_args = argparse.Namespace(device=args.device, warmup=3, steps=10, peer_attention="auto")
    parts = {}

    def write():
        minutes = (time.monotonic() - start) / 60
        write_text(args.out, gpureport.header(started, command, minutes, args.minutes, env) + "\n"
                   + "\n".join(parts.values()))

    with tempfile.TemporaryDirectory() as tmp:
        code, seconds = gpureport.run_suite(suite, Path(tmp) / "results.jsonl", (deadline - start) / 2)
        results = gpureport.suite_results(Path(tmp) / "results.jsonl")
    parts["suite"] = gpureport.suite_section(results, suite, seconds, code is None)
    write()
    failures = [f"{r[0]}: {r[1]}" for r in results if r[1] in ("failed", "error")] + ["the suite's time ran out"] * (
        code is None)
    torch.set_num_threads(args.threads)
    try:
        kernels = attention_rows(args.device, **ATTENTION)
        failures += [f"{layer} {kernel}: {note}" for layer, kernel, ms, note in kernels if ms is None]
        parts["attention"] = attention_section(kernels, ATTENTION, args.device)
    except Exception as e:  # the report still says what the suite found
        traceback.print_exc()
        failures.append(f"attention kernels: {type(e).__name__}: {e}")
        parts["attention"] = f"## Attention kernels\n\nStopped: `{gpureport.cell(f'{type(e).__name__}: {e}', 400)}`\n"
    write()
    rows = []
    for label, s in LEVERS:
        if time.monotonic() + ROW_SECONDS > deadline:
            rows.append((label, None))
            failures.append(f"{label}: not run (time)")
        else:
            try:
                rows.append((label, measure_or_oom(train_args, s)))
                print(format_row(rows[-1][1]), flush=True)
            except Exception as e:  # a lever that fails is a row that says so; the others still run
                traceback.print_exc()
                failures.append(f"{label}: {type(e).__name__}: {e}")
                rows.append((label, dict(dataclasses.asdict(s), tokens=s.micro * s.seq_len, backend=s.backend,
                                         peer_attention="-", ours=f"failed: {type(e).__name__}", peer=None,
                                         loss_ours=None, loss_peer=None)))
        parts["levers"] = levers_section(rows, train_args)
        write()
    print(f"wrote {args.out}: {len(results)} tests, {len(rows)} training rows, {len(failures)} problem(s)"
          + "".join(f"\n  {f[:200]}" for f in failures))
    return 1 if failures else 0


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


def compile_scope(text):
    """argparse type: what bench.py train compiles (blocks, model or none; true and false as blocks and none)."""
    scope = {"true": "blocks", "false": "none"}.get(text.lower(), text.lower())
    if scope not in ("blocks", "model", "none"):
        raise argparse.ArgumentTypeError("expected blocks, model or none (true: blocks, false: none)")
    return scope


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
    t.add_argument("--compile", type=compile_scope, default=None,
                   help="blocks (or true): torch.compile each block, as train.py does, the peer's too; model: our "
                        "whole encoder in one graph; none (or false). None: blocks on CUDA, none on a CPU (where "
                        "blocks measured 1.01-1.05x for 11 s or more of compilation)")
    t.add_argument("--deterministic", type=flag_bool, default=True,
                   help="inductor's deterministic mode, as train.py sets it (false: it times its kernels' settings)")
    t.add_argument("--residual", default="fp32", choices=["fp32", "bf16"],
                   help="the residual stream's dtype under bf16 autocast (bf16: the embeddings' output cast once)")
    t.add_argument("--backend", default="auto", choices=["auto", *BACKENDS], help="our attention backend")
    t.add_argument("--loss", default="plain", choices=LOSSES,
                   help="our loss, as train.py's --loss (docs/gpu.md's tables of 2026-11-28 were measured with fused, "
                        "then train.py's default)")
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
    g.add_argument("--minutes", type=positive_float, default=9.0,
                   help="the time it may take: half for the suite, then the kernels and the training rows that fit")
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
        args.device = torch.device("cuda", torch.cuda.current_device())
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
        args.compile = "blocks" if args.device.type == "cuda" else "none"


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
