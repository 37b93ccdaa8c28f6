"""torch.compile of the blocks as train.py does it, run on a CPU by dynamo with backends that generate no code, so
that the graphs, guards and recompilations are those a GPU run makes (only inductor's code generation is left
out): the compile budget over training and both validations, and compiled blocks under DDP over gloo. Also the
start checks that keep a run from a backend its dtype would refuse, and the peak-FLOPS table's lookup."""
import datetime
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

import bench
import fake_flash_attn
import train
from conftest import ROOT, tiny_model
from machinery import cli, kernels, progress
from machinery.cli import InputError
from model import Block

# A tiny run: 128-token sequences, micro-batches of 2, two steps, a validation after each (eval_sequences=3:
# a full batch of 2 and a short one of 1, whose new batch size compiles a dynamic graph).
RUN = ["--preset=tiny", "--seq_len=128", "--batch_size=4", "--micro_batch_size=2", "--tokens=1024",
       "--eval_interval=1", "--eval_sequences=3", "--log_interval=1000", "--save_interval=0",
       "--warmup_tokens=0", "--lr=1e-3", "--compile=true"]


@pytest.fixture
def fake_flash(monkeypatch):
    """The flash backend, trainable on a CPU through the test double of flash-attn."""
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", fake_flash_attn.flash_attn_varlen_func)
    for check in ("available", "auto", "trains"):
        monkeypatch.setattr(kernels.Flash, check, staticmethod(lambda device: True))
    fake_flash_attn.determinism.clear()
    return fake_flash_attn


@pytest.fixture
def default_limit():
    """dynamo as a fresh process has it: no graphs, its default recompile limit of 8 per function."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8):
        yield
    torch._dynamo.reset()


def graphs_of(code):
    """The compiled graphs dynamo keeps for a code object."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(code))


# Graphs of Block.forward over two training steps and two validations, measured with the budget in place. With
# dynamo's default limit of 8 every one of these runs hit it (a warning, then eager blocks for the rest).
GRAPHS = {("sdpa", "mlm", False): 13, ("sdpa", "clm", False): 13, ("sdpa", "mlm", True): 9,
          ("sdpa", "clm", True): 9, ("flash", "mlm", False): 9, ("flash", "clm", False): 9,
          ("flash", "mlm", True): 9, ("flash", "clm", True): 9}


def budget_cases():
    """Each CPU-trainable backend (FlexAttention has no CPU backward: the GPU suite's), training phase and mask
    kind; by default SDPA's MLM on separate documents (3-5 s), the rest with -m slow: SDPA's CLM across
    documents compiles its most graphs (about 12 s), and the flash test double breaks its graphs on .tolist()
    (about 28 s a run)."""
    for backend, phase, separate in GRAPHS:
        slow = (backend, phase, separate) != ("sdpa", "mlm", True)
        yield pytest.param(backend, phase, separate, marks=[pytest.mark.slow] * slow,
                           id=f"{backend}-{phase}-{'separate' if separate else 'across'}-documents")


@pytest.mark.parametrize("backend, phase, separate_documents", budget_cases())
def test_a_run_compiles_within_its_budget(backend, phase, separate_documents, demo_corpus, tmp_path, monkeypatch,
                                          default_limit, request):
    """train.py with compiled blocks: training steps, then MLM and CLM validation, each block kind in each mode,
    with a full and a short validation batch. Every graph fits the budget compile_blocks gives dynamo: a run
    that passed it would stop here (fail_on_recompile_limit_hit) where a real one warns and runs eager."""
    if backend == "flash":
        request.getfixturevalue("fake_flash")
    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()
    monkeypatch.setitem(train.COMPILERS, "cpu", counter)
    flags = [f"--data={demo_corpus}", f"--out_dir={tmp_path / 'run'}", f"--phase={phase}", f"--backend={backend}",
             f"--separate_documents={separate_documents}", *RUN]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        train.main(flags)
    graphs = graphs_of(Block.forward.__code__)
    print(f"{backend} {phase} separate_documents={separate_documents}: Block.forward {graphs} graphs, "
          f"{counter.frame_count} frames in all, limit {torch._dynamo.config.recompile_limit}")
    assert graphs == GRAPHS[backend, phase, separate_documents] and graphs <= torch._dynamo.config.recompile_limit
    assert torch._dynamo.config.recompile_limit == 3 * 3 * 2  # block kinds x modes x (static, dynamic)
    records = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl")]
    assert sum("val_clm" in r for r in records) == 2  # both validations ran, after each step


