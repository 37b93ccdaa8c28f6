"""A test double for `flash_attn.flash_attn_varlen_func`: plain PyTorch, one sequence at a time, written from
flash-attn's documented semantics (flash_attn_interface.py docstrings, flash-attn 2.x), not from its kernels:

- q, k, v are (total, nheads, headdim): the sequences of the batch concatenated without padding;
  cu_seqlens_q / cu_seqlens_k (batch + 1,) int32 are their cumulative lengths, starting at 0;
  max_seqlen_q / max_seqlen_k are ints no smaller than any sequence's length.
- softmax(Q K^T * softmax_scale) V, softmax_scale defaulting to headdim ** -0.5.
- causal=True: the mask is aligned to the bottom-right corner of the (seqlen_q, seqlen_k) matrix.
- window_size=(left, right): if not (-1, -1), query i attends only to keys in
  [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right] inclusive; -1 means unbounded on that side.
- a query row whose mask is all zero outputs zeros.
- dropout_p: dropout on the attention probabilities.

It accepts fp32 as well as bf16/fp16, so the flash backend can be compared with SDPA at fp32 precision on a
CPU (the real kernel only takes fp16/bf16 on CUDA; that check stays in model.py for CUDA tensors)."""
import torch
import torch.nn.functional as F

calls = []  # (causal, window_size, n_sequences) per call, so tests can see what the model asked for


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), **unsupported):
    assert not unsupported, f"the double does not implement {sorted(unsupported)}"
    assert q.ndim == k.ndim == v.ndim == 3 and q.shape[1:] == k.shape[1:], (q.shape, k.shape)
    for cu, total, longest in ((cu_seqlens_q, q.shape[0], max_seqlen_q), (cu_seqlens_k, k.shape[0], max_seqlen_k)):
        assert cu.dtype == torch.int32 and cu.ndim == 1 and int(cu[0]) == 0 and int(cu[-1]) == total, cu
        lengths = cu.diff()
        assert (lengths >= 0).all() and isinstance(longest, int) and int(lengths.max()) <= longest
    assert len(window_size) == 2 and all(isinstance(w, int) and w >= -1 for w in window_size), window_size
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    calls.append((causal, tuple(window_size), len(cu_seqlens_q) - 1))
    out = []
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = (int(t) for t in (cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]))
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
        p = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)  # empty rows -> zeros
        p = F.dropout(p, dropout_p) if dropout_p > 0 else p
        out.append(torch.einsum("hqk,khd->qhd", p, v[ks:ke].float()).to(q.dtype))
    return torch.cat(out) if out else q.new_zeros(q.shape)
