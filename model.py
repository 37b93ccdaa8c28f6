"""ModernBERT from scratch, numerically identical to Hugging Face `ModernBertForMaskedLM`.

Read top to bottom: the config and its size presets, rotary embedding, attention, MLP, the block, then
the model with its checkpoint I/O, optimizer groups and FLOP count. Below the model: the attention
backends (flash-attn, FlexAttention, SDPA) behind one small interface, and the fused linear
cross-entropy. Parameter names are exactly Hugging Face's, so a checkpoint is a plain state dict (SPEC §1).

The same weights run with a bidirectional mask (MLM) or a causal one (the CLM detour): `causal=True`
changes only which keys each query may see. Global layers see every key (j <= i when causal); local
layers see |i - j| <= 64 (i - 64 <= j <= i when causal).
"""
import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from machinery.cli import InputError
from machinery.hf import check_config, config_to_hf, read_config, read_weights, resolve_checkpoint, write_checkpoint

try:  # optional: the fastest path on CUDA, and the one ModernBERT was trained with
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None
try:  # PyTorch >= 2.5; block-sparse masks make the sliding window cheap on GPU
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:
    create_block_mask = flex_attention = None

IGNORE_INDEX = -100  # label of positions that carry no loss, as in PyTorch and transformers

# -----------------------------------------------------------------------------
# Configuration. Field names follow Hugging Face's config.json.

PRESETS = {
    # For CPU tests and the demo: keeps the global/local alternation (layers 0 and 3 global) and a
    # local window (+-64) shorter than the demo's 256-token sequences.
    "tiny": dict(hidden_size=128, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4),
    # Small experiments (issue 12): enough blocks to compare low and high layers, head dim 64 as in base.
    "mini": dict(hidden_size=256, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4),
    "small": dict(hidden_size=384, intermediate_size=576, num_hidden_layers=12, num_attention_heads=6),
    "base": dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12),
    "large": dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28, num_attention_heads=16),
}

@dataclass
class ModernBERTConfig:
    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152  # GeGLU width; Wi outputs twice this
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    global_attn_every_n_layers: int = 3  # layer i is global iff i % 3 == 0
    local_attention: int = 128  # total window: a local layer sees 64 tokens on each side
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    attention_dropout: float = 0.0  # 0.1 in the original pretraining; 0 here (our choice, SPEC §1)
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0  # truncated normal at +-2 sigma
    max_position_embeddings: int = 8192
    pad_token_id: int = 50283
    cls_token_id: int = 50281
    sep_token_id: int = 50282
    mask_token_id: int = 50284
    layer_types: tuple = None  # derived from global_attn_every_n_layers unless a checkpoint lists them

    def __post_init__(self):
        check_config(self)  # InputError naming the field, before anything is allocated
        if self.layer_types is None:
            n = self.global_attn_every_n_layers
            self.layer_types = ["full_attention" if i % n == 0 else "sliding_attention"
                                for i in range(self.num_hidden_layers)]
        self.layer_types = tuple(self.layer_types)

    @property
    def window(self):  # reach on each side of a local layer: 64 for ModernBERT
        return self.local_attention // 2

    @classmethod
    def from_preset(cls, name, **overrides):
        if name not in PRESETS:
            raise InputError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def replace(self, **overrides):
        """A copy with some fields changed (e.g. attention_dropout for training), checked like any config."""
        unknown = sorted(set(overrides) - {f.name for f in fields(self)})
        if unknown:
            raise InputError(f"unknown config fields {unknown}")
        if {"num_hidden_layers", "global_attn_every_n_layers"} & set(overrides):
            overrides.setdefault("layer_types", None)  # derived again from the new depth
        return dataclasses.replace(self, **overrides)

    def to_hf(self):
        """config.json's contents, as transformers writes them."""
        return config_to_hf(self)