def test_a_smaller_compile_budget_never_lowers_a_larger_one():
    """configure_compiler only raises dynamo's limit: on a GPU the blocks ask for 18 graphs, then FlexAttention's
    compiled kernel for 12 at its first use; lowered to 12, the blocks' 13th graph would run them eager."""
    with torch._dynamo.config.patch(recompile_limit=8):
        kernels.configure_compiler(18)
        kernels.configure_compiler(12)
        assert torch._dynamo.config.recompile_limit == 18
        kernels.configure_compiler(24)
        assert torch._dynamo.config.recompile_limit == 24

@pytest.mark.slow  # three tiny runs that trace their graphs: about 20 s
def test_a_resumed_process_runs_the_graphs_the_uninterrupted_run_ran(demo_corpus, tmp_path, monkeypatch,
                                                                    default_limit):
    """Kill-and-resume on a GPU is not bit for bit (docs/gpu.md). One candidate cause is ruled out here: a fresh
    process compiles its graphs in another order than the run it continues (the first validation's short batch
    making a size dynamic before the training graph is made, say), and so runs other kernels. Block.forward's
    graph at every call, by grad mode and input shapes (a dynamic size shows as a symbol), is the same sequence
    for 4 steps straight as for 2 steps and a --resume in a fresh dynamo."""
    calls = []

    def recording(gm, example_inputs):  # a backend that runs the traced graph and records which one ran
        graph = (torch.is_grad_enabled(), tuple(str(tuple(x.shape)) if isinstance(x, torch.Tensor) else "dynamic"
                                                for x in example_inputs))
        def run(*args):
            calls.append(graph)
            return gm.forward(*args)
        return run

    monkeypatch.setitem(train.COMPILERS, "cpu", recording)
    flags = [f"--data={demo_corpus}", "--phase=mlm", *(f for f in RUN if not f.startswith("--tokens=")), "--tokens=2048"]
    sequences = []
    for out_dir, extra in ((tmp_path / "straight", []), (tmp_path / "stopped", ["--max_steps=2"]),
                           (tmp_path / "stopped", ["--resume"])):
        torch._dynamo.reset()  # what a fresh process starts with
        calls.clear()
        train.main([*flags, f"--out_dir={out_dir}", *extra])
        sequences.append(list(calls))
    straight, stopped, resumed = sequences
    assert len({g for g in straight if g[0]}) == 3  # a training graph per block kind, all static
    assert any("dynamic" in g[1] for g in straight)  # the short validation batch made one dynamic: it is seen
    assert stopped + resumed == straight


# ----------------------------------------------------------------------------
# Compiled blocks under DDP


def torchrun(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "compiled_train.py"), *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow  # two launches of 2 processes, one of them tracing every graph: about a minute on 2 cores
def test_compiled_blocks_under_ddp_equal_eager_ones(demo_corpus, tmp_path):
    """2 gloo processes x 2 accumulation steps (gradients all-reduced on the last only), blocks compiled by
    dynamo and AOTAutograd (aot_eager: the same PyTorch kernels on the traced graphs) against eager blocks: the
    same arithmetic in the same order, so the same weights and losses, bit for bit."""
    flags = [f"--data={demo_corpus}", "--phase=mlm", "--preset=tiny", "--seq_len=128", "--batch_size=8",
             "--micro_batch_size=2", "--tokens=3072", "--eval_interval=3", "--eval_sequences=3",
             "--save_interval=0", "--warmup_tokens=0", "--lr=1e-3", "--dropout=0.1"]
    out = {}
    for compiled in (True, False):
        out[compiled] = tmp_path / f"compile-{compiled}"
        printed = torchrun("aot_eager", *flags, f"--compile={compiled}", f"--out_dir={out[compiled]}")
        assert "2 micro x 2 accumulation x 2 process(es)" in printed
        assert f"blocks {'compiled by aot_eager' if compiled else 'eager'}" in printed
    want, got = load_file(out[False] / "model.safetensors"), load_file(out[True] / "model.safetensors")
    differ = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
    assert not differ, f"{len(differ)} of {len(want)} tensors differ from the eager run: {differ}"
    logs = [[json.loads(line) for line in open(out[c] / "log.jsonl")] for c in (True, False)]
    keys = ("loss", "grad_norm", "val_mlm", "val_clm")
    assert [[r.get(k) for k in keys] for r in logs[0]] == [[r.get(k) for k in keys] for r in logs[1]]


