r"""ABC with learned control as the paper states it, one query at a time: the reference of :mod:`.chunked`.

Slot ``s`` of the memory holds ``sum_i alpha_{i,s} k_i`` and ``sum_i alpha_{i,s} v_i``, with ``alpha`` a softmax
over time of the control logits ``a_i = W_phi k_i``; a query reads ``softmax(q K~^T / sqrt(D)) V~``. Quadratic;
small inputs only.
"""
from __future__ import annotations

import torch


def abc_attention_naive(q, k, v, control, *, causal=True, padding_mask=None, scale=None):
    """Reference for :func:`abc_attention`, one query at a time with an explicit softmax over time per slot."""
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    mask = torch.ones(B, T, dtype=torch.bool) if padding_mask is None else padding_mask
    logits = torch.einsum("bthd,hrd->bthr", k, control)
    out = torch.zeros_like(q)
    for t in range(T):
        seen = slice(0, t + 1 if causal else T)
        alpha = logits[:, seen].masked_fill(~mask[:, seen, None, None], float("-inf")).softmax(1)  # over time
        alpha = torch.nan_to_num(alpha)  # no real token yet
        memory_k, memory_v = (torch.einsum("bihr,bihd->bhrd", alpha, x[:, seen]) for x in (k, v))
        weights = torch.einsum("bhd,bhrd->bhr", q[:, t] * scale, memory_k).softmax(-1)
        out[:, t] = torch.einsum("bhr,bhrd->bhd", weights, memory_v) * mask[:, t, None, None]
    return out


def abc_cross_attention_naive(q, k, v, control, *, padding_mask=None, scale=None):
    """Reference for :func:`abc_cross_attention`: ``q [B, Tq, H, D]`` reads the memory written from every real
    token of ``k, v [B, S, H, D]``, with an explicit softmax over the source per slot."""
    B, S, H, D = k.shape
    scale = D ** -0.5 if scale is None else scale
    mask = torch.ones(B, S, dtype=torch.bool) if padding_mask is None else padding_mask
    logits = torch.einsum("bshd,hrd->bshr", k, control)
    alpha = torch.nan_to_num(logits.masked_fill(~mask[:, :, None, None], float("-inf")).softmax(1))
    memory_k, memory_v = (torch.einsum("bshr,bshd->bhrd", alpha, x) for x in (k, v))
    weights = torch.einsum("bthd,bhrd->bthr", q * scale, memory_k).softmax(-1)
    return torch.einsum("bthr,bhrd->bthd", weights, memory_v)
