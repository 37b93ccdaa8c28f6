"""ModernBERT from scratch, numerically identical to Hugging Face `ModernBertForMaskedLM`.

Read top to bottom: the config and its size presets, rotary embedding, attention and the loss written out, MLP, the
block, then the model: forward, optimizer groups, FLOP count, checkpoints. Parameter names are Hugging Face's, so a
checkpoint is a plain state dict that transformers loads as is. The same weights run with a bidirectional mask (MLM)
or a causal one (the CLM detour): `causal=True` changes only which keys each query may see (`mask_rule`). Behind the
model, in machinery/ (a reader may skip them): kernels.py, the attention backends (the same attention, computed
faster), compiling the blocks and the fused decoder + loss (an opt-in: the loss that trains is `cross_entropy`, as
written here); hf.py, config.json and model.safetensors read and checked.
"""
import dataclasses
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from machinery.cli import InputError
from machinery.hf import check_config, read_config, read_weights, replace_config, resolve_checkpoint, write_checkpoint
# BACKENDS: the one table of attention backends (train.py and bench.py take it from here)
from machinery.kernels import (BACKENDS, IGNORE_INDEX, backend_for, check_fused, labelled, page_backend,  # noqa: F401
                               linear_cross_entropy)

# -----------------------------------------------------------------------------
# Configuration. Field names follow Hugging Face's config.json; machinery/hf.py checks every value.

PRESETS = {
    # For CPU tests and the demo: keeps the global/local alternation (layers 0 and 3 global) and a
    # local window (+-64) shorter than the demo's 256-token sequences.
    "tiny": dict(hidden_size=128, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4),
    # Small experiments: enough blocks to compare low and high layers, head dim 64 as in base.
    "mini": dict(hidden_size=256, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4),
    "small": dict(hidden_size=384, intermediate_size=576, num_hidden_layers=12, num_attention_heads=6),
    # ModernBERT-base (150M parameters) and ModernBERT-large (396M), as published.
    "base": dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12),
    "large": dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28, num_attention_heads=16),
}


# The MLP's activation by transformers' name for it (ACT2FN), so that config.json says what runs.
ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
               "silu": F.silu}


@dataclasses.dataclass
class ModernBERTConfig:
    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152  # GLU width; Wi outputs twice this
    hidden_activation: str = "gelu"  # the GLU's activation (ACTIVATIONS): GeGLU, as ModernBERT
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    global_attn_every_n_layers: int = 3  # layer i is global iff i % 3 == 0
    local_attention: int = 128  # total window: a local layer sees 64 tokens on each side
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    attention_dropout: float = 0.0  # ModernBERT pretrained with 0.1; train.py's --dropout sets it
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0  # truncated normal at +-2 sigma
    max_position_embeddings: int = 8192
    pad_token_id: int = 50283
    cls_token_id: int = 50281
    sep_token_id: int = 50282
    mask_token_id: int = 50284
    layer_types: tuple = None  # from global_attn_every_n_layers unless a checkpoint lists them

    def __post_init__(self):
        check_config(self, ACTIVATIONS)  # an InputError naming the field, before anything is allocated
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
        """A copy with some fields changed (e.g. attention_dropout for training), checked again."""
        return replace_config(self, **overrides)

    @classmethod
    def read(cls, config_file):
        """A checkpoint's config.json, checked (machinery/hf.py)."""
        return read_config(config_file, cls)


# -----------------------------------------------------------------------------
# Rotary embedding, GPT-NeoX "rotate half" style over the whole head, computed in fp32 as HF does
# (also under bf16 autocast: positions up to 8192 do not survive bf16's 8-bit mantissa).


def rope_cos_sin(positions, head_dim, theta):
    """positions (P,) -> cos, sin of shape (P, 1, head_dim), broadcasting over heads."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # (D/2,)
    freqs = positions.float()[:, None] * inv_freq  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (P, 1, D)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


# -----------------------------------------------------------------------------
# Attention, written out: which keys a query may see, then softmax(q k^T / sqrt(D)) v over them. MLM and CLM
# differ here only, in `causal`. machinery/kernels.py computes it faster (SDPA, FlexAttention, flash-attn; tested
# equal to it) and picks the fastest the device has; backend="reference" runs this one, and so does a model whose
# attention here was edited (kernels.page_backend checks at start that it still computes what the others do).


def mask_rule(causal, window, local, token_mask=None, doc_ids=None):
    """keep(b, h, i, j) -> bool: may query i of sequence b see key j (in any head h). The indices may be tensors
    that broadcast: the reference asks for a whole (B, T, T) mask at once, FlexAttention for one pair at a time.
    token_mask (B, T) marks real tokens (None: all real); doc_ids (B, T) keeps packed documents apart (None:
    attention crosses document boundaries, as in ModernBERT's pretraining)."""

    def keep(b, h, i, j):
        see = j == j  # bidirectional (MLM): every key
        if causal:
            see = see & (j <= i)  # CLM: a key may be seen only if it is not after the query
        if local:
            see = see & ((i - j).abs() <= window)  # a local layer: window keys each side (causal: behind only)
        if doc_ids is not None:
            see = see & (doc_ids[b, i] == doc_ids[b, j])  # its own document only
        if token_mask is not None:
            see = see & token_mask[b, j]  # padding is never seen
        # Every query sees itself, so a padding query never has an empty row: its softmax would be NaN, and
        # 0 * NaN would leak into later layers. A real token sees itself anyway.
        return see | (i == j)

    return keep


def reference_attention(q, k, v, keep):
    """q, k, v (B, T, H, D) -> (B, T, H, D): softmax(q k^T / sqrt(D)) v over the keys `keep` allows."""
    B, T, H, D = q.shape
    b, i = torch.arange(B, device=q.device), torch.arange(T, device=q.device)
    see = keep(b[:, None, None], None, i[None, :, None], i[None, None, :])  # (B or 1, T, T): query i, key j
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, T, T)
    scores = scores.masked_fill(~see[:, None], float("-inf"))  # a key it may not see weighs exp(-inf) = 0
    return (scores.softmax(-1) @ v).transpose(1, 2)  # (B, H, T, D) -> (B, T, H, D)


