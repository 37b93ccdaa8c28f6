"""The GPU acceptance suite, `python -m pytest -m gpu` (`python bench.py gpu-report` runs it and writes its
results to one file): every CUDA path of the recipe, each test asserting numbers. FlexAttention and flash-attn
against model.py's reference attention, bf16 autocast training with each attention backend against an fp32
reference, compiled blocks against eager ones, the trainer's command line under torchrun (NCCL), parity with
transformers, the activation-memory prediction against the CUDA allocator, and the host syncs of a training step.
Without CUDA every test is collected and skipped.

Tolerances, stated once. bf16 keeps 8 significant bits: one rounding errs by up to 2^-8 = 0.4% of the value,
and a value passes through about ten rounded matmuls and casts between the embeddings and the loss. A mean
over hundreds of labelled positions averages these errors, so the loss stays within 1% of fp32; a gradient
is a sum of such terms, so its direction stays within cosine 0.99 of fp32's and its norm within 5%. (CPU
bf16 autocast on the same batches: loss within 2e-5, cosines above 0.9996, norms within 0.2%.) A wrong mask
moves gradients far outside these bounds: the fp32 gradients of the other mode (causal for bidirectional)
have cosines near 0.5 with the right ones, and the backend tests check that they fail the bound."""
import contextlib
import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import bench
import data
import train
from conftest import BYTE_IDS, ROOT, tiny_model, torch_adamw_oracle
from machinery import kernels
from machinery.cli import autocast
from machinery.gpureport import children
from model import BACKENDS, IGNORE_INDEX, ModernBERT, ModernBERTConfig
from test_backends import LAYOUTS, attend, attention_case, largest_difference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")
# the flash backend runs flash-attn's kernel where it is installed, else PyTorch's own (>= 2.11)
FLASH = kernels.Flash.available(CUDA) if torch.cuda.is_available() else False


def by_name(*names):
    """Attention backends as test parameters, each tested by name (never auto's pick on this machine); flash
    skipped, saying so, where neither of its kernels is here."""
    return [pytest.param(name, marks=pytest.mark.skipif(
        name == "flash" and not FLASH, reason="neither flash-attn nor PyTorch >= 2.11's varlen_attn is here "
                                              "(tests/test_backends.py runs their doubles)"))
        for name in names]


T = 256  # two FlexAttention blocks of 128 tokens, longer than a local layer's window (64 on each side)
LOSS_RTOL, MIN_COSINE, NORM_RTOL = 1e-2, 0.99, 0.05  # bf16 against fp32: see the module's docstring


@pytest.fixture(autouse=True)
def fresh_compiler_and_ieee_fp32():
    """Each test compiles from an empty dynamo cache: earlier tests' FlexAttention graphs would count against
    dynamo's limit of 8 per function, past which it runs eager (and eager FlexAttention materialises every
    score). fp32 means IEEE fp32 here: TF32, which train.py enables, keeps 10 bits of a matmul's inputs."""
    torch._dynamo.reset()
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ----------------------------------------------------------------------------
# Batches, losses and gradients


