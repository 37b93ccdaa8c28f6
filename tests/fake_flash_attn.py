"""Test doubles of the flash backend's two kernels, plain PyTorch, one sequence at a time. `flash_attn_varlen_func`,
written from flash-attn's documented semantics (flash_attn_interface.py docstrings, flash-attn 2.x), not from its kernels:

- q, k, v are (total, nheads, headdim): the sequences of the batch concatenated without padding;
  cu_seqlens_q / cu_seqlens_k (batch + 1,) int32 are their cumulative lengths, starting at 0;
  max_seqlen_q / max_seqlen_k are ints no smaller than any sequence's length.
- softmax(Q K^T * softmax_scale) V, softmax_scale defaulting to headdim ** -0.5.
- causal=True: the mask is aligned to the bottom-right corner of the (seqlen_q, seqlen_k) matrix.
- window_size=(left, right): if not (-1, -1), query i attends only to keys in
  [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right] inclusive; -1 means unbounded on that side.
- a query row whose mask is all zero outputs zeros.
- dropout_p: dropout on the attention probabilities.
- deterministic: whether the backward adds up dQ in a fixed order (the double always does).

It accepts fp32 as well as bf16/fp16, so the flash backend can be compared with SDPA at fp32 precision on a
CPU (the real kernel only takes fp16/bf16 on CUDA; machinery/kernels.py keeps that check for CUDA tensors).

`varlen_attn` below doubles PyTorch's own `torch.nn.attention.varlen.varlen_attn` (PyTorch >= 2.11), from its
docstring: the same layout and cumulative lengths, `scale` defaulting to headdim ** -0.5, and no causal flag:
window_size=(left, right) as above, (-1, -1) full attention, (-1, 0) causal, (W, 0) causal with W keys behind."""
import torch
import torch.nn.functional as F

calls = []  # (causal, window_size, n_sequences) per call, so tests can see what the model asked for (causal None:
# PyTorch's kernel, which has no such flag)
determinism = []  # the deterministic argument of each call to flash-attn's


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
                           **unsupported):
    assert not unsupported, f"the double does not implement {sorted(unsupported)}"
    check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    calls.append((causal, tuple(window_size), len(cu_seqlens_q) - 1))
    determinism.append(deterministic)
    args = (cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), dropout_p, scale, causal, tuple(window_size))
    return _Varlen.apply(q, k, v, args)


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), **unsupported):
    assert not unsupported and return_aux is None, f"the double does not implement {sorted(unsupported)}"
    assert isinstance(window_size, tuple), "PyTorch tells causal attention by window_size == (-1, 0): a tuple"
    check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    calls.append((None, window_size, len(cu_seq_q) - 1))
    return _Varlen.apply(query, key, value, (cu_seq_q.tolist(), cu_seq_k.tolist(), 0.0, scale, False, window_size))


def check(q, k, v, cu_q, cu_k, max_q, max_k, window_size):
    """What both kernels require of their arguments."""
    assert q.ndim == k.ndim == v.ndim == 3 and q.shape[1:] == k.shape[1:], (q.shape, k.shape)
    for cu, total, longest in ((cu_q, q.shape[0], max_q), (cu_k, k.shape[0], max_k)):
        assert cu.dtype == torch.int32 and cu.ndim == 1 and int(cu[0]) == 0 and int(cu[-1]) == total, cu
        lengths = cu.diff()
        assert (lengths >= 0).all() and isinstance(longest, int) and int(lengths.max()) <= longest
    assert len(window_size) == 2 and all(isinstance(w, int) and w >= -1 for w in window_size), window_size


class _Varlen(torch.autograd.Function):
    """Keeps for backward what flash-attn keeps (q, k, v, the output, the fp32 log-sum-exp per row and head, the
    RNG state) and recomputes the rest there, so that memory measured through it is flash-attn's."""

    @staticmethod
    def forward(ctx, q, k, v, args):
        rng = torch.get_rng_state()
        with torch.no_grad():
            out, lse = attention(q, k, v, *args)
        ctx.args, ctx.rng = args, rng
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad(), torch.random.fork_rng():
            torch.set_rng_state(ctx.rng)  # the same dropout mask as the forward
            out, _ = attention(q, k, v, *ctx.args)
        return (*torch.autograd.grad(out, (q, k, v), grad), None)


def attention(q, k, v, cu_q, cu_k, dropout_p, scale, causal, window_size):
    """The reference, sequence by sequence: (out (total_q, H, D) in q's dtype, lse (H, total_q) fp32)."""
    out, lse = [], []
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        lq, lk = qe - qs, ke - ks
        i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # bottom-right aligned query index
        j = torch.arange(lk, device=q.device)[None, :]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            keep &= j <= i
        left, right = window_size
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k[ks:ke].float()) * scale
        scores = scores.masked_fill(~keep, float("-inf"))
        p = scores.softmax(-1).nan_to_num(0.0)  # a row with nothing to see outputs zeros
        p = F.dropout(p, dropout_p) if dropout_p > 0 else p
        out.append(torch.einsum("hqk,khd->qhd", p, v[ks:ke].float()).to(q.dtype))
        lse.append(scores.logsumexp(-1))
    if not out:
        return q.new_zeros(q.shape), q.new_zeros(q.shape[1], 0, dtype=torch.float32)
    return torch.cat(out), torch.cat(lse, -1)