# -----------------------------------------------------------------------------
# Rotary embedding, GPT-NeoX "rotate half" style over the whole head, computed in fp32 as HF does
# (also under bf16 autocast: positions up to 8192 do not survive bf16's 8-bit mantissa).


def rope_cos_sin(positions, head_dim, theta):
    """positions (P,) -> cos, sin of shape (P, 1, head_dim), broadcasting over heads."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (P, 1, D)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


# -----------------------------------------------------------------------------
# The transformer block. Pre-norm; layer 0 has no attn_norm because the embeddings are already normed.


class Attention(nn.Module):
    def __init__(self, cfg, local):
        super().__init__()
        self.local, self.n_head = local, cfg.num_attention_heads
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)  # rows Q | K | V, head-major
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.dropout = cfg.attention_dropout  # on the output projection only (SPEC §1)

    def forward(self, x, rope, attn):
        qkv = self.Wqkv(x).unflatten(-1, (3, self.n_head, -1))  # (..., 3, H, D)
        q, k, v = qkv.unbind(-3)  # each (..., H, D)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attn.attend(q, k, v, self.local).flatten(-2)  # (..., H*D)
        return F.dropout(self.Wo(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        a, gate = self.Wi(x).chunk(2, dim=-1)  # GeGLU: the FIRST half goes through exact (erf) GELU
        return self.Wo(F.gelu(a) * gate)


def layer_norm(cfg):
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=False)


class Block(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.local = cfg.layer_types[i] == "sliding_attention"
        self.attn_norm = layer_norm(cfg) if i > 0 else nn.Identity()
        self.attn = Attention(cfg, self.local)
        self.mlp_norm = layer_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, ropes, attn):
        x = x + self.attn(self.attn_norm(x), ropes[self.local], attn)
        return x + self.mlp(self.mlp_norm(x))


# -----------------------------------------------------------------------------
# The model.


class ModernBERT(nn.Module):
    def __init__(self, config: ModernBERTConfig, backend: str = "auto"):
        super().__init__()
        self.config, self.backend = config, backend
        c = config
        self.model = nn.ModuleDict(dict(
            embeddings=nn.ModuleDict(dict(
                tok_embeddings=nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id),
                norm=layer_norm(c))),
            layers=nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers)),
            final_norm=layer_norm(c)))
        self.head = nn.ModuleDict(dict(dense=nn.Linear(c.hidden_size, c.hidden_size, bias=False), norm=layer_norm(c)))
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size, bias=True)
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight  # tied (SPEC §1)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self):
        """Megatron init (SPEC §1): truncated normal at +-2 sigma, sigma = 0.02, and 0.02 / sqrt(2L)
        on the two projections that write into the residual stream; norms 1, the decoder bias 0."""
        c = self.config
        for name, p in self.named_parameters():  # the tied decoder weight is the embedding, seen once
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name == "decoder.bias":
                nn.init.zeros_(p)
            else:
                std = c.initializer_range
                if name.endswith(("attn.Wo.weight", "mlp.Wo.weight")):
                    std /= math.sqrt(2 * c.num_hidden_layers)
                a = c.initializer_cutoff_factor * std
                nn.init.trunc_normal_(p, mean=0.0, std=std, a=-a, b=a)

    # --- forward ---
    def attention_backend(self, device=None):
        """The backend name this model runs with on `device` (see BACKEND_NAMES)."""
        device = device or self.decoder.weight.device
        return pick_backend(torch.device(device), self.backend)

    def encode(self, input_ids, attention_mask=None, causal=False, doc_ids=None, all_layers=False):
        """Final hidden states (B, T, d) after final_norm; with all_layers, the L block outputs instead."""
        B, T = input_ids.shape
        token_mask = None if attention_mask is None else attention_mask.bool()
        attn = BACKENDS[self.attention_backend(input_ids.device)](
            B, T, input_ids.device, causal, self.config.window, token_mask, doc_ids)
        x = attn.unpad(self.model.embeddings.norm(self.model.embeddings.tok_embeddings(input_ids)))  # (B, T, d)
        D = self.config.hidden_size // self.config.num_attention_heads
        ropes = {False: rope_cos_sin(attn.positions, D, self.config.global_rope_theta),
                 True: rope_cos_sin(attn.positions, D, self.config.local_rope_theta)}
        outputs = []
        for block in self.model.layers:
            x = block(x, ropes, attn)
            if all_layers:
                outputs.append(attn.repad(x))
        return outputs if all_layers else attn.repad(self.model.final_norm(x))

    def hidden_states(self, input_ids, attention_mask=None, causal=False):
        """The L block outputs, each (B, T, d), before final_norm: one per layer, for the CKA analysis."""
        return self.encode(input_ids, attention_mask, causal, all_layers=True)

    def head_hidden(self, h):
        """The MLM head before the tied decoder: dense, GELU, norm."""
        return self.head.norm(F.gelu(self.head.dense(h)))

    def predict(self, h):
        """(..., d) final hidden states -> (..., vocab) logits."""
        return self.decoder(self.head_hidden(h))

    def forward(self, input_ids, attention_mask=None, labels=None, causal=False, doc_ids=None):
        """Returns (logits, loss).

        Without labels: logits (B, T, vocab) and loss None. With labels: sparse prediction, as
        ModernBERT trains: the head runs only on positions whose label is not -100, the decoder and
        cross-entropy are fused in chunks, and logits is None (they are never materialised).
        loss is the mean cross-entropy over the labelled positions. Labels may stay in host memory
        while the model is on a GPU: the labelled positions are then found on the host, with no sync."""
        h = self.encode(input_ids, attention_mask, causal, doc_ids)  # (B, T, d)
        if labels is None:
            return self.predict(h), None
        flat = labels.flatten()
        keep = (flat != IGNORE_INDEX).nonzero().squeeze(1)  # (M,), on the labels' device
        targets = flat[keep]
        if keep.device != h.device:
            keep, targets = (t.pin_memory().to(h.device, non_blocking=True) for t in (keep, targets))
        h = self.head_hidden(h.flatten(0, 1)[keep])  # (M, d)
        return None, linear_cross_entropy(h, self.decoder.weight, self.decoder.bias, targets)

    # --- optimizer groups and FLOPs ---
    def param_groups(self):
        """(name, param) lists: 'decay' for matrices, 'no_decay' for ndim <= 1 (biases, norms). Tied once."""
        named = dict(self.named_parameters())  # named_parameters() yields a tied tensor once
        groups = {"decay": [(n, p) for n, p in named.items() if p.ndim >= 2],
                  "no_decay": [(n, p) for n, p in named.items() if p.ndim <= 1]}
        assert sum(len(g) for g in groups.values()) == len(named), "every parameter in exactly one group"
        return groups

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len, causal=False, mask_rate=1.0):
        """Training FLOPs (forward + backward = 3x forward) per token, matmuls and attention.

        mask_rate: fraction of positions that go through the head and decoder (sparse prediction):
        the MLM masking rate, or 1.0 for CLM. Attention keys per query: global layers see seq_len
        (half on average when causal); local layers 2w+1 = 129 (w+1 = 65 when causal), ignoring the
        shorter windows at the sequence edges."""
        c = self.config
        d, w = c.hidden_size, c.window
        body = c.num_hidden_layers * (4 * d * d + 3 * d * c.intermediate_size)  # Wqkv, Wo, Wi, mlp.Wo
        head = d * d + d * c.vocab_size  # head.dense and the decoder, per predicted token
        keys = 0
        for kind in c.layer_types:
            if kind == "full_attention":
                keys += (seq_len + 1) / 2 if causal else seq_len
            else:
                keys += min(w + 1 if causal else 2 * w + 1, seq_len)
        return 6 * (body + mask_rate * head) + 12 * d * keys  # QK^T and PV: 2 * 2d FLOPs per key, x3

    # --- checkpoints: a Hugging Face directory (config.json + model.safetensors) ---
    @classmethod
    def from_pretrained(cls, path_or_id, backend="auto", **config_overrides):
        """Load a Hugging Face directory or hub id; config_overrides set config fields (e.g. attention_dropout)."""
        path = resolve_checkpoint(path_or_id)
        config = read_config(os.path.join(path, "config.json"))
        model = cls(config.replace(**config_overrides), backend)
        model.load_weights(os.path.join(path, "model.safetensors"))
        return model

    def load_weights(self, weights_file):
        self.load_state_dict(read_weights(weights_file, self.state_dict()))

    def save_pretrained(self, path):
        """Writes config.json and model.safetensors that transformers.AutoModelForMaskedLM loads as is."""
        write_checkpoint(path, self.state_dict(), self.config)


def write_json(path, obj):
    """Write JSON atomically: a kill mid-write leaves the previous file intact."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


