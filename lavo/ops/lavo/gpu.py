r"""LAVO on the GPU: the Triton window kernel and the Triton memory read, joined by a few whole-tensor torch ops
(no loop over windows). The form :func:`.blocked.lavo_attention` and :func:`.cross.code_cross_attention` take
with ``backend="triton"`` (and ``"auto"`` on CUDA).

What stays in torch is small and linear: the per-window sums of the features (float32), their projection onto the
basis (``[B, H, n, r]``), the exclusive prefix over windows and the division by the counts. Without context
dissection the coefficients are per token (``[B, H, T, r]``): a running sum inside each window on top of the
prefix over earlier windows.
"""
from __future__ import annotations

import torch

from ..common import accumulation_dtype, exclusive_cumsum, zero_padding
from ..local.kernels import window_attention
from .blocked import cache_after
from .kernels import read_memory
from .memory import project


def _windows(x: torch.Tensor, window: int) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[B, n, w, ...]``, zero-padded to whole windows (a view when ``T`` is a multiple)."""
    pad = -x.shape[1] % window
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], 1)
    return x.unflatten(1, (-1, window))


def window_sums(features: torch.Tensor, real: torch.Tensor | None, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Sums of the real tokens' features per window, float32 (or float64): ``[B, T, H, D]`` -> ``[B, H, n, D]``,
    and the counts of real tokens ``[B, n]``."""
    acc = accumulation_dtype(features.dtype)
    if real is not None:
        features = features * real[:, :, None, None].to(features.dtype)
        counts = _windows(real.to(acc), window).sum(2)
    else:
        counts = _windows(features.new_ones(features.shape[:2], dtype=acc), window).sum(2)
    return _windows(features, window).sum(2, dtype=acc).transpose(1, 2), counts


def _coefficients(q, v, basis, window_proj, counts, real, window, causal, dissection):
    """The coefficient rows and how many consecutive queries share each (see :func:`.kernels.read_memory`)."""
    T = q.shape[1]
    if not causal:
        return window_proj.sum(2, keepdim=True) / counts.sum(1).clamp(min=1)[:, None, None, None], T
    earlier = exclusive_cumsum(window_proj, 2)  # [B, H, n, r]: sums over the whole windows before each
    earlier_count = exclusive_cumsum(counts, 1)  # [B, n]
    if dissection:
        return earlier / earlier_count.clamp(min=1)[:, None, :, None], window
    acc = window_proj.dtype
    values = v if real is None else v * real[:, :, None, None].to(v.dtype)
    proj = project(values.transpose(1, 2), basis).transpose(1, 2)  # [B, T, H, r], float32 for 16-bit values
    running = _windows(proj, window).cumsum(2) + earlier.permute(0, 2, 1, 3)[:, :, None]  # [B, n, w, H, r]
    ones = torch.ones(q.shape[:2], dtype=acc, device=q.device) if real is None else real.to(acc)
    seen = _windows(ones, window).cumsum(2) + earlier_count[:, :, None]  # [B, n, w]
    coefficients = (running / seen.clamp(min=1)[..., None, None]).flatten(1, 2)[:, :T]
    return coefficients.permute(0, 2, 1, 3), 1


def lavo_attention_triton(q, k, v, basis, *, window, causal, pos_bias, dissection, padding_mask, scale,
                          return_cache):
    r""":func:`.blocked.lavo_attention` (arguments checked there) on the Triton kernels."""
    local = window_attention(q, k, v, window=window, causal=causal, pos_bias=pos_bias, padding_mask=padding_mask,
                             scale=scale)
    with torch.autocast(q.device.type, enabled=False):  # sums and prefixes stay float32 under autocast too
        sums, counts = window_sums(local if dissection else v, padding_mask, window)
        window_proj = sums @ basis.to(sums.dtype).transpose(-1, -2)  # [B, H, n, r]: projection is linear
        coefficients, group = _coefficients(q, v, basis, window_proj, counts, padding_mask, window, causal,
                                            dissection)
    (out,) = zero_padding(padding_mask, (local + read_memory(q, coefficients, basis, scale, group)) * 0.5)
    if not return_cache:
        return out
    return out, cache_after(k, v, padding_mask, window_proj, counts, window, dissection)


def code_cross_attention_triton(q, x, basis, *, padding_mask, scale):
    r""":func:`.cross.code_cross_attention` (arguments checked there) with the Triton read: one coefficient row,
    the projection of the mean of the real source features."""
    with torch.autocast(q.device.type, enabled=False):
        sums, counts = window_sums(x, padding_mask, x.shape[1])  # one window: the whole source
        coefficients = sums @ basis.to(sums.dtype).transpose(-1, -2) / counts.clamp(min=1)[:, None, :, None]
    # a source of another dtype (float64, say) is read at the queries' precision, the one the kernels compute in
    return read_memory(q, coefficients.to(accumulation_dtype(q.dtype)), basis, scale, q.shape[1])
