r"""Sliding-window attention as the paper states it, one query at a time: the reference of :mod:`.blocked` and
:mod:`.decoding`. Quadratic in the length; small inputs only.

This is LAVO's local branch (Zhang et al., 2023, §3.2 context dissection) with the relative-position bias embedded
in its scores (§3.3). Windows have length ``w`` and are counted from position 0; query ``t`` lies in window
``c = t // w``. A causal query sees keys ``j`` in ``[(c - 1) w, t]``, a non-causal one the previous, its own and
the next window, clipped to the sequence. The bias of key ``j`` is ``P[h, t - j]`` (causal, ``P [H, 2w]``) or
``P[h, j - t + 2w - 1]`` (non-causal, ``P [H, 4w - 1]``).
"""
from __future__ import annotations

import torch

from ..common import zero_padding


def local_attention_naive(q, k, v, *, window, causal=True, pos_bias=None, padding_mask=None, scale=None):
    r"""Reference for :func:`lavo.ops.local_attention`: ``softmax_j(scale q_t . k_j + P) v_j`` over the window.

    Args:
        q, k, v: ``[B, T, H, D]``.
        pos_bias: ``P``, ``[H, 2w]`` causal or ``[H, 4w - 1]`` non-causal, or None.
        padding_mask: ``[B, T]`` bool, True for real tokens; padded keys are never seen.
    Returns:
        ``[B, T, H, D]``: zeros at padded queries and at queries without a real key in their window.
    """
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    real = torch.ones(B, T, dtype=torch.bool) if padding_mask is None else padding_mask
    q, k, v = zero_padding(real, q, k, v)
    out = torch.zeros_like(q)
    for t in range(T):
        c = t // window
        lo = max(0, (c - 1) * window)
        hi = t + 1 if causal else min(T, (c + 2) * window)
        j = torch.arange(lo, hi)
        scores = torch.einsum("bhd,bjhd->bhj", q[:, t], k[:, lo:hi]) * scale
        if pos_bias is not None:
            scores = scores + pos_bias[:, t - j if causal else j - t + 2 * window - 1]
        valid = real[:, None, lo:hi]
        any_valid = valid.any(-1, keepdim=True)
        scores = torch.where(any_valid, scores.masked_fill(~valid, float("-inf")), 0.0)
        out[:, t] = torch.einsum("bhj,bjhd->bhd", scores.softmax(-1) * any_valid, v[:, lo:hi])
    return out * real[:, :, None, None]