# -----------------------------------------------------------------------------
# Attention backends. One is built per forward from the batch's layout and shared by every layer:
#   positions  (P,) the position of each row the blocks see, for RoPE
#   unpad(x)   (B, T, d) -> the layout the blocks run in
#   attend(q, k, v, local)  q, k, v (..., H, D) in that layout -> (..., H, D)
#   repad(x)   the blocks' layout -> (B, T, d), padding rows zero
# token_mask (B, T) bool marks real tokens (None: all real); doc_ids (B, T) keeps packed documents apart
# when given (None: attention crosses document boundaries, as in the paper).


def mask_rule(causal, window, local, token_mask=None, doc_ids=None):
    """keep(b, h, q, k) -> bool: may query q see key k. Written once for dense masks (b=None: every row) and
    for FlexAttention (scalar indices)."""

    def keep(b, h, q, k):
        ok = torch.ones_like(q == k)
        if causal:
            ok = ok & (k <= q)
        if local:
            ok = ok & ((q - k).abs() <= window)
        if token_mask is not None:
            ok = ok & (token_mask[:, None, :] if b is None else token_mask[b, k])
        if doc_ids is not None:
            ok = ok & (doc_ids[:, :, None] == doc_ids[:, None, :] if b is None else doc_ids[b, q] == doc_ids[b, k])
        # Every query keeps itself, so padding rows never see an empty set (NaN that would leak
        # into later layers through 0 * NaN); real tokens always see themselves anyway.
        return ok | (q == k)

    return keep