# ----------------------------------------------------------------------------
# Backends a configuration refuses: never auto's pick, refused at start when asked for


def test_auto_never_picks_a_backend_that_refuses_the_dtype(fake_flash):
    """On CUDA with flash-attn installed (faked here): auto picks flash where the blocks compute in bf16, and
    FlexAttention in fp32, which flash-attn's kernels do not take; flash asked for by name in fp32 is refused."""
    cuda = torch.device("cuda")
    assert kernels.pick_backend(cuda, "auto", training=True, dtype=torch.bfloat16) == "flash"
    assert kernels.pick_backend(cuda, "auto", training=True, dtype=torch.float32) == "flex"
    with pytest.raises(InputError, match=r"'flash' cannot compute in float32 on cuda .* --dtype=bfloat16"):
        kernels.pick_backend(cuda, "flash", dtype=torch.float32)
    cpu = torch.device("cpu")  # the double computes fp32 on a CPU, as the flash tests there need
    assert kernels.pick_backend(cpu, "flash", dtype=torch.float32) == "flash"
    with torch.autocast("cpu", torch.bfloat16):  # the dtype autocast gives, when none is named
        assert kernels.compute_dtype(cpu) == torch.bfloat16
    assert kernels.compute_dtype(cpu) == torch.float32


def test_flash_in_float32_is_refused_before_any_data_is_read(fake_flash, monkeypatch, tmp_path, capsys):
    """--backend=flash --dtype=float32 on a GPU (faked): one line naming both flags, before the data (which does
    not exist here) is read or a run directory is made; --backend=auto gets past the same check to the data."""
    cuda = torch.device("cuda")
    monkeypatch.setattr("machinery.cli.init_processes", lambda device, timeout: (0, 1, 1, cuda))
    monkeypatch.setattr("machinery.cli.pick_device", lambda requested, *args, **kwargs: cuda)
    flags = [f"--data={tmp_path / 'missing'}", "--backend=flash", "--preset=tiny", "--seq_len=128",
             "--batch_size=4", "--tokens=1024"]
    with pytest.raises(InputError, match=r"^--backend=flash: .*float32.*--dtype=bfloat16") as refused:
        train.main([*flags, "--dtype=float32", f"--out_dir={tmp_path / 'run'}"])
    assert "\n" not in str(refused.value) and not (tmp_path / "run").exists()
    auto = [f if f != "--backend=flash" else "--backend=auto" for f in flags]
    with pytest.raises(InputError, match="missing"):  # auto picks another backend: the data is the next complaint
        train.main([*auto, "--dtype=float32", f"--out_dir={tmp_path / 'run2'}"])


def test_flash_asks_for_a_deterministic_backward(fake_flash):
    """--resume's bit-for-bit promise needs flash-attn's deterministic backward (its default adds dQ up with
    atomics in a varying order)."""
    model = tiny_model().train()
    model.backend = "flash"
    ids = torch.randint(0, 256, (2, 64))
    model(ids, labels=ids)[1].backward()
    assert fake_flash.determinism and all(fake_flash.determinism)


@pytest.mark.parametrize("flag", [True, False])
def test_the_trainer_sets_inductors_deterministic_mode_from_its_flag(monkeypatch, demo_corpus, tmp_path, flag):
    """--resume's bit-for-bit promise needs inductor's deterministic mode (by default it times a reduction's
    settings at first launch and keeps the fastest, which changes the order of the sums from one process to the
    next): train.py turns it on, or off with --deterministic=false, before anything compiles, on CUDA; a CPU, where
    nothing compiles with inductor, leaves the compiler as it is (not even imported)."""
    import torch._inductor.config as inductor
    asked, mode = [], kernels.deterministic_compiler
    monkeypatch.setattr(kernels, "deterministic_compiler", lambda on, device: asked.append((on, device)) or mode(on, device))
    with inductor.patch(deterministic=not flag):  # inductor's own save and restore (its settings are no attributes)
        train.main([f"--data={demo_corpus}", f"--out_dir={tmp_path / 'run'}", "--preset=tiny", "--seq_len=64",
                    "--batch_size=2", "--tokens=128", "--eval_sequences=2", f"--deterministic={flag}"])
        assert asked == [(flag, torch.device("cpu"))] and inductor.deterministic is not flag
        assert mode(flag, torch.device("cuda")) is flag and inductor.deterministic is flag


