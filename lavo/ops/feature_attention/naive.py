r"""Attention through positive feature maps with the explicit ``[T, S]`` weights ``phi(q) phi(k)^T``: the
reference of :mod:`.prefix_sums`. Quadratic; small inputs only."""
from __future__ import annotations

import torch

from ..common import normalize


def feature_attention_naive(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor, *, causal: bool,
                            eps: float) -> torch.Tensor:
    """Reference: the explicit ``[T, S]`` weights ``phi(q) phi(k)^T``, lower-triangular when causal."""
    weights = torch.einsum("bthf,bshf->bhts", q_feat, k_feat)
    if causal:
        weights = weights.tril()
    out = torch.einsum("bhts,bshd->bthd", weights, v)
    return normalize(out, weights.sum(-1).transpose(1, 2), eps)
