"""The attention backends (flash-attn varlen, FlexAttention, SDPA) behind one small interface, and the fused
linear cross-entropy: how model.py's attention and loss run fast on a GPU. A reader of the recipe may skip
this file: model.py's reference_attention and F.cross_entropy compute the same numbers."""
import functools
import importlib
import inspect
import itertools
import sys

import torch
import torch.nn.functional as F

from machinery.cli import InputError, say_once

try:  # optional: the fastest path on CUDA, and the one ModernBERT was trained with
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None
# PyTorch's own optional kernels are imported at their first use, not here: importing either module loads
# torch._dynamo, 1.3 s of every process's start that a run on SDPA (every CPU run) never needs.
OPTIONAL = {
    # PyTorch's own FlashAttention-2 on packed sequences (>= 2.11): the flash backend where flash-attn is not installed
    "varlen_attn": "torch.nn.attention.varlen",
    # PyTorch >= 2.5; block-sparse masks make the sliding window cheap on GPU
    "flex_attention": "torch.nn.attention.flex_attention",
    "create_block_mask": "torch.nn.attention.flex_attention",
}
imported = {}  # name: the kernel, or None where this PyTorch has none; tests put their doubles here


def optional(name):
    """PyTorch's kernel `name` (a key of OPTIONAL), or None where this PyTorch has none."""
    if name not in imported:
        try:
            kernel = getattr(importlib.import_module(OPTIONAL[name]), name)
        except (ImportError, AttributeError):
            kernel = None
        if name == "varlen_attn" and kernel and "window_size" not in inspect.signature(kernel).parameters:
            kernel = None  # PyTorch 2.10's has no window: the local layers could not run on it
        imported[name] = kernel
    return imported[name]


IGNORE_INDEX = -100  # label of positions that carry no loss, as in PyTorch and transformers

# -----------------------------------------------------------------------------
# Attention backends: model.py's attention (mask_rule, reference_attention), the same attention computed faster.
# BACKENDS, at the end of this section, is the one table of their names. One is built per forward from the
# batch's layout and shared by every layer:
#   positions  (P,) the position of each row the blocks see, for RoPE
#   unpad(x)   (B, T, d) -> the layout the blocks run in
#   attend(q, k, v, local)  q, k, v (..., H, D) in that layout -> (..., H, D)
#   repad(x)   the blocks' layout -> (B, T, d); padding rows hold anything (zeros after flash, computed
#              values elsewhere): whoever reads them weights by token_mask
# token_mask (B, T) bool marks real tokens (None: all real); doc_ids (B, T) keeps packed documents apart
# when given (None: attention crosses document boundaries). Which key a query may see is model.py's to say: it
# hands every backend its rule (`rule`: model.mask_rule) and its attention written out (`reference`).