def test_resume_promises_bit_for_bit_only_where_every_kernel_repeats(monkeypatch):
    """What a run says --resume will give: bit for bit on a CPU (no compiled kernels, SDPA's CPU kernels repeat);
    within rounding, saying why, with SDPA's CUDA backward or PyTorch's FlashAttention backward (atomics), kernels
    that inductor times, and on CUDA whatever the backend, where kill-and-resume has not been shown bit for bit."""
    import torch._inductor.config as inductor
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kernels.resume_caveat("sdpa", cpu, False) is None
    assert kernels.resume_caveat("flex", cuda, True) == kernels.resume_caveat("reference", cuda, True) \
        == kernels.GPU_RESUME
    assert "atomics" in kernels.resume_caveat("sdpa", cuda, True)
    assert "inductor times" in kernels.resume_caveat("flex", cuda, False)
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", fake_flash_attn.flash_attn_varlen_func)
    assert kernels.resume_caveat("flash", cuda, True) == kernels.GPU_RESUME
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", None)
    assert "PyTorch's FlashAttention backward adds dQ up with atomics" in kernels.resume_caveat("flash", cuda, True)
    # a PyTorch without the mode: deterministic_compiler says so, and the promise narrows (its inductor config stood
    # in for by an empty module: the real one's settings are no attributes to delete and restore)
    monkeypatch.setattr(torch._inductor, "config", types.ModuleType("config"))
    assert kernels.deterministic_compiler(True) is False and kernels.compiler_is_deterministic() is False
    assert "inductor times" in kernels.resume_caveat("flex", cuda, kernels.compiler_is_deterministic())
    assert hasattr(inductor, "deterministic")  # the real config untouched


def test_a_run_says_when_its_resume_would_not_be_bit_for_bit(monkeypatch, demo_corpus, tmp_path, capsys):
    """The start of a run with PyTorch's FlashAttention (its double, on a CPU) warns, once, that a --resume of it
    continues within rounding; a run whose kernels all repeat says nothing of the kind."""
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", None)
    monkeypatch.setitem(kernels.imported, "varlen_attn", fake_flash_attn.varlen_attn)
    for check in ("available", "trains"):
        monkeypatch.setattr(kernels.Flash, check, staticmethod(lambda device: True))
    run = [f"--data={demo_corpus}", "--preset=tiny", "--seq_len=64", "--batch_size=2", "--tokens=128",
           "--eval_sequences=2"]
    train.main([*run, f"--out_dir={tmp_path / 'flash'}", "--backend=flash"])
    out, err = capsys.readouterr()
    assert "attention: flash (PyTorch's varlen_attn)" in out
    assert err.count("a --resume of this run continues within rounding, not bit for bit: --backend=flash: "
                     "PyTorch's FlashAttention backward adds dQ up with atomics") == 1
    train.main([*run, f"--out_dir={tmp_path / 'sdpa'}", "--backend=sdpa"])
    assert "within rounding" not in capsys.readouterr().err


