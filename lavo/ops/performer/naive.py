r"""FAVOR+ with the explicit ``[T, S]`` weights of the unstabilised features, written from the paper: the reference
of :mod:`.features`, sharing none of its helpers; and the same weights in log space, the reference on heads so
sharp that the features themselves underflow. Quadratic; small inputs only."""
from __future__ import annotations

import torch


def positive_random_features(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    r"""The paper's positive features ``phi(x)_f = exp(w_f . x' - |x'|^2 / 2)`` with ``x' = x / D^(1/4)``, one
    feature at a time: ``x [B, T, H, D]``, ``projection [F, D]`` -> ``[B, T, H, F]``."""
    scaled = x / x.shape[-1] ** 0.25
    half_norm = (scaled * scaled).sum(-1) / 2
    return torch.stack([torch.exp((scaled * w).sum(-1) - half_norm) for w in projection.to(x.dtype)], -1)


def performer_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *,
                              causal: bool, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: weights ``phi(q_t) . phi(k_s)`` over the real keys (up to ``t`` when causal), normalised by
    their sum, clamped at the smallest positive normal number."""
    T, S = q.shape[1], k.shape[1]
    weights = torch.einsum("bthf,bshf->bhts", positive_random_features(q, projection),
                           positive_random_features(k, projection))
    if padding_mask is not None:
        weights = weights * padding_mask[:, None, None, :].to(weights.dtype)
    if causal:
        weights = weights * torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    total = weights.sum(-1).clamp(min=torch.finfo(v.dtype).tiny)
    return torch.einsum("bhts,bshd->bthd", weights, v) / total.transpose(1, 2)[..., None]


def performer_attention_log_space(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *,
                                  causal: bool, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The weights of :func:`performer_attention_naive` from their logarithms, ``log sum_f phi(q_t)_f phi(k_s)_f``,
    normalised by a softmax over the real keys: exact however sharp the head, where the explicit features fall
    below float32's range once their exponents pass about -87 (float64's, -708). A query with no real key reads
    zeros."""
    def log_features(x):  # log phi(x) [B, T, H, F]
        scaled = x / x.shape[-1] ** 0.25
        return scaled @ projection.to(x.dtype).T - (scaled * scaled).sum(-1, keepdim=True) / 2
    log_weights = torch.logsumexp(log_features(q)[:, :, None] + log_features(k)[:, None], -1)  # [B, T, S, H]
    visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device)
    visible = (visible.tril() if causal else visible)[None, :, :, None]
    if padding_mask is not None:
        visible = visible & padding_mask[:, None, :, None]
    weights = log_weights.masked_fill(~visible, -torch.inf).softmax(2).nan_to_num()
    return torch.einsum("btsh,bshd->bthd", weights, v)