class SDPA:
    """PyTorch scaled_dot_product_attention with dense boolean masks: runs anywhere."""
    description = ("PyTorch scaled_dot_product_attention with dense masks "
                   "(flash-attn and FlexAttention are used on CUDA)")
    needs = "nothing"

    @staticmethod
    def available(device):
        return True

    auto = available  # whether "auto" may pick it on this device
    trains = available  # whether it has a backward on this device

    @staticmethod
    def computes(device, dtype):  # whether it computes in this dtype on this device
        return True

    @staticmethod
    def nondeterminism(device):  # why the same batch may give other gradient bits from run to run, or None
        return "PyTorch's SDPA backward kernels on CUDA add up with atomics" if device.type == "cuda" else None

    @staticmethod
    def library():  # the library that computes it, where the backend has a choice
        return None

    def __init__(self, B, T, device, causal, window, token_mask=None, doc_ids=None, *, rule, reference=None):
        self.shape, self.causal, self.positions = (B, T), causal, torch.arange(T, device=device)
        if token_mask is None and doc_ids is None:  # the same for every batch of this shape: built once
            self.masks = {local: cached_mask(type(self), rule, T, device, causal, window, local)
                          for local in (False, True)}
        else:
            self.masks = {local: self.build_mask(rule, T, device, causal, window, local, token_mask, doc_ids)
                          for local in (False, True)}

    @staticmethod
    def build_mask(rule, T, device, causal, window, local, token_mask=None, doc_ids=None):
        """(B or 1, 1, T, T) bool, or None where SDPA's own (causal) kernel needs no mask."""
        if token_mask is None and doc_ids is None and not local:
            return None
        per_row = token_mask if token_mask is not None else doc_ids
        b = torch.arange(1 if per_row is None else per_row.shape[0], device=device)
        i = torch.arange(T, device=device)
        keep = rule(causal, window, local, token_mask, doc_ids)
        return keep(b[:, None, None], None, i[None, :, None], i[None, None, :]).view(-1, 1, T, T)

    def unpad(self, x):
        return x

    def repad(self, x):
        return x

    def attend(self, q, k, v, local):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        mask = self.masks[local]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and self.causal,
                                           scale=q.shape[-1] ** -0.5)
        return y.transpose(1, 2)  # (B, T, H, D)


class Flex(SDPA):
    """FlexAttention with block-sparse masks: skips the blocks outside the sliding window. The masks are
    built from index arithmetic only (no host sync), compiled on CUDA."""
    description = "PyTorch FlexAttention with block-sparse masks (flash-attn not installed)"
    needs = "PyTorch >= 2.5"
    compiled_on = ("cuda",)  # eager on a CPU, where it serves the tests and inference only (it has no CPU backward)

    @staticmethod
    def available(device):
        return optional("flex_attention") is not None

    @staticmethod
    def auto(device):  # on a CPU it compiles slowly and runs no faster than SDPA
        return device.type == "cuda" and Flex.available(device)

    trains = auto  # PyTorch 2.13 has no FlexAttention backward on a CPU (NotImplementedError at the first one)

    @staticmethod
    def nondeterminism(device):  # its Triton backward computes dQ and dK, dV in separate loops, without atomics
        return None

    @staticmethod
    def build_mask(rule, T, device, causal, window, local, token_mask=None, doc_ids=None):
        per_row = token_mask if token_mask is not None else doc_ids
        # compiled on CUDA, where eager mask building materialises the whole (B, T, T) mask first
        return Flex.kernel(optional("create_block_mask"), device)(rule(causal, window, local, token_mask, doc_ids),
                                                      None if per_row is None else per_row.shape[0], None, T, T,
                                                      device=device)

    def attend(self, q, k, v, local):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        attend = Flex.kernel(optional("flex_attention"), q.device)
        return attend(q, k, v, block_mask=self.masks[local], scale=q.shape[-1] ** -0.5).transpose(1, 2)

    @staticmethod
    def kernel(fn, device):
        """fn as this call runs it: compiled on the devices of compiled_on, except inside a graph being compiled
        already (a compiled block), which takes fn into its own graph: a torch.compile called there would be
        traced again with every block kind's graph, with a warning each time."""
        if device.type in Flex.compiled_on and not torch.compiler.is_compiling():
            return compiled(fn, dynamic=False)
        return fn