def test_auto_picks_flash_only_where_its_backward_repeats(monkeypatch):
    """On CUDA (faked), where flash-attn is missing but PyTorch has its own FlashAttention: --backend=flash runs it,
    auto keeps FlexAttention (whose backward repeats bit for bit). With flash-attn, auto picks flash. With neither,
    --backend=flash is refused naming what it needs."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", None)
    monkeypatch.setitem(kernels.imported, "varlen_attn", fake_flash_attn.varlen_attn)
    assert kernels.Flash.library() == "PyTorch's varlen_attn"
    assert kernels.pick_backend(cuda, "flash", training=True, dtype=bf16) == "flash"
    assert kernels.pick_backend(cuda, training=True, dtype=bf16) == "flex"
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", fake_flash_attn.flash_attn_varlen_func)
    assert kernels.Flash.library() == "flash-attn" and kernels.pick_backend(cuda, training=True, dtype=bf16) == "flash"
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", None)
    monkeypatch.setitem(kernels.imported, "varlen_attn", None)
    with pytest.raises(InputError, match=r"'flash' is not available on cuda: it needs CUDA, and flash-attn or "
                                         r"PyTorch >= 2.11"):
        kernels.pick_backend(cuda, "flash", training=True, dtype=bf16)


def test_pytorchs_own_flash_attention_is_found_where_it_has_a_window():
    """PyTorch 2.11 and later have FlashAttention on packed sequences with a window (what the local layers need):
    the flash backend finds it, its kernel on a GPU where flash-attn is not installed."""
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11):
        pytest.skip(f"PyTorch {torch.__version__} has no varlen_attn with a window")
    from torch.nn.attention.varlen import varlen_attn
    assert kernels.optional("varlen_attn") is varlen_attn


def test_each_rank_is_bound_to_its_gpu_before_the_process_group_is_made(monkeypatch):
    """torchrun on GPUs (faked): rank 1's GPU is set, then the NCCL group is made with device_id, which binds the
    rank to that GPU at once (without it NCCL guesses the device at the first collective, with a warning)."""
    torchrun = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="localhost",
                    MASTER_PORT="29500")
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    gpu, calls = torch.device("cuda:1"), []
    monkeypatch.setattr("machinery.cli.pick_device",
                        lambda requested, local_rank, **kw: torch.device(f"cuda:{local_rank}"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(train.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        assert cli.init_processes("auto", datetime.timedelta(seconds=900)) == (1, 2, 2, gpu)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert [c[0] for c in calls] == ["set_device", "nccl"] and calls[0][1] == gpu
    assert calls[1][1]["device_id"] == gpu


# ----------------------------------------------------------------------------
# MFU's peak, and bench.py's peak memory


def test_peak_flops_tells_the_h100_boards_apart():
    """Device names as torch.cuda.get_device_name reports them: the SXM H100 and the H200 share a peak, the
    PCIe and NVL boards have lower clocks (and NVL is two boards' name for one GPU each)."""
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA GeForce RTX 4090": None}
    assert {name: progress.peak_of(name) for name in names} == names
    assert all(progress.peak_of(key) == peak for key, peak in progress.PEAK_FLOPS.items())  # none shadowed


def test_mfu_is_each_gpus_share_of_its_own_peak():
    """A step's MFU: the model FLOPs of the step's tokens per second over the peak of the GPUs that computed them
    (each process computes 1/world of the step); its tokens/s are every process's together."""
    from types import SimpleNamespace
    r = SimpleNamespace(cfg=SimpleNamespace(batch_size=32, seq_len=1024, phase="mlm"), phase_step=7,
                        phase_tokens=7 * 32 * 1024, world=4)
    record = progress.record(r, 2.5, 1e-3, 1.0, seconds=0.5, flops=6e9, peak=989e12)
    assert record["tokens_per_s"] == 65_536 and record["mfu"] == round(6e9 * 65_536 / (4 * 989e12), 4) == 0.0994


def test_bench_peak_memory_leaves_out_the_warm_up(monkeypatch):
    """bench.interleaved on a fake CUDA device and clock, 50 bytes allocated before each step: warm-up steps that
    allocate 100 (compilation, autotuning) and timed steps that allocate 10 report 10; the n-th step takes n
    seconds, so the median of the 3 timed steps (3, 4, 5) is 4."""
    state = dict(peak=0, clock=0.0)
    fake = types.SimpleNamespace(synchronize=lambda device: None, max_memory_allocated=lambda device: state["peak"],
                                 reset_peak_memory_stats=lambda device: state.update(peak=50))
    monkeypatch.setattr(torch, "cuda", fake)
    monkeypatch.setattr(bench, "allocated", lambda device: 50)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: state["clock"]))
    calls = []

    def step():
        calls.append(1)
        state["peak"] = max(state["peak"], 50 + (100 if len(calls) <= 2 else 10))  # the allocator's high-water mark
        state["clock"] += len(calls)

    (seconds, memory), = bench.interleaved([step], types.SimpleNamespace(type="cuda"), warmup=2, repeats=3)
    assert len(calls) == 5 and memory == 10 and seconds == 4


def test_pytorchs_varlen_kernel_without_a_window_counts_as_absent(monkeypatch):
    """PyTorch 2.10's varlen_attn takes no window_size, so the local layers could not run on it: optional() says
    there is none (the flash backend is then unavailable where flash-attn is not installed); 2.11's is taken."""
    from types import SimpleNamespace

    def without_window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        return None

    def with_window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):
        return None
    for kernel, found in ((without_window, None), (with_window, with_window)):
        monkeypatch.setattr(kernels.importlib, "import_module", lambda name: SimpleNamespace(varlen_attn=kernel))
        monkeypatch.delitem(kernels.imported, "varlen_attn", raising=False)
        assert kernels.optional("varlen_attn") is found
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", None)
    monkeypatch.setitem(kernels.imported, "varlen_attn", None)
    assert not kernels.Flash.available(torch.device("cuda"))
