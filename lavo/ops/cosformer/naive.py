r"""cosFormer with the explicit weights ``relu(q) relu(k)^T cos(pi/2 (i - j) / M)``: the reference of
:mod:`.features`. Quadratic; small inputs only."""
from __future__ import annotations

import math

import torch

from .features import EPS


def cosformer_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                              max_length: int | None = None,
                              padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: explicit weights ``relu(q) relu(k)^T cos(pi/2 (i - j) / M)`` (``M = max_length`` when causal,
    else one past the sequence's last real token)."""
    length = q.shape[1]
    position = torch.arange(length, device=q.device, dtype=q.dtype)
    distance = position[:, None] - position[None, :]
    if causal:
        horizon = max_length
    elif padding_mask is None:
        horizon = length
    else:  # [B, 1, 1, 1] against the weights [B, H, T, T]
        last = torch.where(padding_mask, position, torch.zeros_like(position)).amax(1)
        horizon = (last + 1)[:, None, None, None]
    weights = torch.einsum("bthd,bshd->bhts", torch.relu(q), torch.relu(k))
    weights = weights * torch.cos(math.pi / 2 * distance / horizon)
    if padding_mask is not None:
        weights = weights * padding_mask[:, None, None, :]
    if causal:
        weights = weights.tril()
    out = torch.einsum("bhts,bshd->bthd", weights, v)
    return out / weights.sum(-1).transpose(1, 2).clamp(min=EPS)[..., None]


def cosformer_cross_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                    padding_mask: torch.Tensor | None = None,
                                    query_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for :func:`cosformer_cross_attention`: explicit weights
    ``relu(q_i) . relu(k_j) cos(pi/2 (i / m - j / n))`` between the real queries and the real source tokens
    (``i`` and ``j`` count real ones, ``m`` and ``n`` their numbers), one batch element at a time; zeros at
    padded queries."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        real = torch.ones(k.shape[1], dtype=torch.bool) if padding_mask is None else padding_mask[b]
        asking = torch.ones(q.shape[1], dtype=torch.bool) if query_padding_mask is None else query_padding_mask[b]
        queries, keys, values = q[b, asking], k[b, real], v[b, real]  # [m, H, D], [n, H, D]
        query_place = torch.arange(queries.shape[0], dtype=q.dtype) / max(1, queries.shape[0])
        key_place = torch.arange(keys.shape[0], dtype=q.dtype) / max(1, keys.shape[0])
        weights = torch.einsum("thd,shd->hts", torch.relu(queries), torch.relu(keys))
        weights = weights * torch.cos(math.pi / 2 * (query_place[:, None] - key_place[None, :]))
        read = torch.einsum("hts,shd->thd", weights, values)
        out[b, asking] = read / weights.sum(-1).transpose(0, 1).clamp(min=EPS)[..., None]
    return out