class FlexSDPA(Flex):
    """FlexAttention for the local layers, PyTorch's SDPA for the global ones where a row needs no mask (packed
    windows, no padding, attention across documents, as the paper trains): SDPA then runs a fused kernel of its own
    (cuDNN's on Hopper), which took 6.3 ms where FlexAttention took 9.5 on a global layer of 4 x 8,192 tokens on an
    H200 (docs/gpu.md). With padding or documents every layer runs FlexAttention (SDPA would need a dense mask)."""
    description = "FlexAttention for the local layers, SDPA's fused kernels (cuDNN) for unmasked global ones"
    needs = "CUDA and PyTorch >= 2.5"

    @staticmethod
    def auto(device):  # chosen by name only: SDPA's backward on CUDA adds up with atomics (nondeterminism)
        return False

    nondeterminism = SDPA.nondeterminism

    def __init__(self, B, T, device, causal, window, token_mask=None, doc_ids=None, *, rule, reference=None):
        super().__init__(B, T, device, causal, window, token_mask, doc_ids, rule=rule, reference=reference)
        self.unmasked = token_mask is None and doc_ids is None

    def attend(self, q, k, v, local):
        if local or not self.unmasked:
            return super().attend(q, k, v, local)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=q.shape[-1] ** -0.5)
        return y.transpose(1, 2)  # (B, T, H, D)


class Reference(SDPA):
    """model.py's reference_attention on SDPA's layout: every (B, H, T, T) score and the whole mask materialised.
    Slow and obvious: what the other backends are tested against; auto never picks it."""
    description = "model.py's reference_attention: every score materialised (slow; for tests and for reading)"

    @staticmethod
    def auto(device):
        return False

    def __init__(self, B, T, device, causal, window, token_mask=None, doc_ids=None, *, rule, reference):
        self.shape, self.positions, self.attention = (B, T), torch.arange(T, device=device), reference
        self.keep = {local: rule(causal, window, local, token_mask, doc_ids) for local in (False, True)}

    def attend(self, q, k, v, local):
        return self.attention(q, k, v, self.keep[local])

    @staticmethod
    def nondeterminism(device):  # matrix products and a softmax
        return None


