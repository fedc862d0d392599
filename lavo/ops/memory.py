"""The orthogonal memory (CODE): compress features onto an orthonormal basis, read with a softmax over slots.

With basis rows ``b_1..b_r`` and coefficients ``H`` (a mean of ``B f`` over the context), memory slot ``i`` is
``H_i b_i``: it is both key and value. A query reads ``o = sum_i softmax_i(scale H_i (B q)_i) H_i b_i``, which
never materialises the ``[r, D]`` memory per token. Coefficients are at least float32 whatever the input dtype:
a float16 running sum overflows past ~65K tokens.
"""
from __future__ import annotations

import torch

from .checks import check_basis, check_padding_mask


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    r"""Coordinates of ``x`` on the basis. ``x [B, T, H, D]``, ``basis [H, r, D]`` -> ``[B, T, H, r]``, at least
    float32."""
    return torch.einsum("bthd,hrd->bthr", x, basis.to(x.dtype)).to(accumulation_dtype(x.dtype))


def memory_read(q: torch.Tensor, coefficients: torch.Tensor, basis: torch.Tensor, scale: float) -> torch.Tensor:
    r"""Read the memory ``diag(H) B`` with queries.

    Args:
        q: ``[B, T, H, D]``.
        coefficients: ``[B, T, H, r]`` (or ``[B, 1, H, r]`` for one memory shared by all queries), from
            :func:`project` sums.
        basis: ``[H, r, D]``.
    Returns:
        ``[B, T, H, D]`` in ``q``'s dtype.
    """
    weights = (scale * coefficients * project(q, basis)).softmax(-1)
    return torch.einsum("bthr,hrd->bthd", weights * coefficients, basis.to(coefficients.dtype)).to(q.dtype)


def masked_projection(features: torch.Tensor, basis: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """``project`` with padded positions zeroed, so sums over time skip them."""
    proj = project(features, basis)
    return proj if padding_mask is None else proj * padding_mask[:, :, None, None]


def token_counts(padding_mask: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """``[B, T]`` float32: 1 for real tokens, 0 for padding. Exact up to 2**24 tokens."""
    if padding_mask is None:
        return torch.ones(batch, length, device=device)
    return padding_mask.float()


def causal_coefficients(proj: torch.Tensor, counts: torch.Tensor, *, window: int, dissection: bool) -> torch.Tensor:
    r"""Running-mean coefficients for each query.

    Args:
        proj: ``[B, T, H, r]`` projections from :func:`project` (zero at padding).
        counts: ``[B, T]`` float32 (1 real, 0 padding).
    Returns:
        ``[B, T, H, r]``: with ``dissection``, the mean over whole windows before the query's window (zero in the
        first); without, the mean over tokens up to and including the query.
    """
    if not dissection:
        return proj.cumsum(1) / counts.cumsum(1).clamp(min=1)[:, :, None, None]
    B, T = counts.shape
    n = -(-T // window)
    pad = n * window - T
    block_sum = torch.nn.functional.pad(proj, (0, 0, 0, 0, 0, pad)).unflatten(1, (n, window)).sum(2)
    block_count = torch.nn.functional.pad(counts, (0, pad)).view(B, n, window).sum(2)
    earlier_sum = block_sum.cumsum(1) - block_sum
    earlier_count = block_count.cumsum(1) - block_count
    coefficients = earlier_sum / earlier_count.clamp(min=1)[:, :, None, None]
    return coefficients.repeat_interleave(window, dim=1)[:, :T]


def code_cross_attention(q: torch.Tensor, x: torch.Tensor, basis: torch.Tensor, *,
                         padding_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    r"""Cross attention through the orthogonal memory: the source is compressed to ``r`` slots per head.

    Args:
        q: ``[B, Tq, H, D]`` queries.
        x: ``[B, S, H, D]`` per-head source features.
        basis: ``[H, r, D]``.
        padding_mask: ``[B, S]`` bool over the source, True for real tokens.
    Returns:
        ``[B, Tq, H, D]``.
    """
    if q.dim() != 4 or x.dim() != 4 or q.shape[0] != x.shape[0] or q.shape[2:] != x.shape[2:]:
        raise ValueError(f"q [B, Tq, H, D] and x [B, S, H, D] must agree on B, H and D, got q {tuple(q.shape)} "
                         f"and x {tuple(x.shape)}")
    B, S, H, D = x.shape
    check_basis(basis, H, D)
    check_padding_mask(padding_mask, B, S)
    scale = D ** -0.5 if scale is None else scale
    proj = masked_projection(x, basis, padding_mask)
    count = token_counts(padding_mask, B, S, x.device).sum(1).clamp(min=1)
    coefficients = proj.sum(1, keepdim=True) / count[:, None, None, None]
    return memory_read(q, coefficients, basis, scale)
