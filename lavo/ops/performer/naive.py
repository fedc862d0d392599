r"""FAVOR+ with the explicit ``[T, S]`` weights of the unstabilised features: the reference of :mod:`.features`.
Quadratic; small inputs only."""
from __future__ import annotations

import torch

from ..feature_attention import feature_attention_naive
from .features import favor_exponents, key_exponents, tiny


def performer_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *,
                              causal: bool, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: explicit weights ``phi(q) phi(k)^T`` from the unstabilised features."""
    k_feat = key_exponents(k, projection, padding_mask).exp()
    return feature_attention_naive(favor_exponents(q, projection).exp(), k_feat, v, causal=causal, eps=tiny(v))