@functools.cache  # once per process and window: a new process reads the page again (an edit to a constant the two
def attention_gap(reference, rule, window):  # functions read, made in a process after a model was built, is not seen)
    """How far model.py's attention as it is now (`reference` over `rule`'s masks) is from what every other backend
    computes, at the model's `window`, on small random batches in float64: the largest difference over the real
    tokens' outputs. The other backends compute the attention as first written (tests/test_backends.py holds them
    equal to it); an edit on the page (a soft cap on the scores, a prefix-LM mask) is not theirs. What they compute
    is written here again, apart from model.py, so that an edit there shows: SDPA over the keys of the query's own
    document and window, never padding, none after the query when causal, the query itself always. Sequences of two
    windows and more (a window of at most 116 keys: at most 256 tokens, whatever the model's), so that a limit on
    the global layers' reach below that shows too; three heads of other scales and a head size whose square root is
    no whole number, so that few edits coincide with the original on them. NaN where the page gives NaN."""
    cpu = torch.device("cpu")  # even where models are being built on another device (the meta one, for a count)
    g = torch.Generator(cpu).manual_seed(0)
    window = min(window, 116)  # the cost grows with T^2: a long window is checked at 116
    B, T, H, D = 2, 2 * window + 24, 3, 6
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64, device=cpu) for _ in range(3))
    q = q * torch.tensor([0.5, 2.0, 6.0], dtype=torch.float64, device=cpu)[:, None]  # scores small to past +-8
    i = torch.arange(T, device=cpu)
    real = i < torch.tensor([[T], [T - 3]], device=cpu)  # (B, T): the second sequence ends in padding
    doc_ids = (i >= torch.tensor([[T // 3], [T]], device=cpu)).long()  # (B, T): the first holds two documents
    gaps = []
    for causal, local, masked in itertools.product((False, True), repeat=3):
        see = torch.ones(B, T, T, dtype=torch.bool, device=cpu)  # (B, T, T): query i, key j
        if causal:
            see &= i[:, None] >= i[None, :]
        if local:
            see &= (i[:, None] - i[None, :]).abs() <= window
        if masked:
            see &= (doc_ids[:, :, None] == doc_ids[:, None, :]) & real[:, None, :]
        see |= torch.eye(T, dtype=torch.bool, device=cpu)
        want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=see[:, None])
        got = reference(q, k, v, rule(causal, window, local, *((real, doc_ids) if masked else (None, None))))
        rows = real if masked else torch.ones_like(real)
        gaps.append((got - want.transpose(1, 2))[rows].abs().max())
    return torch.stack(gaps).max().item()


def page_backend(requested, reference, rule, window):
    """The backend a model built with `requested` runs, given model.py's attention as it is now (`reference`,
    `rule`, at the model's `window`): `requested` while the page computes what the backends do (attention_gap), else
    the reference, the only one that runs an edit. auto then takes it and says so; a fast backend named is refused
    (it would train the attention as first written, not the page's)."""
    gap = attention_gap(reference, rule, window) if requested != "reference" else 0.0
    if gap <= 1e-5:  # float64 rounds at 1e-15; a step in float32 on the page (its softmax) moves it 1e-6, no more
        return requested
    if requested == "auto":
        say_once(f"warning: model.py's attention (reference_attention, mask_rule) computes something else than the "
                 f"fast backends do ({gap:.2g} apart on a test batch): it runs as written, on the reference backend "
                 f"(every score materialised: slower, more memory)")
        return "reference"
    raise InputError(f"attention backend {requested!r} computes model.py's attention as first written, and "
                     f"reference_attention or mask_rule there now compute something else ({gap:.2g} apart on a test "
                     f"batch): train with the attention on the page (--backend=reference, or auto, which picks it)")


# shape-only masks (no padding, no documents): training builds them once per (backend, shape, mode)
cached_mask = functools.lru_cache(maxsize=32)(lambda kind, *args: kind.build_mask(*args))


@functools.cache
def compiled(fn, dynamic):
    """torch.compile(fn), made on first use: importing the compiler costs ~2 s, which CPU runs never need.
    Compiled FlexAttention is the point of it (eager FlexAttention materialises the whole score matrix).
    Room for its graphs: in each mode (training, MLM and CLM validation) a global and a local mask, each at up
    to two batch sizes (a short last validation batch), static shapes: 3 x 2 x 2."""
    configure_compiler(3 * 2 * 2)
    return torch.compile(fn, dynamic=dynamic)


def configure_compiler(n):
    """Let dynamo keep n compiled graphs per function. Past its recompile_limit (8 by default) it warns and runs
    the function eager from then on: on a GPU, that is every step at a fraction of the speed."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, n)


def deterministic_compiler(on=True, device=None):
    """Whether inductor chooses its kernels' settings without timing them (on, train.py's --deterministic) or times
    them (off). By default it times a reduction's block sizes and warps at first launch and keeps the fastest: a
    choice that changes the order of the sums and can differ between two processes, so a resumed run could round
    differently from the uninterrupted one, where --resume promises the same bits. Returns whether the mode is
    on: False where this PyTorch has no such mode (then compiled kernels are timed, whatever `on` says), and on a
    `device` other than CUDA, where it is left unset and inductor unimported (1.5 s): the fused loss and FlexAttention
    compile on CUDA only, train.py's COMPILERS has no CPU entry, and inductor's CPU kernels are timed only under
    max-autotune, which nothing here turns on."""
    if device is not None and device.type != "cuda":
        return False
    import torch._inductor.config as inductor
    if hasattr(inductor, "deterministic"):  # older PyTorch releases have no such mode
        inductor.deterministic = on
    return compiler_is_deterministic()


def compiler_is_deterministic():
    inductor = sys.modules.get("torch._inductor.config")  # not imported: nothing set the mode (a CPU run)
    return getattr(inductor, "deterministic", False)


# What kill-and-resume has shown on a GPU (docs/gpu.md): one H200, FlexAttention, the smoke recipe's 40 steps.
GPU_RESUME = ("on a GPU it is not shown to: kill-and-resume on an H200 differed from the uninterrupted run in 5 of 5 "
              "tries with inductor's deterministic mode (by up to 7.2e-3 after 40 steps) and matched in 1 of 1 "
              "without it; the cause is not established")


def resume_caveat(backend, device, deterministic):
    """Why a resumed run on `device` may not repeat the uninterrupted one bit for bit, or None where it does: the
    attention backend's backward (its `nondeterminism`), inductor timing its compiled kernels (`deterministic`: what
    deterministic_compiler returned), or, on CUDA, what kill-and-resume has shown there (GPU_RESUME)."""
    why = BACKENDS[backend].nondeterminism(device)
    if why:
        return f"--backend={backend}: {why}"
    if device.type == "cuda" and not deterministic:
        return "inductor times its compiled kernels' settings at first launch (no deterministic mode)"
    return GPU_RESUME if device.type == "cuda" else None


def backend_for(model, device):
    """The backend name model.py's model runs with on `device`, in the dtype autocast gives there now (else its
    weights')."""
    device = torch.device(device)
    return pick_backend(device, model.backend, dtype=compute_dtype(device, model.decoder.weight.dtype))


def labelled(labels, device):
    """(positions, labels) of the flattened labels that are not IGNORE_INDEX, on `device`. Labels may stay in host
    memory while the model is on a GPU: the positions are found on the host, with no device sync, and sent through
    pinned memory; that is why train.py builds DDP without device_ids (DDP would move the labels first)."""
    flat = labels.flatten()
    keep = (flat != IGNORE_INDEX).nonzero().squeeze(1)  # (M,), on the labels' device
    targets = flat[keep]
    if keep.device != device:
        keep, targets = (t.pin_memory().to(device, non_blocking=True) for t in (keep, targets))
    return keep, targets


def compile_blocks(model, backend="inductor"):
    """torch.compile each block of model.py's model (regional compilation): blocks of one kind share their graphs,
    so a deep model compiles as fast as a shallow one."""
    # Every block runs the one Block.forward, whose graphs dynamo keeps together. A run needs one per block kind
    # (layer 0 without attn_norm, global, local) and mode (training; MLM and CLM validation, without grad and with
    # other masks), each compiled for its first shapes and once more with the sizes that then changed made dynamic
    # (the unpadded token count, a short last validation batch).
    kinds = len({(type(b.attn_norm), b.local) for b in model.model.layers})
    configure_compiler(kinds * 3 * 2)
    for block in model.model.layers:
        block.compile(backend=backend)
    model.compiled_with = backend


def compute_dtype(device, weights=torch.float32):
    """The dtype the blocks compute in on `device`: autocast's where it is on, else the weights'."""
    on = torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)
    return torch.get_autocast_dtype(device.type) if on else weights