def make_batch(layout, causal, seed=0, B=3):
    """(ids on the GPU, attention_mask, labels on the host as train.py keeps them, doc_ids). padded: rows of
    256, 180 and 37 real tokens; packed: full rows of documents of random lengths (80 tokens on average).
    Labels: the next token (causal), or 30% of the real tokens (bidirectional)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    real = torch.ones(B, T, dtype=torch.bool)
    mask = docs = None
    if layout == "padded":
        real = torch.arange(T)[None, :] < torch.tensor([256, 180, 37][:B])[:, None]
        ids[~real] = BYTE_IDS["pad_token_id"]
        mask = real.long().to(CUDA)
    else:
        docs = (torch.rand(B, T, generator=g) < 1 / 80).cumsum(1).to(CUDA)
    if causal:
        labels = torch.full((B, T), IGNORE_INDEX)
        labels[:, :-1] = torch.where(real[:, 1:], ids[:, 1:], IGNORE_INDEX)
    else:
        labels = torch.where(real & (torch.rand(B, T, generator=g) < 0.3), ids, IGNORE_INDEX)
    return ids.to(CUDA), mask, labels, docs


def loss_and_grads(model, batch, causal, bf16):
    """The training loss and every parameter's gradient (fp32 copies), under bf16 autocast or in fp32."""
    ids, mask, labels, docs = batch
    model.zero_grad(set_to_none=True)
    with autocast(CUDA) if bf16 else contextlib.nullcontext():
        loss = model(ids, mask, labels=labels, causal=causal, doc_ids=docs)[1]
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def cosine(a, b):
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def assert_close_in_bf16(got, want, what, loss_rtol=LOSS_RTOL):
    """got and want are (loss, gradients): the loss within loss_rtol, each gradient within MIN_COSINE in
    direction and NORM_RTOL in norm."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), f"{what}: loss {loss:.5f}, reference {ref_loss:.5f}"
    for name, ref in ref_grads.items():
        c, ratio = cosine(grads[name], ref), (grads[name].norm() / ref.norm()).item()
        assert c > MIN_COSINE and abs(ratio - 1) < NORM_RTOL, f"{what}: {name}: cosine {c:.5f}, norm ratio {ratio:.4f}"


# ----------------------------------------------------------------------------
# The trainer's command line under torchrun: NCCL, bf16, compiled FlexAttention, checkpoints. The longest tests,
# marked `torchrun`: a suite shared among processes starts each first in a process of its own (conftest.py).


STEPS, STEP_TOKENS = 40, 8 * 128  # the smoke recipe: tiny model, 8 sequences of 128 tokens per step
SMOKE = ["--recipe=smoke", "--phase=clm", "--save_interval=4", "--eval_interval=1000"]


def torchrun_command(*flags, nproc=1):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / "train.py"), *flags]


def torchrun(*flags, env=None):
    result = subprocess.run(torchrun_command(*flags), capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def train_records(out):
    """The training records of OUT/log.jsonl (validation records have no loss)."""
    records = [json.loads(line) for line in open(out / "log.jsonl")]
    return [r for r in records if "loss" in r]


@pytest.fixture(scope="module")
def clm_run(demo_corpus, tmp_path_factory):
    """An uninterrupted CLM run of STEPS steps on the GPU: (OUT, its stdout)."""
    out = tmp_path_factory.mktemp("cli") / "clm"
    return out, torchrun(*SMOKE, f"--data={demo_corpus}", f"--tokens={STEPS * STEP_TOKENS}", f"--out_dir={out}")


@pytest.mark.torchrun
def test_trainer_trains_clm_on_the_gpu_under_torchrun(clm_run):
    out, stdout = clm_run
    assert "device cuda" in stdout  # the run's header
    records = train_records(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and {r["phase"] for r in records} == {"clm"}
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]  # it learns
    peak = train.peak_flops(torch.device(CUDA))
    if peak is None:
        assert all(r["mfu"] is None for r in records)
        return
    with torch.device("meta"):  # CLM predicts every token: mask_rate 1
        flops = ModernBERT(ModernBERTConfig.read(str(out / "config.json"))).flops_per_token(128, causal=True, mask_rate=1.0)
    for r in records:  # the log rounds mfu to 4 decimals and tokens/s to an integer
        assert abs(r["mfu"] - flops * r["tokens_per_s"] / peak) <= 5e-5 + 0.01 * r["mfu"], r


@pytest.mark.torchrun
def test_phase_hand_off_to_decay_on_the_gpu(clm_run, tmp_path):
    clm, _ = clm_run
    decay = tmp_path / "decay"
    torchrun("--phase=decay", f"--init_from={clm}", f"--tokens={2 * STEP_TOKENS}", f"--out_dir={decay}")
    records = train_records(decay)
    assert [r["phase"] for r in records] == ["decay", "decay"]
    assert all(math.isfinite(r["loss"]) for r in records)
    before, after = load_file(clm / "model.safetensors"), load_file(decay / "model.safetensors")
    moved = math.sqrt(sum((after[k] - before[k]).double().norm() ** 2 for k in before))
    size = math.sqrt(sum(before[k].double().norm() ** 2 for k in before))
    # two AdamW steps of about lr = 2e-3 per weight move the weights by 1.6% of their norm (measured on a CPU);
    # a fresh model is 33% away (its matrices all differ; the LayerNorm weights near 1 dominate the norm)
    assert 0 < moved / size < 0.1, moved / size


def weights_stamp(out):
    """Identifies the checkpoint OUT/model.safetensors holds now (None while a save swaps it)."""
    try:
        s = os.stat(out / "model.safetensors")
    except FileNotFoundError:
        return None
    return s.st_ino, s.st_mtime_ns, s.st_size


def kill_after_next_checkpoint(proc, out, stamp):
    """SIGKILL torchrun's training process once OUT holds a checkpoint other than `stamp`. False if the run
    ended first. torchrun starts its worker in a session of its own, so the worker is killed by its pid."""
    deadline = time.time() + 300
    while proc.poll() is None:
        if weights_stamp(out) not in (None, stamp):
            for pid in children(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return proc.wait(timeout=120) != 0
        assert time.time() < deadline, "no new checkpoint within 5 minutes"
        time.sleep(0.01)
    return False


# Kill-and-resume, five times with inductor's deterministic mode (gpu-report runs them beside the other tests, so
# other processes share the GPU), two of them with compile caches of their own, once with dropout (the CUDA RNG's
# restore counts), and twice as a control without the mode.
RESUMES = [pytest.param([], False, id=f"deterministic-{i}") for i in (1, 2, 3)] + [
    pytest.param([], True, id=f"deterministic-own-caches-{i}") for i in (4, 5)] + [
    pytest.param(["--dropout=0.1"], False, id="dropout")] + [
    pytest.param(["--deterministic=false"], False, id=f"control-{i}") for i in (1, 2)]


def caches(own, folder, process):
    """The environment of one training process: the machine's shared compile caches, or (own) inductor's and
    Triton's in a folder of the process's own, so that nothing one process compiled is loaded by another: where
    only the runs that share caches differ, the caches are the cause."""
    if not own:
        return None
    where = folder / f"caches-{process}"
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(where / "inductor"), "TRITON_CACHE_DIR": str(where / "triton")}


@pytest.mark.torchrun
@pytest.mark.parametrize("flags, own_caches", RESUMES)
def test_stop_kill_and_resume_equal_the_uninterrupted_run(flags, own_caches, demo_corpus, tmp_path, record_property):
    """--max_steps stops the run with a checkpoint; --resume continues it, is SIGKILLed after its next
    checkpoint, and --resume finishes it: each step logged once, and the last loss within rounding of the
    uninterrupted run's (what a run on CUDA promises: kernels.resume_caveat); whether the weights are the same bit
    for bit is recorded (on an H200, 2026-11-28: in none of five with inductor's deterministic mode and shared
    caches; in the one control)."""
    control = "--deterministic=false" in flags
    run = [*SMOKE, f"--data={demo_corpus}", f"--tokens={STEPS * STEP_TOKENS}", *flags]
    straight, out = tmp_path / "straight", tmp_path / "clm"
    both = [subprocess.Popen(torchrun_command(*run, *where), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=caches(own_caches, tmp_path, name))
            for name, where in (("straight", [f"--out_dir={straight}"]), ("stopped", [f"--out_dir={out}", "--max_steps=3"]))]
    for proc in both:
        output = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, output[-3000:]
    assert [r["step"] for r in train_records(out)] == [1, 2, 3]
    again = ["--resume", f"--out_dir={out}", *(["--deterministic=false"] if control else [])]  # per invocation
    with open(tmp_path / "killed.txt", "w") as log:
        proc = subprocess.Popen(torchrun_command(*again), stdout=log, stderr=subprocess.STDOUT,
                                env=caches(own_caches, tmp_path, "killed"))
        assert kill_after_next_checkpoint(proc, out, weights_stamp(out)), "the run ended before the kill"
    torchrun(*again, env=caches(own_caches, tmp_path, "resumed"))
    assert [r["step"] for r in train_records(out)] == list(range(1, STEPS + 1))  # each step logged once
    want, got = load_file(straight / "model.safetensors"), load_file(out / "model.safetensors")
    differ = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
    record_property("bit_for_bit", not differ)
    record_property("largest_difference", max(differ.values(), default=0.0))
    last = [train_records(d)[-1]["loss"] for d in (out, straight)]
    assert abs(last[0] - last[1]) <= LOSS_RTOL * last[1], last


# ----------------------------------------------------------------------------
# The fast attention equals model.py's reference


@pytest.mark.parametrize("padded, separate_docs", LAYOUTS)
@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", by_name("flex", "flash", "flex+sdpa"))
def test_fast_attention_equals_the_reference_on_the_gpu(backend, causal, local, padded, separate_docs):
    """One layer's attention, forward and backward, against model.reference_attention in fp32 on the same inputs,
    as tests/test_backends.py does on a CPU: compiled FlexAttention in fp32 to fp32 rounding (1e-5); flash-attn,
    which takes bf16 only, on inputs rounded to bf16, within 2% of the largest output and gradient (one bf16
    rounding is 0.4%; a wrong mask moves the outputs by more than their largest value)."""
    qkv, token_mask, doc_ids, out_grad = attention_case(padded, separate_docs, CUDA)
    dtype = torch.float32 if BACKENDS[backend].computes(CUDA, torch.float32) else torch.bfloat16
    qkv, out_grad = [t.to(dtype).float() for t in qkv], out_grad.to(dtype).float()  # what the backend sees, exactly
    want = attend("reference", qkv, causal, local, token_mask, doc_ids, out_grad)
    got = attend(backend, qkv, causal, local, token_mask, doc_ids, out_grad, dtype)
    out_error, grad_error = largest_difference(got, want)
    out_scale, grad_scale = want[0].abs().max().item(), max(g.abs().max().item() for g in want[1])
    if dtype == torch.float32:
        assert out_error <= 1e-5 and grad_error <= 1e-5, (out_error, grad_error)
    else:
        assert out_error <= 2e-2 * out_scale and grad_error <= 2e-2 * grad_scale, (out_error, grad_error)
    wrong = attend("reference", qkv, not causal, local, token_mask, doc_ids, out_grad)
    assert largest_difference(wrong, want)[0] > out_scale / 2


# ----------------------------------------------------------------------------
# Every attention backend trains in bf16


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", by_name(*BACKENDS))
def test_backend_trains_in_bf16_close_to_fp32(backend, causal, layout):
    """Forward, backward and a train.AdamW step under bf16 autocast, against the fp32 SDPA reference of the
    same weights (SDPA's fp32 equals transformers to 1e-4 on a CPU, tests/test_model.py); the step against
    torch.optim.AdamW on the same gradients."""
    model = tiny_model().to(CUDA).train()  # dropout 0: train mode changes nothing but autograd's bookkeeping
    batch = make_batch(layout, causal)
    model.backend = "sdpa"
    reference = loss_and_grads(model, batch, causal, bf16=False)
    other_mode = loss_and_grads(model, batch, not causal, bf16=False)
    model.backend = backend
    got = loss_and_grads(model, batch, causal, bf16=True)
    assert_close_in_bf16(got, reference, f"{backend} bf16 against sdpa fp32")
    assert min(cosine(other_mode[1][n], g) for n, g in reference[1].items()) < MIN_COSINE  # a wrong mask shows

    lr, wd = 1e-3, 0.1  # a large decay, so that the decoupled scaling is visible
    twin = copy.deepcopy(model)
    for name, p in twin.named_parameters():
        p.grad = got[1][name].clone()
    oracle = torch_adamw_oracle(twin, lr, wd)
    train.AdamW(model.param_groups(), lr, weight_decay=wd).step(lr)
    oracle.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")
    after = loss_and_grads(model, batch, causal, bf16=True)[0]
    assert after < got[0] - 0.01, f"one step did not lower the loss on its own batch: {got[0]:.4f} -> {after:.4f}"


# ----------------------------------------------------------------------------
# torch.compile of the blocks


@pytest.mark.filterwarnings("error:_compile flag on create_block_mask:DeprecationWarning")
@pytest.mark.parametrize("backend", by_name(*BACKENDS))
def test_compiled_blocks_match_eager_and_never_recompile(backend):
    """Regional compilation as train.py does it, on CUDA (inductor, each backend's attention inside the blocks):
    the same losses and gradients as the eager blocks in bf16, no graph break (flash-attn registers its kernels
    as torch.library ops from 2.7 on: requirements.txt), and no new graph once both modes have run, while the
    number of labelled positions changes at every step."""
    from torch._dynamo.utils import counters
    counters.clear()
    eager, compiled = tiny_model().to(CUDA).train(), tiny_model().to(CUDA).train()
    eager.backend = compiled.backend = backend
    kernels.compile_blocks(compiled)
    kinds = len({(i == 0, block.local) for i, block in enumerate(compiled.model.layers)})  # 0, global, local
    g = torch.Generator().manual_seed(0)
    graphs = []
    for step in range(6):
        ids = torch.randint(0, 256, (4, T), generator=g)
        rate = 0.1 + 0.15 * step  # a different number of labelled positions each step
        labels = torch.where(torch.rand(4, T, generator=g) < rate, ids, IGNORE_INDEX)
        causal = step % 2 == 1  # steps 0 and 1 compile both modes; any graph after that is a recompilation
        batch = ids.to(CUDA), None, labels, None
        want = loss_and_grads(eager, batch, causal, bf16=True)
        before = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=step >= 2):
            got = loss_and_grads(compiled, batch, causal, bf16=True)
        if step == 0:
            assert counters["stats"]["unique_graphs"] - before >= kinds, "the blocks did not compile"
        graphs.append(counters["stats"]["unique_graphs"])
        # inductor fuses element-wise ops and rounds their result to bf16 once, where eager rounds each op:
        # differences of bf16's rounding, averaged over the labelled positions, so half the fp32 tolerance
        assert_close_in_bf16(got, want, f"step {step}: compiled against eager", loss_rtol=LOSS_RTOL / 2)
    assert graphs[2:] == [graphs[1]] * 4, f"graphs after each step: {graphs}"
    assert not counters["graph_break"], f"{backend}: graph breaks {dict(counters['graph_break'])}"


# ----------------------------------------------------------------------------
# DDP over compiled blocks, and repeatability


@pytest.mark.torchrun
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP needs 2 GPUs (NCCL over one is no process group)")
def test_compiled_blocks_under_ddp_match_eager_ones(demo_corpus, tmp_path):
    """torchrun on 2 GPUs (NCCL), 2 accumulation steps (gradients all-reduced on the last only), inductor-compiled
    blocks against eager ones: DDP wraps the model whose blocks dynamo compiled, and splits their graphs at its
    gradient buckets. Inductor fuses element-wise ops and rounds to bf16 once where eager rounds each: the
    logged and validation losses within half the bf16 tolerance (tests/test_compile.py checks the same run
    bit for bit on a CPU, where the compiled graphs run PyTorch's own kernels)."""
    flags = [*SMOKE[:2], f"--data={demo_corpus}", "--batch_size=8", "--micro_batch_size=2", "--eval_interval=3",
             f"--tokens={6 * STEP_TOKENS}", "--save_interval=0"]
    logs = {}
    for compiled in (True, False):
        out = tmp_path / f"compile-{compiled}"
        result = subprocess.run(torchrun_command(*flags, f"--compile={compiled}", f"--out_dir={out}", nproc=2),
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "2 micro x 2 accumulation x 2 process(es)" in result.stdout
        logs[compiled] = [json.loads(line) for line in open(out / "log.jsonl")]
    for got, want in zip(logs[True], logs[False], strict=True):
        for key in ("loss", "val_mlm", "val_clm"):
            if key in want:
                assert abs(got[key] - want[key]) <= LOSS_RTOL / 2 * want[key], (key, got, want)


def ddp_losses(device, group_backend, compiler, steps=3, accum=2):
    """Each micro-batch's loss of a few AdamW steps of the tiny model wrapped in DDP over a process group of one
    process, its blocks compiled by `compiler` (None: eager), `accum` micro-batches a step with the gradient
    all-reduce on the last only, as train.py runs it. The labels stay on the host, as train.py keeps them."""
    import torch.distributed as dist
    # NCCL's device_id needs the GPU's index ("cuda" alone is refused); train.py's pick_device always gives one
    dist.init_process_group(group_backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", device.index or 0) if device.type == "cuda" else None)
    try:
        torch._dynamo.reset()
        model = tiny_model().to(device).train()
        if compiler:
            kernels.compile_blocks(model, compiler)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer, g, losses = train.AdamW(model.param_groups(), 1e-3), torch.Generator().manual_seed(0), []
        for _ in range(steps):
            for micro in range(accum):
                ddp.require_backward_grad_sync = micro == accum - 1
                ids = torch.randint(0, 256, (2, T), generator=g)
                labels = torch.where(torch.rand(2, T, generator=g) < 0.3, ids, IGNORE_INDEX)
                with autocast(device):
                    loss = ddp(ids.to(device), labels=labels)[1]
                (loss / accum).backward()
                losses.append(loss.item())
            optimizer.step(1e-3)
            for p in model.parameters():
                p.grad = None
        return losses
    finally:
        dist.destroy_process_group()


def test_compiled_blocks_under_ddp_on_one_gpu_match_eager_ones():
    """DDP over NCCL on one GPU, blocks compiled by inductor against eager blocks under the same DDP: the path
    where dynamo splits the compiled blocks' graphs at DDP's gradient buckets runs on any GPU machine, not only
    on one with two (the torchrun test above). Losses within half the bf16 tolerance, as there."""
    compiled, eager = ddp_losses(CUDA, "nccl", "inductor"), ddp_losses(CUDA, "nccl", None)
    assert len(compiled) == len(eager) == 6
    for got, want in zip(compiled, eager):
        assert math.isfinite(got) and abs(got - want) <= LOSS_RTOL / 2 * want, (compiled, eager)


@pytest.mark.parametrize("backend", by_name(*BACKENDS))
def test_training_repeats_bit_for_bit_where_the_backend_says_so(backend, record_property):
    """What --resume's bit-for-bit promise rests on: the same steps from the same weights give the same weights.
    At 1,024 tokens (8 key blocks of 128), where a backward that adds up dQ with atomics in a varying order
    would differ. A backend whose `nondeterminism` is None (FlexAttention, whose backward has no atomics;
    flash-attn, asked for its deterministic backward; the reference) must repeat bit for bit; the others (SDPA on
    CUDA, PyTorch's FlashAttention) must stay within rounding, and whether they repeated is recorded: the
    determinism table of docs/gpu.md, measured."""
    def train_steps():
        model = tiny_model().to(CUDA).train()
        model.backend = backend
        optimizer = train.AdamW(model.param_groups(), 1e-3)
        g = torch.Generator().manual_seed(0)
        for step in range(3):
            ids = torch.randint(0, 256, (2, 1024), generator=g)
            labels = torch.where(torch.rand(2, 1024, generator=g) < 0.3, ids, IGNORE_INDEX)
            with autocast(CUDA):
                model(ids.to(CUDA), labels=labels, causal=step == 1)[1].backward()
            optimizer.step(1e-3)
            model.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    first, second = train_steps(), train_steps()
    differ = {n: (first[n] - second[n]).abs().max().item() for n in first if not torch.equal(first[n], second[n])}
    record_property("bit_for_bit", not differ)
    if BACKENDS[backend].nondeterminism(CUDA) is None:
        assert not differ, f"{backend}: {len(differ)} of {len(first)} tensors differ between two runs: {differ}"
    else:  # three AdamW steps of 1e-3 move a weight by about 3e-3: rounding moves it by far less
        assert max(differ.values(), default=0.0) < 1e-3, differ


@pytest.mark.skipif(not torch.cuda.is_available() or kernels.optional("varlen_attn") is None,
                    reason="PyTorch's varlen_attn (>= 2.11) is not here")
def test_pytorch_flash_backward_repeats_only_under_deterministic_algorithms(record_property):
    """Flash.nondeterminism's reason, measured: PyTorch's FlashAttention backward repeats its dQ bit for bit under
    torch.use_deterministic_algorithms(True) (which the trainer does not turn on); whether it repeated without it,
    over five backwards of 4 x 2,048 tokens, is recorded."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    q, k, v, grad = (torch.randn(4 * 2048, 12, 64, device=CUDA, dtype=torch.bfloat16, generator=g) for _ in range(4))
    cu = torch.arange(0, 4 * 2048 + 1, 2048, dtype=torch.int32, device=CUDA)

    def dq():
        leaf = q.detach().requires_grad_()
        return torch.autograd.grad(kernels.optional("varlen_attn")(leaf, k, v, cu, cu, 2048, 2048), leaf, grad)[0]

    free = [dq() for _ in range(5)]
    record_property("repeats_without", all(torch.equal(free[0], d) for d in free[1:]))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        fixed = [dq() for _ in range(5)]
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(fixed[0], d) for d in fixed[1:])
    assert (fixed[0].float() - free[0].float()).abs().max().item() < 1e-2 * free[0].float().abs().max().item()


# ----------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional-padded", "causal"])
@pytest.mark.parametrize("backend", by_name(*BACKENDS))
def test_parity_with_transformers_on_the_gpu(tmp_path, backend, causal):
    """Our model with each backend and ModernBertForMaskedLM (SDPA) on the same weights: logits and loss equal in
    fp32 (where the backend computes fp32: flash-attn does not) and within bf16's rounding under autocast.
    transformers has no causal mode: it takes the causal masks explicitly, as bench.py gives them."""
    from test_model import SHAPES, hf_checkpoint, padded_batch
    hf = hf_checkpoint(tmp_path, SHAPES[0]).to(CUDA)  # norms and biases perturbed, so that they count
    ours = ModernBERT.from_pretrained(str(tmp_path), backend=backend).to(CUDA).eval()
    fp32 = BACKENDS[backend].computes(CUDA, torch.float32)
    ids, mask = padded_batch(300, T=T, lengths=(T, T, T) if causal else (T, 180, 37))
    labels = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.3, ids, IGNORE_INDEX)
    labels[mask == 0] = IGNORE_INDEX
    ids, mask = ids.to(CUDA), mask.to(CUDA)
    hf_mask = bench.causal_masks(T, ours.config.window, CUDA) if causal else mask
    real = mask.bool()
    out = {}
    for bf16 in (False, True):
        with torch.no_grad(), autocast(CUDA) if bf16 else contextlib.nullcontext():
            if bf16 or fp32:
                out["ours", bf16] = ours(ids, None if causal else mask, causal=causal)[0].float()[real], \
                    ours(ids, None if causal else mask, labels=labels, causal=causal)[1].item()
            hf_out = hf(input_ids=ids, attention_mask=hf_mask, labels=labels.to(CUDA))
            out["hf", bf16] = hf_out.logits.float()[real], hf_out.loss.item()
    scale = out["hf", False][0].abs().max().item()
    if fp32:
        error = (out["ours", False][0] - out["hf", False][0]).abs().max().item()
        # the same computation, as on a CPU (tests/test_model.py); this is the check that sees a wrong mask:
        # without its padding mask transformers' logits move by 0.8% of the largest (5e-3 here, measured on a CPU)
        assert error <= 1e-4 * max(1.0, scale), error
        assert abs(out["ours", False][1] - out["hf", False][1]) <= 1e-5 * out["hf", False][1]
    # in bf16 both round; ours may differ from transformers by a few roundings of the largest logit
    bf16 = (out["ours", True][0] - out["hf", True][0]).abs().max().item()
    assert bf16 <= 2e-2 * scale, (bf16, scale)
    assert abs(out["ours", True][1] - out["hf", True][1]) <= LOSS_RTOL * out["hf", False][1]


# ----------------------------------------------------------------------------
# Memory and host syncs


@pytest.mark.parametrize("phase", ["mlm", "clm"])
def test_activation_memory_prediction_matches_the_allocator(phase):
    """bench.activation_memory (on paper, per token) against torch.cuda.max_memory_allocated during a bf16
    training forward of base at 2 and 4 x 8,192 tokens. The difference of the two peaks is the activations of
    2 x 8,192 tokens: the weights, the loss's fp32 weight gradient and its largest (4,096 x vocab) logits block
    are in both. Within -5% / +10%: the prediction counts what flash-attn keeps; FlexAttention keeps the same
    (q, k, v, output, fp32 log-sum-exp), plus a copy of the attention output if its layout is (B, H, T, D),
    which is 2d bytes per token and layer, +5.5% for base."""
    cfg = ModernBERTConfig.from_preset("base")
    torch.manual_seed(0)
    model = ModernBERT(cfg, "flex", loss="fused").to(CUDA).train()  # what the prediction counts
    rate = 1.0 if phase == "clm" else 0.3

    def forward_peak(micro):
        x, y = bench.batch(cfg.vocab_size, micro, 8192, phase, torch.device("cpu"))  # labels on the host
        x = x.to(CUDA)
        for _ in range(2):  # the second forward: the first one compiles FlexAttention for this shape
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with autocast(CUDA):
                loss = model(x, labels=y, causal=phase == "clm")[1]
            peak = torch.cuda.max_memory_allocated() - before
            del loss  # frees the graph and what it kept
        return peak

    measured = forward_peak(4) - forward_peak(2)
    predicted = bench.activation_memory(cfg, 8192, 4, rate) - bench.activation_memory(cfg, 8192, 2, rate)
    print(f"{phase}: measured {measured / 2**30:.2f} GiB for 2 x 8192 tokens, predicted {predicted / 2**30:.2f}")
    assert 0.95 <= measured / predicted <= 1.10, measured / predicted


@contextlib.contextmanager
def syncs_are_errors():
    """Any CUDA call that makes the host wait for the device raises inside this block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def counted_syncs():
    """The CUDA calls inside the block that make the host wait for the device, as a list of warnings."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_steps_all_reduce_waits_for_the_gpu_once():
    """across_ranks, the end of train.py's step: the host's numbers (labelled tokens, the stop signal) reach the
    GPU in one copy from pinned memory that does not wait; the .tolist() that reads the loss and norm back is the
    step's one documented sync."""
    loss_sum, norm = torch.tensor(7.5, dtype=torch.float64, device=CUDA), torch.tensor(0.25, device=CUDA)
    train.across_ranks(loss_sum, 3, False, norm)  # the first call allocates the pinned block
    with counted_syncs() as syncs:
        result = train.across_ranks(loss_sum, 3, True, norm)
    assert result == (2.5, True, 0.25)
    assert sum("synchroniz" in str(w.message) for w in syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize("separate_documents", [False, True], ids=["across-documents", "separate-documents"])
@pytest.mark.parametrize("backend", by_name(*BACKENDS))
def test_training_step_waits_for_the_gpu_only_where_documented(backend, separate_documents):
    """train.py's step: ids copied from pinned memory without waiting, labels on the host, bf16 forward,
    backward, gradient clipping, AdamW. Its one documented sync is the .tolist() of the logged loss and
    gradient norm, once per step; nothing else in the step may wait for the GPU, but for flash-attn's two with
    documents, documented in machinery/kernels.py: each document is a varlen sequence, so their count (a
    nonzero) and the longest (an int) are read on the host."""
    model = tiny_model().to(CUDA).train()
    model.backend = backend
    documented = 2 if backend == "flash" and separate_documents else 0
    params = list(model.parameters())
    optimizer = train.AdamW(model.param_groups(), 1e-3)
    g, sep = torch.Generator().manual_seed(0), BYTE_IDS["sep_token_id"]

    def forward_backward(rate, causal):
        ids = torch.randint(0, 256, (4, T), generator=g)
        ids[:, 70::90] = sep  # documents end with [SEP]
        labels = torch.where(torch.rand(4, T, generator=g) < rate, ids, IGNORE_INDEX)
        x = ids.pin_memory().to(CUDA, non_blocking=True)
        docs = data.document_ids(x, sep) if separate_documents else None
        with autocast(CUDA):
            loss = model(x, labels=labels, causal=causal, doc_ids=docs)[1]
        loss.backward()
        return torch.stack([loss.detach(), torch.nn.utils.clip_grad_norm_(params, 1.0).float()])

    def update():
        optimizer.step(1e-3)
        for p in params:
            p.grad = None

    for causal in (False, True):  # warm-up: compiling the kernels of both modes may wait for the GPU
        forward_backward(0.3, causal).tolist()
        update()
    for rate, causal in ((0.15, False), (0.5, True), (0.4, False)):  # a new number of labels every step
        if documented:
            with counted_syncs() as syncs:
                shared = forward_backward(rate, causal)
            assert sum("synchroniz" in str(w.message) for w in syncs) == documented, [str(w.message) for w in syncs]
        else:
            with syncs_are_errors():
                shared = forward_backward(rate, causal)
        loss, norm = shared.tolist()  # the documented sync
        with syncs_are_errors():
            update()
        assert math.isfinite(loss) and math.isfinite(norm)
    with syncs_are_errors(), pytest.raises(RuntimeError, match="synchroniz"):
        torch.ones(1, device=CUDA).item()  # the detector works: a sync raises in there