class SDPA:
    """PyTorch scaled_dot_product_attention with dense boolean masks: runs anywhere, the reference."""
    description = ("PyTorch scaled_dot_product_attention with dense masks "
                   "(flash-attn and FlexAttention are used on CUDA)")

    @staticmethod
    def available(device):
        return True

    auto = available  # whether "auto" may pick it on this device

    def __init__(self, B, T, device, causal, window, token_mask=None, doc_ids=None):
        self.shape, self.causal, self.positions = (B, T), causal, torch.arange(T, device=device)
        if token_mask is None and doc_ids is None:  # the same for every batch of this shape: built once
            self.masks = {local: cached_mask(type(self), T, device, causal, window, local) for local in (False, True)}
        else:
            self.masks = {local: self.build_mask(T, device, causal, window, local, token_mask, doc_ids)
                          for local in (False, True)}

    @staticmethod
    def build_mask(T, device, causal, window, local, token_mask=None, doc_ids=None):
        """(B or 1, 1, T, T) bool, or None where SDPA's own (causal) kernel needs no mask."""
        if token_mask is None and doc_ids is None and not local:
            return None
        i = torch.arange(T, device=device)
        keep = mask_rule(causal, window, local, token_mask, doc_ids)
        return keep(None, None, i[:, None], i[None, :]).view(-1, 1, T, T)

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

    @staticmethod
    def available(device):
        return flex_attention is not None

    @staticmethod
    def auto(device):  # on a CPU it compiles slowly and runs no faster than SDPA
        return device.type == "cuda" and Flex.available(device)

    @staticmethod
    def build_mask(T, device, causal, window, local, token_mask=None, doc_ids=None):
        per_row = token_mask if token_mask is not None else doc_ids
        return create_block_mask(mask_rule(causal, window, local, token_mask, doc_ids),
                                 None if per_row is None else per_row.shape[0], None, T, T, device=device,
                                 _compile=device.type == "cuda")

    def attend(self, q, k, v, local):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        attend = compiled(flex_attention, dynamic=False) if q.is_cuda else flex_attention  # CPU: tests only (no backward)
        return attend(q, k, v, block_mask=self.masks[local], scale=q.shape[-1] ** -0.5).transpose(1, 2)