class Flash:
    """FlashAttention-2 on the unpadded layout: the real tokens of all sequences concatenated, (N, d), sequences
    delimited by cu_seqlens; padding is never computed. flash-attn's kernel where it is installed, else PyTorch's
    own (torch.nn.attention.varlen, PyTorch >= 2.11: the same algorithm, the same window convention). Packed
    batches without padding or doc_ids need no host sync; padding costs one (the unpadded size N), doc_ids two
    more (the number of documents and the longest one)."""
    description = ("FlashAttention-2 varlen, unpadded (padding tokens are never computed): flash-attn's kernel, "
                   "else PyTorch's own (>= 2.11)")
    needs = "CUDA, and flash-attn or PyTorch >= 2.11 (torch.nn.attention.varlen with its window_size)"

    @staticmethod
    def available(device):
        return device.type == "cuda" and (flash_attn_varlen_func is not None or optional("varlen_attn") is not None)

    trains = available

    @staticmethod
    def auto(device):
        """Only flash-attn's kernel, whose deterministic backward keeps --resume bit for bit: PyTorch's adds dQ up
        with atomics (nondeterminism, below), so it runs where --backend=flash asks for it."""
        return device.type == "cuda" and flash_attn_varlen_func is not None

    @staticmethod
    def library():
        return "flash-attn" if flash_attn_varlen_func is not None else "PyTorch's varlen_attn"

    @staticmethod
    def nondeterminism(device):
        """Why the same batch may give other gradient bits from one run to the next, or None: flash-attn's backward
        is asked for its deterministic mode; PyTorch's has one only under torch.use_deterministic_algorithms, which
        the trainer does not turn on (it stops at every CUDA op that has no deterministic kernel)."""
        if flash_attn_varlen_func is None:
            return "PyTorch's FlashAttention backward adds dQ up with atomics, in an order that varies"
        return None

    @staticmethod
    def computes(device, dtype):  # its CUDA kernels take bf16 and fp16 only (the CPU test doubles take fp32 too)
        return device.type != "cuda" or dtype in (torch.bfloat16, torch.float16)

    def __init__(self, B, T, device, causal, window, token_mask=None, doc_ids=None, *, rule=None, reference=None):
        # the rule as sequence lengths and a window: FlashAttention takes no mask (tests hold it equal to the rule)
        self.shape, self.causal, self.window = (B, T), causal, window
        self.keep = None if token_mask is None else token_mask.flatten().nonzero().squeeze(1)  # (N,)
        self.positions = self.unpad(torch.arange(T, device=device).expand(B, T))
        if doc_ids is None:
            lengths = torch.full((B,), T, device=device) if token_mask is None else token_mask.sum(1)
        else:  # each document is its own varlen sequence
            new_doc = torch.ones(B, T, dtype=torch.bool, device=device)
            new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
            starts = self.unpad(new_doc).nonzero().squeeze(1)
            # the end filled in on the device: new_tensor([N]) would copy N from the host, a wait for the GPU
            lengths = torch.diff(starts, append=starts.new_full((1,), self.positions.shape[0]))
        self.cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        # An upper bound is enough (it sizes the kernel's grid) and costs no sync; with documents the backward's
        # buffers grow as n_documents x max_seqlen, so take the exact one (the nonzero above synced already).
        self.max_seqlen = T if doc_ids is None else int(lengths.max())

    def unpad(self, x):
        x = x.flatten(0, 1)  # (B*T, ...)
        return x if self.keep is None else x[self.keep]

    def repad(self, x):
        B, T = self.shape
        if self.keep is None:
            return x.view(B, T, -1)
        return x.new_zeros(B * T, x.shape[-1]).index_copy_(0, self.keep, x).view(B, T, -1)

    def attend(self, q, k, v, local):
        if q.is_cuda and q.dtype not in (torch.bfloat16, torch.float16):
            raise InputError("FlashAttention computes in bf16/fp16: run under torch.autocast, or pick another "
                             "attention backend")
        # window_size: keys i - left ..= i + right, -1 unbounded on that side (both kernels' convention)
        left, cu, longest = self.window if local else -1, self.cu_seqlens, self.max_seqlen
        if flash_attn_varlen_func is None:  # PyTorch's takes causal as a window that ends at the query
            window = (left, 0 if self.causal else left)
            return optional("varlen_attn")(q, k, v, cu, cu, longest, longest, window_size=window)
        # deterministic: --resume promises the uninterrupted run's weights bit for bit, and flash-attn's backward
        # otherwise adds up dQ with atomics whose order changes from run to run (the price: a slightly slower
        # backward, by flash-attn's own account)
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, softmax_scale=q.shape[-1] ** -0.5,
                                      causal=self.causal, window_size=(left, 0 if self.causal and local else left),
                                      deterministic=True)


