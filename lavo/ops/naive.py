"""Token-by-token references of the LAVO ops: the spec written as loops, for tests. Quadratic; small inputs only."""
from __future__ import annotations

import torch


def _local_naive(q, k, v, window, causal, pos_bias, mask, scale):
    B, T, H, D = q.shape
    out = torch.zeros_like(q)
    for t in range(T):
        c = t // window
        lo = max(0, (c - 1) * window)
        hi = t + 1 if causal else min(T, (c + 2) * window)
        j = torch.arange(lo, hi)
        scores = torch.einsum("bhd,bjhd->bhj", q[:, t], k[:, lo:hi]) * scale
        if pos_bias is not None:
            index = t - j if causal else j - t + 2 * window - 1
            scores = scores + pos_bias[:, index]
        valid = mask[:, None, lo:hi]
        any_valid = valid.any(-1, keepdim=True)
        scores = torch.where(any_valid, scores.masked_fill(~valid, float("-inf")), 0.0)
        weights = scores.softmax(-1) * any_valid
        out[:, t] = torch.einsum("bhj,bjhd->bhd", weights, v[:, lo:hi])
    return out


def _read_naive(q_t, coefficients, basis, scale):
    """One query per batch and head: q_t [B, H, D], coefficients [B, H, r]."""
    memory = coefficients[..., None] * basis  # [B, H, r, D]: slot i is H_i b_i
    weights = (scale * torch.einsum("bhd,bhrd->bhr", q_t, basis.expand_as(memory)) * coefficients).softmax(-1)
    return torch.einsum("bhr,bhrd->bhd", weights, memory)


def _mean_naive(features, basis, mask, selected):
    """Mean of B f_j over real positions j in ``selected`` ([T] bool); zero when there are none."""
    keep = mask & selected[None, :]
    proj = torch.einsum("bjhd,hrd->bjhr", features, basis) * keep[:, :, None, None]
    return proj.sum(1) / keep.sum(1).clamp(min=1)[:, None, None]


def lavo_attention_naive(q, k, v, basis, *, window, causal=True, pos_bias=None, dissection=True, padding_mask=None,
                         scale=None):
    """Reference for :func:`lavo.ops.lavo_attention`, one query at a time. Shapes as there."""
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    mask = torch.ones(B, T, dtype=torch.bool) if padding_mask is None else padding_mask
    local = _local_naive(q, k, v, window, causal, pos_bias, mask, scale)
    features = local if dissection else v
    positions = torch.arange(T)
    out = torch.zeros_like(q)
    for t in range(T):
        if not causal:
            selected = torch.ones(T, dtype=torch.bool)
        elif dissection:
            selected = positions < (t // window) * window
        else:
            selected = positions <= t
        coefficients = _mean_naive(features, basis, mask, selected)
        out[:, t] = (local[:, t] + _read_naive(q[:, t], coefficients, basis, scale)) / 2
    return out * mask[:, :, None, None]


def local_attention_naive(q, k, v, *, window, causal=True, pos_bias=None, padding_mask=None, scale=None):
    """Reference for :func:`lavo.ops.local_attention`."""
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    mask = torch.ones(B, T, dtype=torch.bool) if padding_mask is None else padding_mask
    return _local_naive(q, k, v, window, causal, pos_bias, mask, scale) * mask[:, :, None, None]


def code_cross_attention_naive(q, x, basis, *, padding_mask=None, scale=None):
    """Reference for :func:`lavo.ops.code_cross_attention`."""
    B, S, H, D = x.shape
    scale = D ** -0.5 if scale is None else scale
    mask = torch.ones(B, S, dtype=torch.bool) if padding_mask is None else padding_mask
    coefficients = _mean_naive(x, basis, mask, torch.ones(S, dtype=torch.bool))
    return torch.stack([_read_naive(q[:, t], coefficients, basis, scale) for t in range(q.shape[1])], 1)