def cross_entropy(h, weight, bias, targets):
    """The loss, written out: the tied decoder's logits (M, vocab) of the M labelled positions' head outputs h
    (M, d), their mean cross-entropy against the targets (M,): the masked tokens (MLM) or the next ones (CLM).
    This is the loss that trains (an edit here changes training). kernels.linear_cross_entropy computes the same
    in row chunks, never all (M, vocab) logits at once in fp32: less memory, for this loss only (LOSSES)."""
    logits = F.linear(h, weight, bias)  # (M, vocab)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the softmax in fp32 under bf16 autocast
    return F.cross_entropy(logits, targets) if len(targets) else logits.sum()  # no labelled position: 0


LOSSES = ("plain", "fused")  # plain: cross_entropy above; fused: its numbers in chunks, once checked equal to it


# -----------------------------------------------------------------------------
# The transformer block. Pre-norm; layer 0 has no attn_norm because the embeddings are already
# normed. No biases anywhere in the blocks, as in ModernBERT.


class Attention(nn.Module):
    def __init__(self, cfg, local):
        super().__init__()
        self.local, self.n_head = local, cfg.num_attention_heads
        d = cfg.hidden_size
        self.Wqkv = nn.Linear(d, 3 * d, bias=False)  # rows Q | K | V, head-major
        self.Wo = nn.Linear(d, d, bias=False)
        # on the output projection only, so every backend drops alike (FlexAttention has none on probabilities)
        self.dropout = cfg.attention_dropout

    def forward(self, x, rope, attn):
        """x (..., d) in the backend's layout; attn: the batch's attention backend (kernels.py)."""
        qkv = self.Wqkv(x).unflatten(-1, (3, self.n_head, -1))  # (..., 3, H, D)
        q, k, v = qkv.unbind(-3)  # each (..., H, D)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # rope: (cos, sin)
        y = attn.attend(q, k, v, self.local).flatten(-2)  # (..., H*D)
        return F.dropout(self.Wo(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_activation]

    def forward(self, x):
        a, gate = self.Wi(x).chunk(2, dim=-1)  # a GLU: the FIRST half goes through the activation (GeGLU: exact GELU)
        return self.Wo(self.act(a) * gate)


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
# The model: embeddings, the blocks, the MLM head (dense, GELU, norm), a decoder tied to the embeddings, as ModernBERT.


class ModernBERT(nn.Module):
    config_class = ModernBERTConfig  # what reads a checkpoint's config.json (as transformers names it)

    def __init__(self, config: ModernBERTConfig, backend: str = "auto", loss: str = "plain"):
        super().__init__()
        self.config = config
        self.backend = page_backend(backend, reference_attention, mask_rule, config.window)  # reference if edited
        self.loss = loss  # a name in LOSSES; "fused" is refused if cross_entropy above was edited
        if loss == "fused":
            check_fused(cross_entropy)
        self.compiled_with = None  # torch.compile's backend once compile_blocks has run
        c = config
        self.model = nn.ModuleDict(dict(
            embeddings=nn.ModuleDict(dict(
                tok_embeddings=nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id),
                norm=layer_norm(c))),
            layers=nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers)),
            final_norm=layer_norm(c)))
        self.head = nn.ModuleDict(dict(dense=nn.Linear(c.hidden_size, c.hidden_size, bias=False),
                                       norm=layer_norm(c)))
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size, bias=True)
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight  # tied
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self):
        """Megatron init: truncated normal at +-2 sigma, sigma = 0.02, and 0.02 / sqrt(2L) on the
        two projections that write into the residual stream; norms 1, the decoder bias 0."""
        c = self.config
        for name, p in self.named_parameters():  # the tied decoder weight: seen once
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
    def encode(self, input_ids, attention_mask=None, causal=False, doc_ids=None, all_layers=False):
        """Final hidden states (B, T, d) after final_norm; with all_layers, the L block outputs."""
        B, T = input_ids.shape
        token_mask = None if attention_mask is None else attention_mask.bool()
        attn = BACKENDS[backend_for(self, input_ids.device)](  # the fastest the device has (kernels.py)
            B, T, input_ids.device, causal, self.config.window, token_mask, doc_ids, rule=mask_rule,
            reference=reference_attention)
        emb = self.model.embeddings
        x = attn.unpad(emb.norm(emb.tok_embeddings(input_ids)))  # (B, T, d) -> backend's layout
        D = self.config.hidden_size // self.config.num_attention_heads
        ropes = {False: rope_cos_sin(attn.positions, D, self.config.global_rope_theta),
                 True: rope_cos_sin(attn.positions, D, self.config.local_rope_theta)}
        outputs = []
        for block in self.model.layers:
            x = block(x, ropes, attn)
            if all_layers:
                outputs.append(attn.repad(x))
        return outputs if all_layers else attn.repad(self.model.final_norm(x))

    def head_hidden(self, h):
        """The MLM head before the tied decoder: dense, GELU, norm."""
        return self.head.norm(F.gelu(self.head.dense(h)))

    def predict(self, h):
        """(..., d) final hidden states -> (..., vocab) logits."""
        return self.decoder(self.head_hidden(h))

    def forward(self, input_ids, attention_mask=None, labels=None, causal=False, doc_ids=None):
        """Returns (logits, loss). Without labels: logits (B, T, vocab) and loss None. With labels:
        sparse prediction, as ModernBERT trains: the head runs only on positions whose label is not
        -100, and the loss is cross_entropy's over them (computed in chunks with loss="fused"); logits is
        None. Labels may stay on the host while the model is on a GPU: no device sync finds them."""
        h = self.encode(input_ids, attention_mask, causal, doc_ids)  # (B, T, d)
        if labels is None:
            return self.predict(h), None
        keep, targets = labelled(labels, h.device)  # (M,) each: the positions with a label, and their labels
        h = self.head_hidden(h.flatten(0, 1)[keep])  # (M, d)
        loss = linear_cross_entropy if self.loss == "fused" else cross_entropy
        return None, loss(h, self.decoder.weight, self.decoder.bias, targets)

    # --- optimizer groups and FLOPs ---
    def param_groups(self):
        """(name, param) lists: 'decay' for matrices, 'no_decay' for ndim <= 1 (biases, norms)."""
        named = dict(self.named_parameters())  # named_parameters() yields a tied tensor once
        return {"decay": [(n, p) for n, p in named.items() if p.ndim >= 2],
                "no_decay": [(n, p) for n, p in named.items() if p.ndim <= 1]}

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len, causal=False, mask_rate=1.0):
        """Training FLOPs (forward + backward = 3x forward) per token, matmuls and attention. mask_rate:
        the share of positions through the head and decoder (MLM's rate; 1.0 for CLM). Keys per query:
        seq_len in a global layer (half on average when causal), 2w+1 = 129 in a local one (w+1 when
        causal) but never more than in a global one, ignoring the shorter windows at the sequence edges."""
        c = self.config
        d, w = c.hidden_size, c.window
        body = c.num_hidden_layers * (4 * d * d + 3 * d * c.intermediate_size)  # Wqkv, Wo, Wi, Wo
        head = d * d + d * c.vocab_size  # head.dense and the decoder, per predicted token
        global_keys = (seq_len + 1) / 2 if causal else seq_len
        local_keys = min(w + 1 if causal else 2 * w + 1, global_keys)  # a window past both ends sees it all
        keys = sum(global_keys if kind == "full_attention" else local_keys for kind in c.layer_types)
        return 6 * (body + mask_rate * head) + 12 * d * keys  # QK^T and PV: 2 * 2d per key, x3

    # --- checkpoints: a Hugging Face directory (config.json + model.safetensors) ---
    @classmethod
    def from_pretrained(cls, path_or_id, backend="auto", **config_overrides):
        """A Hugging Face directory or hub id; config_overrides set fields (e.g. attention_dropout)."""
        path = resolve_checkpoint(path_or_id)
        config = ModernBERTConfig.read(os.path.join(path, "config.json"))
        model = cls(config.replace(**config_overrides), backend)
        model.load_weights(os.path.join(path, "model.safetensors"))
        return model

    def load_weights(self, weights_file):
        """Weights from a model.safetensors, checked against this model's keys and shapes."""
        self.load_state_dict(read_weights(weights_file, self.state_dict()))

    def save_pretrained(self, path):
        """config.json and model.safetensors, which transformers' AutoModelForMaskedLM loads."""
        write_checkpoint(path, self.state_dict(), self.config)