# flash-attn 3 (the flash_attn_interface module, Hopper kernels) is not used: it is built from source, its varlen
# function changed what it returns and takes between releases, and no Hopper GPU has run it against the SDPA
# reference here; flash-attn 2 runs on Hopper too, and the tests pin its documented interface.
# "auto" picks the first available, in this order (never the reference)
BACKENDS = {"flash": Flash, "flex": Flex, "flex+sdpa": FlexSDPA, "sdpa": SDPA, "reference": Reference}
BACKEND_NAMES = {name: kind.description for name, kind in BACKENDS.items()}


def pick_backend(device: torch.device, requested: str = "auto", training: bool = False, dtype=None) -> str:
    """The backend to run on `device`: `requested` if this device has it (and its backward, for `training`) in
    `dtype` (None: the dtype autocast gives here now, else fp32); for auto, the first in BACKENDS that suits all
    three, so that auto never picks a backend that would refuse the batch."""
    dtype = dtype or compute_dtype(device)
    if requested == "auto":
        return next(name for name, kind in BACKENDS.items() if kind.auto(device) and kind.computes(device, dtype))
    if requested not in BACKENDS:
        raise InputError(f"unknown attention backend {requested!r}; expected auto, {', '.join(BACKENDS)}")
    if not BACKENDS[requested].available(device):
        raise InputError(f"attention backend {requested!r} is not available on {device.type}: "
                         f"it needs {BACKENDS[requested].needs}")
    if training and not BACKENDS[requested].trains(device):
        raise InputError(f"attention backend {requested!r} cannot train on {device.type}: PyTorch has no backward "
                         f"for it there (it needs CUDA); use sdpa or auto")
    if not BACKENDS[requested].computes(device, dtype):
        name = str(dtype).removeprefix("torch.")
        raise InputError(f"attention backend {requested!r} cannot compute in {name} on {device.type} (flash-attn takes "
                         f"bfloat16 and float16 only): use --dtype=bfloat16, or another backend for --dtype={name}")
    return requested


