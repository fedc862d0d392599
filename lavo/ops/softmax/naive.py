r"""Softmax attention written out, with rotary position embedding as explicit rotation matrices: the reference of
:mod:`.sdpa` and :mod:`.rotary`. Quadratic; small inputs only."""
from __future__ import annotations

import math

import torch


def rotation_matrix(position: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    r"""RoPE (Su et al., 2021) at one position: the ``[D, D]`` block-diagonal matrix that rotates feature pair
    ``(2i, 2i + 1)`` by ``position * base ** (-2i / D)``, built pair by pair (float64)."""
    r = torch.zeros(dim, dim, dtype=torch.float64)
    for i in range(dim // 2):
        angle = position * base ** (-2 * i / dim)
        c, s = math.cos(angle), math.sin(angle)
        r[2 * i, 2 * i], r[2 * i, 2 * i + 1] = c, -s
        r[2 * i + 1, 2 * i], r[2 * i + 1, 2 * i + 1] = s, c
    return r


def softmax_attention_naive(q, k, v, *, causal, padding_mask=None, rotary_start=None):
    r"""``softmax(q k^T / sqrt(D)) v`` over the real keys (and, causal, the keys up to the query).

    Args:
        q, k, v: ``[B, T, H, D]``.
        padding_mask: ``[B, T]`` bool, True for real tokens; padded queries and queries without a key give zeros.
        rotary_start: rotate ``q`` and ``k`` at position ``rotary_start + t`` by :func:`rotation_matrix` first.
    Returns:
        ``[B, T, H, D]``.
    """
    B, T, H, D = q.shape
    mask = torch.ones(B, T, dtype=torch.bool) if padding_mask is None else padding_mask
    if rotary_start is not None:
        rot = torch.stack([rotation_matrix(rotary_start + t, D) for t in range(T)])  # [T, D, D]
        q, k = (torch.einsum("tij,bthj->bthi", rot, x) for x in (q, k))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    allowed = mask[:, None, None, :].expand(B, 1, T, T)
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool).tril()
    weights = torch.nan_to_num(scores.masked_fill(~allowed, float("-inf")).softmax(-1))
    return torch.einsum("bhqk,bkhd->bqhd", weights, v) * mask[:, :, None, None]