# shape-only masks (no padding, no documents): training builds them once per (backend, shape, mode)
cached_mask = functools.lru_cache(maxsize=32)(lambda kind, *args: kind.build_mask(*args))


@functools.cache
def compiled(fn, dynamic):
    """torch.compile(fn), made on first use: importing the compiler costs ~2 s, which CPU runs never need.
    Compiled FlexAttention is the point of it (eager FlexAttention materialises the whole score matrix)."""
    return torch.compile(fn, dynamic=dynamic)


class Flash:
    """flash-attn's varlen kernel on the unpadded layout: the real tokens of all sequences concatenated,
    (N, d), sequences delimited by cu_seqlens; padding is never computed. Packed batches without padding
    or doc_ids need no host sync; padding costs one (the unpadded size N), doc_ids one more."""
    description = "flash-attn varlen (unpadded: padding tokens are never computed)"

    @staticmethod
    def available(device):
        return flash_attn_varlen_func is not None and device.type == "cuda"

    auto = available

    def __init__(self, B, T, device, causal, window, token_mask=None, doc_ids=None):
        self.shape, self.causal, self.window = (B, T), causal, window
        self.keep = None if token_mask is None else token_mask.flatten().nonzero().squeeze(1)  # (N,)
        self.positions = self.unpad(torch.arange(T, device=device).expand(B, T))
        if doc_ids is None:
            lengths = torch.full((B,), T, device=device) if token_mask is None else token_mask.sum(1)
        else:  # each document is its own varlen sequence
            new_doc = torch.ones(B, T, dtype=torch.bool, device=device)
            new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
            starts = self.unpad(new_doc).nonzero().squeeze(1)
            lengths = torch.diff(starts, append=starts.new_tensor([self.positions.shape[0]]))
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
            raise ValueError("flash-attn computes in bf16/fp16: run under torch.autocast, or use backend 'flex'/'sdpa'")
        w = self.window if local else -1  # keys i - w ..= i + w; -1: unbounded (flash-attn's convention)
        return flash_attn_varlen_func(q, k, v, self.cu_seqlens, self.cu_seqlens, self.max_seqlen, self.max_seqlen,
                                      softmax_scale=q.shape[-1] ** -0.5, causal=self.causal,
                                      window_size=(w, 0 if self.causal and local else w))


BACKENDS = {"flash": Flash, "flex": Flex, "sdpa": SDPA}  # "auto" picks the first available, in this order
BACKEND_NAMES = {name: kind.description for name, kind in BACKENDS.items()}


def pick_backend(device: torch.device, requested: str = "auto") -> str:
    if requested == "auto":
        return next(name for name, kind in BACKENDS.items() if kind.auto(device))
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; expected auto, {', '.join(BACKENDS)}")
    if not BACKENDS[requested].available(device):
        raise ValueError(f"attention backend {requested!r} is not available on {device.type}: "
                         f"flash needs flash-attn and CUDA, flex needs PyTorch >= 2.5")
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