# -----------------------------------------------------------------------------
# Fused linear cross-entropy: the decoder and the loss in row chunks, so that the (rows, vocab) logits
# never exist at once in fp32. The loss is a scalar, so d loss / d logits is known in the forward:
# gradients are formed chunk by chunk there and only scaled by the incoming gradient in backward.


def linear_cross_entropy(h, weight, bias, labels, chunk=None):
    """Equals F.cross_entropy(h @ weight.T + bias, labels, ignore_index=-100), value and gradients.
    chunk: rows per (rows, vocab) logits block (default 4096 on CUDA, 1024 on a CPU, where the block is kept)."""
    with_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(h, weight, bias, labels, chunk or (4096 if h.is_cuda else 1024), with_grad)


def check_fused(plain):
    """An InputError unless linear_cross_entropy computes what `plain` (model.py's cross_entropy, as it is now)
    does: loss and gradients on a small random batch in float64. An edited loss (label smoothing, a z-loss) is
    not what this kernel computes, and running the kernel in its place would train something else, silently."""
    g = torch.Generator().manual_seed(0)
    h, weight, bias = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
                       for shape in ((24, 8), (50, 8), (50,)))
    targets = torch.randint(0, 50, (24,), generator=g)
    got = []
    for loss in (plain, linear_cross_entropy):
        value = loss(h, weight, bias, targets)
        got.append([value.detach(), *torch.autograd.grad(value, (h, weight, bias))])
    gap = max((a - b).abs().max().item() for a, b in zip(*got))
    if gap > 1e-9:
        raise InputError(f"loss=fused computes model.py's cross_entropy as first written, and the cross_entropy there "
                         f"now computes something else (loss or gradients {gap:.2g} apart on a test batch): train "
                         f"with the loss on the page (train.py --loss=plain, the default)")


