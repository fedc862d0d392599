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
