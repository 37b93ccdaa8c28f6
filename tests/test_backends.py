"""Every attention backend equals model.py's reference attention, and the GPU paths run on a CPU: flash-attn through a
test double of its documented interface, FlexAttention forward (it has no CPU backward in torch 2.13), each against
the reference and the SDPA backend; and torch.compile of the blocks without recompilation during training."""
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fake_flash_attn
import model as M
from conftest import ROOT, tiny_model
from machinery import kernels
from machinery.cli import InputError

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def padded_batch(B=3, T=200, lengths=(200, 150, 37), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    ids[~mask] = 258  # the byte tokenizer's [PAD]
    labels = torch.where((torch.rand(B, T, generator=g) < 0.3) & mask, ids, M.IGNORE_INDEX)
    docs = torch.arange(T)[None].expand(B, T) // 70  # packed documents of 70 tokens
    return ids, mask.long(), labels, docs


def use_flash_double(monkeypatch, kernel="flash-attn"):
    """The model's flash backend on a CPU, through the double of flash-attn's kernel or of PyTorch's own (which it
    uses where flash-attn is not installed)."""
    flash_attn = fake_flash_attn.flash_attn_varlen_func if kernel == "flash-attn" else None
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", flash_attn)
    monkeypatch.setitem(kernels.imported, "varlen_attn", fake_flash_attn.varlen_attn)
    monkeypatch.setattr(kernels.Flash, "available", staticmethod(lambda device: True))
    fake_flash_attn.calls.clear()
    return fake_flash_attn.calls


@pytest.fixture
def fake_flash(monkeypatch):
    return use_flash_double(monkeypatch)


@pytest.fixture(params=["flash-attn", "pytorch"])
def either_flash(monkeypatch, request):
    """The flash backend through each of its two kernels."""
    return use_flash_double(monkeypatch, request.param)


# --- every backend against the reference ----------------------------------------------------------------------

WINDOW = 24  # a local layer's reach on each side, well inside T = 200, so that local and global layers differ
# (padded, separate documents): full rows or padded ones; attention across packed documents or within each
LAYOUTS = [pytest.param(padded, docs, id=f"{'padded' if padded else 'full'}-{'separate' if docs else 'across'}")
           for padded in (False, True) for docs in (False, True)]


def attention_case(padded, separate_docs, device="cpu", B=3, T=200, H=4, D=32):
    """(q, k, v) (B, T, H, D) fp32 on `device`, token_mask (None: no padding), doc_ids (None: attention crosses
    documents) and the gradient of the output a test backpropagates: rows of 200, 150 and 37 real tokens, packed
    documents of 50 tokens."""
    g = torch.Generator().manual_seed(0)
    q, k, v, out_grad = (torch.randn(B, T, H, D, generator=g).to(device) for _ in range(4))
    token_mask = (torch.arange(T)[None, :] < torch.tensor([200, 150, 37])[:, None]).to(device) if padded else None
    doc_ids = (torch.arange(T)[None].expand(B, T) // 50).to(device) if separate_docs else None
    return (q, k, v), token_mask, doc_ids, out_grad


def attend(name, qkv, causal, local, token_mask, doc_ids, out_grad=None, dtype=torch.float32):
    """One layer's attention through the backend `name`, in `dtype`: the output on the real tokens (B*T real,
    H*D) in fp32, and (with out_grad) the gradients of q, k and v, fp32, backpropagated from the real tokens."""
    B, T = qkv[0].shape[:2]
    attn = kernels.BACKENDS[name](B, T, qkv[0].device, causal, WINDOW, token_mask, doc_ids, rule=M.mask_rule,
                                  reference=M.reference_attention)
    leaves = [t.detach().to(dtype).requires_grad_(out_grad is not None) for t in qkv]  # fresh leaves, fresh grads
    out = attn.repad(attn.attend(*(attn.unpad(t) for t in leaves), local).flatten(-2))  # (B, T, H*D)
    real = torch.ones(B, T, dtype=torch.bool, device=out.device) if token_mask is None else token_mask
    if out_grad is None:
        return out.detach().float()[real], None
    out[real].backward(out_grad.flatten(-2)[real].to(dtype))
    return out.detach().float()[real], [t.grad.float() for t in leaves]


def largest_difference(got, want):
    """(the largest difference of the outputs, of the gradients (0 where `got` has none))."""
    (out, grads), (ref_out, ref_grads) = got, want
    return (out - ref_out).abs().max().item(), max([(a - b).abs().max().item() for a, b in zip(grads or [], ref_grads)],
                                                    default=0.0)


@pytest.mark.parametrize("padded, separate_docs", LAYOUTS)
@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_every_backend_equals_the_reference_attention(either_flash, causal, local, padded, separate_docs):
    """SDPA and flash (each kernel's double) forward and backward, FlexAttention and flex+sdpa forward, against
    model.reference_attention on one layer: outputs on the real tokens and the gradients of q, k and v equal to
    fp32 rounding (seen: 3.1e-6 at most, gradients up to 5 in size). The other mode's reference is far outside
    that: a wrong mask shows."""
    qkv, token_mask, doc_ids, out_grad = attention_case(padded, separate_docs)
    want = attend("reference", qkv, causal, local, token_mask, doc_ids, out_grad)
    for name in ("sdpa", "flash", "flex", "flex+sdpa"):  # FlexAttention has no CPU backward
        got = attend(name, qkv, causal, local, token_mask, doc_ids, None if "flex" in name else out_grad)
        out_error, grad_error = largest_difference(got, want)
        assert out_error <= 1e-5 and grad_error <= 1e-5, (name, out_error, grad_error)
    wrong = attend("reference", qkv, not causal, local, token_mask, doc_ids, out_grad)
    assert min(largest_difference(wrong, want)) > 0.1


def test_the_reference_backend_runs_the_whole_model_as_sdpa_does():
    """backend="reference" through the model, padded and causal with separate documents: the logits on the real
    tokens, the loss and every parameter's gradient those of SDPA."""
    model = tiny_model().train()
    ids, mask, labels, docs = padded_batch()
    want = run(model, "sdpa", ids, mask, labels, True, docs)
    got = run(model, "reference", ids, mask, labels, True, docs)
    assert (got[0] - want[0]).abs().max().item() <= 1e-4 and abs(got[1].item() - want[1].item()) <= 1e-5
    assert max((got[2][n] - g).abs().max().item() for n, g in want[2].items()) <= 1e-5


def test_auto_never_picks_the_reference():
    """It is chosen by name only, trains anywhere, and goes through the same checks as any backend."""
    for device in (torch.device("cpu"), torch.device("cuda"), torch.device("meta")):
        assert not kernels.BACKENDS["reference"].auto(device)
    cpu = torch.device("cpu")
    assert kernels.pick_backend(cpu, "reference", training=True) == "reference" != kernels.pick_backend(cpu)
    with pytest.raises(InputError, match=r"expected auto, flash, flex, flex\+sdpa, sdpa, reference"):
        kernels.pick_backend(cpu, "referense")


@pytest.mark.parametrize("edit", ["reference_attention", "mask_rule", "global reach"])
def test_an_edit_to_the_attention_on_the_page_is_what_runs(monkeypatch, capsys, edit):
    """The fast backends compute model.py's attention as first written. While the page computes the same (however
    written: its softmax in float32 too) auto picks them; once it is edited (sharper scores; a prefix of keys every
    query sees; global layers that reach 100 keys, beyond the local window) the model runs the page on the reference
    backend and says so once, and a fast backend asked for by name is refused."""
    def attentive():  # attention weighs in the output (at init its projections are too small for an edit to show)
        model = tiny_model(seed=1)
        with torch.no_grad():
            for block in model.model.layers:
                block.attn.Wqkv.weight.mul_(20)
                block.attn.Wo.weight.mul_(20)
        return model

    ids = torch.randint(3, 200, (2, 160), generator=torch.Generator().manual_seed(0))  # past the 64-key window
    want = {causal: attentive().encode(ids, causal=causal) for causal in (False, True)}
    name = "reference_attention" if edit == "reference_attention" else "mask_rule"
    plain = getattr(M, name)

    def float32_softmax(q, k, v, keep):  # the same attention, its softmax a step in float32
        see = keep(torch.arange(q.shape[0])[:, None, None], None, *(torch.arange(q.shape[1])[None, :, None],
                                                                   torch.arange(q.shape[1])[None, None, :]))
        scores = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
        weights = scores.masked_fill(~see[:, None], float("-inf")).float().softmax(-1).to(q.dtype)
        return torch.einsum("bhij,bjhd->bihd", weights, v)
    same = {"reference_attention": float32_softmax, "mask_rule": lambda *a: plain(*a)}
    monkeypatch.setattr(M, name, same[name])
    assert tiny_model(seed=1).backend == "auto" and "warning" not in capsys.readouterr().err
    reach = lambda keep: lambda b, h, i, j: keep(b, h, i, j) & (((i - j).abs() <= 100) | (i == j))  # noqa: E731
    edited = {"reference_attention": lambda q, k, v, keep: plain(1.5 * q, k, v, keep),
              "mask_rule": lambda *a: (lambda keep: lambda b, h, i, j: keep(b, h, i, j) | (j < 4))(plain(*a)),
              "global reach": lambda causal, window, local, *rest: (plain(causal, window, local, *rest) if local else
                                                                    reach(plain(causal, window, local, *rest)))}
    monkeypatch.setattr(M, name, edited[edit])
    model = attentive()
    assert model.backend == "reference"
    assert capsys.readouterr().err.startswith("warning: model.py's attention (reference_attention, mask_rule) computes")
    for causal in (False, True):  # the edit is what the model computes now, causal or not
        assert (model.encode(ids, causal=causal) - want[causal]).abs().max().item() > 1e-2
    assert tiny_model(seed=1).backend == "reference" and capsys.readouterr().err == ""  # said once
    assert M.ModernBERT(model.config, "reference").backend == "reference"
    with pytest.raises(InputError, match=r"^attention backend 'sdpa' computes model.py's attention as first written, "
                                         r"and reference_attention or mask_rule there now compute something else "
                                         r"\([0-9.e-]+ apart on a test batch\): train with .*--backend=reference"):
        M.ModernBERT(model.config, "sdpa")


# --- flash-attn and FlexAttention against SDPA through the model -------------------------------------------------


def run(model, backend, ids, mask, labels, causal, docs):
    """Logits on the real tokens, the loss and every parameter's gradient, with one backend."""
    model.backend = backend
    model.zero_grad()
    with torch.no_grad():
        logits = model(ids, mask, causal=causal, doc_ids=docs)[0][mask.bool()]
    loss = model(ids, mask, labels=labels, causal=causal, doc_ids=docs)[1]
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_docs", [False, True])
def test_flash_backend_matches_sdpa_on_padded_batches(either_flash, causal, with_docs):
    model = tiny_model().train()  # dropout 0: train mode changes nothing but autograd bookkeeping
    ids, mask, labels, docs = padded_batch()
    docs = docs if with_docs else None
    want = run(model, "sdpa", ids, mask, labels, causal, docs)
    got = run(model, "flash", ids, mask, labels, causal, docs)
    assert (got[0] - want[0]).abs().max().item() <= 1e-4
    assert abs(got[1].item() - want[1].item()) <= 1e-5
    for name in want[2]:
        assert (got[2][name] - want[2][name]).abs().max().item() <= 1e-5, name
    # what the kernel was asked for: the window convention, one varlen sequence per row or document
    w = model.config.window
    if kernels.flash_attn_varlen_func:  # flash-attn: a causal flag, and a window on the local layers only
        asked = {(causal, (-1, -1)), (causal, (w, 0 if causal else w))}
    else:  # PyTorch's: no causal flag; a causal window ends at the query
        asked = {(None, (-1, 0 if causal else -1)), (None, (w, 0 if causal else w))}
    assert {(c, w) for c, w, _ in either_flash} == asked
    n_seq = 3 + 3 + 1 if with_docs else 3  # documents of <= 70 tokens: 200 real tokens -> 3, 150 -> 3, 37 -> 1
    assert {n for *_, n in either_flash} == {n_seq}


def test_flash_backend_without_padding_runs_the_whole_rows(fake_flash):
    model = tiny_model().eval()
    ids = padded_batch()[0]
    with torch.no_grad():
        want = model(ids)[0]
        model.backend = "flash"
        got = model(ids)[0]
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("causal, with_docs, with_padding", [(False, False, True), (True, True, True),
                                                             (True, False, False), (False, True, False)])
def test_flex_forward_matches_sdpa_on_cpu(causal, with_docs, with_padding):
    model = tiny_model().eval()
    ids, mask, _, docs = padded_batch()
    mask, docs = (mask if with_padding else None), (docs if with_docs else None)
    out = {}
    for backend in ("sdpa", "flex"):
        model.backend = backend
        with torch.no_grad():
            out[backend] = model(ids, mask, causal=causal, doc_ids=docs)[0]
    real = slice(None) if mask is None else mask.bool()
    assert (out["flex"] - out["sdpa"])[real].abs().max().item() <= 1e-4


@pytest.mark.parametrize("separate_docs", [False, True], ids=["across", "separate"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_flex_block_masks_keep_each_rows_own_blocks(causal, separate_docs):
    """On a GPU FlexAttention skips the blocks of keys its block mask leaves out: row by row, it keeps exactly the
    blocks in which the rule keeps a key. (The eager CPU kernel applies the rule to every key, so the outputs above
    cannot show a row run with another row's blocks.) The shortest row first: its skipped blocks are others' keys."""
    T, cpu = 300, torch.device("cpu")
    token_mask = torch.arange(T)[None, :] < torch.tensor([37, 150, 300])[:, None]
    doc_ids = torch.arange(T)[None].expand(3, T) // 70 if separate_docs else None
    for local in (False, True):
        blocks = kernels.Flex.build_mask(M.mask_rule, T, cpu, causal, WINDOW, local, token_mask, doc_ids)
        size, n = blocks.BLOCK_SIZE[0], -(-T // blocks.BLOCK_SIZE[0])
        dense = kernels.SDPA.build_mask(M.mask_rule, T, cpu, causal, WINDOW, local, token_mask, doc_ids)  # (B, 1, T, T)
        dense = torch.nn.functional.pad(dense, (0, n * size - T, 0, n * size - T))
        want = dense.view(3, 1, n, size, n, size).any(5).any(3)  # (B, 1, query blocks, key blocks)
        assert torch.equal(blocks.to_dense().bool(), want), local


@pytest.mark.parametrize("name", ["sdpa", "flex"])
def test_a_backend_is_picked_for_training_only_where_it_has_a_backward(name):
    """The table's `trains` against PyTorch itself on a CPU (FlexAttention has no CPU backward in torch 2.13): what
    train.py and bench.py refuse at start (pick_backend(training=True)) is exactly what would fail at the first
    backward."""
    model = tiny_model()
    model.backend = name
    ids, _, labels, _ = padded_batch()
    try:
        model(ids, labels=labels)[1].backward()
        backward = True
    except NotImplementedError:
        backward = False
    cpu = torch.device("cpu")
    assert kernels.BACKENDS[name].trains(cpu) == backward and kernels.pick_backend(cpu, name) == name
    if not backward:
        with pytest.raises(InputError, match=f"attention backend '{name}' cannot train on cpu"):
            kernels.pick_backend(cpu, name, training=True)


@pytest.mark.parametrize("kind", [kernels.Flex, kernels.SDPA])
def test_masks_are_built_without_host_syncs(kind):
    """On the meta device every data-dependent host sync (.item(), nonzero, boolean indexing) raises: masks that
    build there read no values, so on a GPU they never wait for the device."""
    B, T = 2, 256
    token_mask = torch.ones(B, T, dtype=torch.bool, device="meta")
    doc_ids = torch.zeros(B, T, dtype=torch.long, device="meta")
    for causal in (False, True):
        attn = kind(B, T, torch.device("meta"), causal, 64, token_mask, doc_ids, rule=M.mask_rule)
        assert set(attn.masks) == {False, True}
    with pytest.raises((RuntimeError, NotImplementedError)):  # the detector works: a sync does raise here
        token_mask.nonzero()


def compiled_training_steps(backend, steps=5, seed=0):
    """Training steps of the tiny model with each block compiled as train.py does, the number of masked positions
    varying from step to step; the dynamo graph count after each step."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model().train()
    for block in model.model.layers:
        block.compile(backend=backend)
    g = torch.Generator().manual_seed(seed)
    graphs = []
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 160), generator=g)
        rate = 0.1 + 0.15 * step  # a different number of labelled positions each step
        labels = torch.where(torch.rand(2, 160, generator=g) < rate, ids, M.IGNORE_INDEX)
        model(ids, labels=labels, causal=step % 2 == 1)[1].backward()
        graphs.append(counters["stats"]["unique_graphs"])
    return model, graphs


def test_compiled_blocks_do_not_recompile_during_training():
    """One graph per block kind (layer 0 without attn_norm, global, local) per mode, none after warm-up: a guard
    on a block's identity would compile each layer and, past dynamo's recompile limit, fall back to eager."""
    model, graphs = compiled_training_steps("eager")
    kinds = len({(i == 0, block.local) for i, block in enumerate(model.model.layers)})
    global_kinds = len({i == 0 for i, block in enumerate(model.model.layers) if not block.local})
    assert kinds == 3 and global_kinds == 2
    # causal adds a graph per global kind (SDPA's causal kernel); local layers take their window mask as a tensor
    assert graphs[0] == kinds and graphs[1] == kinds + global_kinds
    assert graphs[1:] == [graphs[1]] * (len(graphs) - 1)


@pytest.mark.slow
def test_inductor_compiled_blocks_match_eager_and_do_not_recompile():
    model, graphs = compiled_training_steps("inductor", steps=4)
    assert graphs[1:] == [graphs[1]] * 3
    eager = tiny_model().train()
    compiled_grads = {n: p.grad for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for step in range(4):  # the same batches as compiled_training_steps
        ids = torch.randint(0, 256, (2, 160), generator=g)
        labels = torch.where(torch.rand(2, 160, generator=g) < 0.1 + 0.15 * step, ids, M.IGNORE_INDEX)
        eager(ids, labels=labels, causal=step % 2 == 1)[1].backward()
    for name, p in eager.named_parameters():
        assert (p.grad - compiled_grads[name]).abs().max().item() <= 1e-5, name


def saved_bytes(model, phase, T, B=2):
    """Bytes autograd keeps for backward in one bf16-autocast training forward (parameters excluded)."""
    import bench
    x, y = bench.batch(model.config.vocab_size, B, T, phase, torch.device("cpu"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        model(x, labels=y, causal=phase == "clm")
    return sum(kept.values())


@pytest.mark.parametrize("phase, rate", [("mlm", 0.3), ("clm", 1.0)])
def test_activation_memory_prediction_matches_saved_tensors(fake_flash, phase, rate):
    """bench.py's on-paper prediction (printed for base at 4 x 8192) against what autograd actually keeps per
    token, measured on the mini preset through the flash backend (the double keeps what flash-attn keeps)."""
    import bench
    from conftest import BYTE_IDS
    torch.manual_seed(0)
    model = M.ModernBERT(M.ModernBERTConfig.from_preset("mini", **BYTE_IDS), "flash").train()
    measured = (saved_bytes(model, phase, 512) - saved_bytes(model, phase, 256)) / 512  # per token, B = 2
    predicted = (bench.activation_memory(model.config, 512, 2, rate)
                 - bench.activation_memory(model.config, 256, 2, rate)) / 512
    assert measured == pytest.approx(predicted, rel=0.02)


# --- waits for the device, counted on a CPU ---------------------------------------------------------------------


class HostWaits(TorchDispatchMode):
    """The operations run inside the block that make the host wait for a GPU, seen where they run on a CPU: a
    value read on the host (.item(), int()), an output whose size depends on the values (nonzero, a boolean
    index), and a tensor made from the host's numbers (on CUDA a copy that waits, unless it is one from pinned
    memory that does not)."""
    WAIT = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
            "aten.lift_fresh.default"}

    def __enter__(self):
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1])
        if str(func) in self.WAIT or boolean_index:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("padded, separate_docs, waits", [(False, False, []), (True, False, ["nonzero"]),
                                                          (False, True, ["nonzero", "_local_scalar_dense"]),
                                                          (True, True, ["nonzero", "nonzero", "_local_scalar_dense"])])
def test_the_varlen_layout_waits_for_the_device_only_where_documented(fake_flash, padded, separate_docs, waits):
    """flash-attn's layout for a batch: packed rows wait for nothing; padding, for the number of real tokens;
    documents, for their number and the longest one (its backward's buffers grow with it). Nothing else: the end
    of the last document is filled in on the device, not copied from the host."""
    _, token_mask, doc_ids, _ = attention_case(padded, separate_docs)
    with HostWaits() as seen:
        attn = kernels.Flash(3, 200, torch.device("cpu"), False, WINDOW, token_mask, doc_ids)
    assert [op.split(".")[1] for op in seen.ops] == waits
    real = 200 * 3 if token_mask is None else int(token_mask.sum())
    assert attn.cu_seqlens[0] == 0 and attn.cu_seqlens[-1] == real and attn.cu_seqlens.dtype == torch.int32


def test_the_steps_numbers_reach_the_device_in_one_copy():
    """across_ranks: the labelled-token count and the stop signal, host numbers, become one tensor (on CUDA one
    copy from pinned memory that does not wait) beside the loss; the one read back is the .tolist() it documents."""
    import train
    loss_sum, grad_norm = torch.tensor(7.5, dtype=torch.float64), torch.tensor(0.25)
    with HostWaits() as seen:
        loss, stop, norm = train.across_ranks(loss_sum, 3, True, grad_norm)
    assert [op.split(".")[1] for op in seen.ops] == ["lift_fresh"]
    assert (loss, stop, norm) == (2.5, True, 0.25)
    assert train.across_ranks(loss_sum, 0, False, torch.tensor(1.0))[:2] == (7.5, False)


def test_compiled_blocks_take_flex_attention_into_their_graphs(monkeypatch):
    """Where FlexAttention runs compiled (on CUDA; a CPU stands in here), a compiled block traces flex_attention
    into its own graph: a torch.compile made inside a graph being compiled would be traced again with each block
    kind's graph (dynamo warns each time). The masks, built outside the blocks, are the compiled kernel's."""
    from torch._dynamo.testing import CompileCounter
    made = []
    monkeypatch.setattr(kernels.Flex, "compiled_on", ("cpu", "cuda"))
    monkeypatch.setattr(kernels, "compiled", lambda fn, dynamic: made.append((fn.__name__,
                                                                               torch.compiler.is_compiling())) or fn)
    torch._dynamo.reset()
    model = tiny_model().eval()
    model.backend = "flex"
    counter = CompileCounter()
    kernels.compile_blocks(model, counter)
    ids = torch.randint(0, 256, (2, 160), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(2):
            model(ids)
    torch._dynamo.reset()
    assert made and set(made) == {("create_block_mask", False)}  # each call outside a compiled graph
    assert counter.frame_count == 3  # a graph per block kind (layer 0, global, local), flex_attention inside


def test_a_cpu_run_never_imports_the_compiler():
    """torch._dynamo (which FlexAttention's and varlen's modules, and inductor's config, import) costs 1.5 s of every
    process's start: a CPU, which compiles nothing, picks its backend, sets the compiler's mode and runs a step
    without it."""
    script = ("import sys, torch; from machinery import kernels; import model; "
              "cpu = torch.device('cpu'); kernels.deterministic_compiler(True, cpu); "
              "m = model.ModernBERT(model.ModernBERTConfig(**model.PRESETS['tiny'])); "
              "m(torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long))[1].backward(); "
              "print(kernels.pick_backend(cpu), 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["sdpa", "False"]