def _chunk_loss_and_grad(logits, target, with_grad):
    """A chunk's per-row loss and d loss / d logits = softmax - onehot (unscaled), in the logits' dtype.
    The math is fp32 (at least) and in place: fp32 logits are overwritten by the softmax. On CUDA it is
    compiled into one fused pass over the (c, V) chunk."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    picked = z.gather(1, target[:, None])  # (c, 1), read before z is overwritten
    m = z.amax(-1, keepdim=True)
    e = z.sub_(m).exp_()  # in place: a fresh (c, V) block costs a CPU more in page faults than the math
    total = e.sum(-1, keepdim=True)
    loss = (m + total.log() - picked).squeeze(1)  # logsumexp - the target's logit
    if not with_grad:
        return loss, None
    g = e.div_(total)  # softmax
    g.scatter_add_(1, target[:, None], -torch.ones_like(picked))
    return loss, g.to(logits.dtype)


_cpu_logits = {}  # dtype -> the (rows, vocab) block reused by every chunk and step on a CPU


def _logits(h, weight, bias):
    """h @ weight.T + bias. On a CPU into a kept block: allocating it anew (fresh pages from the OS) each time
    took longer than the matmul (CUDA's caching allocator reuses memory by itself)."""
    if h.is_cuda or torch.is_autocast_enabled(h.device.type):
        return F.linear(h, weight, bias)
    n = h.shape[0] * weight.shape[0]
    if _cpu_logits.get(h.dtype, torch.empty(0)).numel() < n:
        _cpu_logits[h.dtype] = torch.empty(n, dtype=h.dtype)
    return torch.addmm(bias, h, weight.t(), out=_cpu_logits[h.dtype][:n].view(h.shape[0], -1))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, labels, chunk, with_grad):
        n = (labels != IGNORE_INDEX).sum().clamp(min=1)  # a tensor: no host sync
        step = compiled(_chunk_loss_and_grad, dynamic=True) if h.is_cuda else _chunk_loss_and_grad
        loss = torch.zeros((), device=h.device, dtype=torch.promote_types(h.dtype, torch.float32))
        grad_h = torch.empty_like(h) if with_grad else None
        grad_w = grad_b = None
        acc = torch.promote_types(weight.dtype, torch.float32)  # bf16 chunks add up in fp32
        for i in range(0, h.shape[0], chunk):
            hc, yc = h[i:i + chunk], labels[i:i + chunk]
            logits = _logits(hc, weight, bias)  # (c, V), bf16 under autocast: only a chunk ever exists
            valid = (yc != IGNORE_INDEX)[:, None]  # (c, 1)
            chunk_loss, g = step(logits, yc.clamp(min=0), with_grad)
            loss += (chunk_loss * valid.squeeze(1)).sum()
            if with_grad:  # zero the ignored rows on the (c, d) side, not in the (c, V) gradient: a pass fewer
                hc = hc.to(g.dtype) * valid
                grad_h[i:i + chunk] = (g @ weight.to(g.dtype)) * valid
                gw, gb = g.t() @ hc, g.t() @ valid.to(g.dtype).squeeze(1)
                grad_w = gw.to(acc) if grad_w is None else grad_w.add_(gw)
                grad_b = gb.to(acc) if grad_b is None else grad_b.add_(gb)
        if with_grad:  # the mean's 1/n applied once, in fp32 or wider (1/n is inexact in bf16)
            if grad_w is None:  # no labelled row: the loss is 0, and so is its gradient
                grad_w, grad_b = torch.zeros_like(weight, dtype=acc), torch.zeros_like(bias, dtype=acc)
            ctx.dtypes = weight.dtype, bias.dtype
            ctx.save_for_backward(grad_h.div_(n), grad_w.div_(n), grad_b.div_(n))
        return loss / n

    @staticmethod
    def backward(ctx, grad):
        # in place: these weight-sized tensors are used once, and fresh ones cost page faults on a CPU
        if getattr(ctx, "used", False):
            raise RuntimeError("linear_cross_entropy: backward through the same loss twice is not supported")
        ctx.used = True
        grad_h, grad_w, grad_b = (t.mul_(grad) for t in ctx.saved_tensors)
        return grad_h, grad_w.to(ctx.dtypes[0]), grad_b.to(ctx.dtypes[1]), None, None, None
