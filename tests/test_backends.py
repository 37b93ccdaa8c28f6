"""The GPU attention paths run on a CPU: flash-attn through a test double of its documented interface, FlexAttention
forward (it has no CPU backward in torch 2.13), each against the SDPA backend; and torch.compile of the blocks
without recompilation during training."""
import pytest
import torch

import fake_flash_attn
import model as M
from conftest import tiny_model
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


@pytest.fixture
def fake_flash(monkeypatch):
    """The model's flash backend, running the double on a CPU."""
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", fake_flash_attn.flash_attn_varlen_func)
    monkeypatch.setattr(kernels.Flash, "available", staticmethod(lambda device: True))
    fake_flash_attn.calls.clear()
    return fake_flash_attn.calls


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
def test_flash_backend_matches_sdpa_on_padded_batches(fake_flash, causal, with_docs):
    model = tiny_model().train()  # dropout 0: train mode changes nothing but autograd bookkeeping
    ids, mask, labels, docs = padded_batch()
    docs = docs if with_docs else None
    want = run(model, "sdpa", ids, mask, labels, causal, docs)
    got = run(model, "flash", ids, mask, labels, causal, docs)
    assert (got[0] - want[0]).abs().max().item() <= 1e-4
    assert abs(got[1].item() - want[1].item()) <= 1e-5
    for name in want[2]:
        assert (got[2][name] - want[2][name]).abs().max().item() <= 1e-5, name
    # what the kernel was asked for: flash-attn's window convention, one varlen sequence per row or document
    local = (model.config.window, 0 if causal else model.config.window)
    assert {(c, w) for c, w, _ in fake_flash} == {(causal, (-1, -1)), (causal, local)}
    n_seq = 3 + 3 + 1 if with_docs else 3  # documents of <= 70 tokens: 200 real tokens -> 3, 150 -> 3, 37 -> 1
    assert {n for *_, n in fake_flash} == {n_seq}


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
        attn = kind(B, T, torch.device("meta"), causal, 64, token_mask, doc_ids)
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
