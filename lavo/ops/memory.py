"""The orthogonal memory (CODE): compress features onto an orthonormal basis, read with a softmax over slots.

With basis rows ``b_1..b_r`` and coefficients ``H`` (a mean of ``B f`` over the context), memory slot ``i`` is
``H_i b_i``: it is both key and value. A query reads ``o = sum_i softmax_i(scale H_i (B q)_i) H_i b_i``, which
never materialises the ``[r, D]`` memory per token. Functions here take head-major tensors ``[..., H, L, D]``;
coefficients are at least float32 whatever the input dtype (a float16 running sum overflows past ~65K tokens).
"""
from __future__ import annotations

import torch

from .checks import check_basis, check_padding_mask


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    r"""Coordinates on the basis: ``x [..., H, L, D]``, ``basis [H, r, D]`` -> ``[..., H, L, r]``, at least float32."""
    return (x @ basis.to(x.dtype).transpose(-1, -2)).to(accumulation_dtype(x.dtype))


def memory_read(q: torch.Tensor, coefficients: torch.Tensor, basis: torch.Tensor, scale: float) -> torch.Tensor:
    r"""Read the memory ``diag(H) B``.

    Args:
        q: ``[..., H, L, D]`` queries.
        coefficients: broadcastable to ``[..., H, L, r]`` (``L = 1`` for one memory shared by all queries).
        basis: ``[H, r, D]``.
    Returns:
        ``[..., H, L, D]`` in ``q``'s dtype.
    """
    weights = (coefficients * scale * project(q, basis)).softmax(-1)
    return ((weights * coefficients) @ basis.to(coefficients.dtype)).to(q.dtype)


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
    proj = project(x.transpose(1, 2), basis)  # [B, H, S, r]
    if padding_mask is None:
        coefficients = proj.mean(2, keepdim=True)
    else:
        real = padding_mask[:, None, :, None].to(proj.dtype)
        coefficients = (proj * real).sum(2, keepdim=True) / real.sum(2, keepdim=True).clamp(min=1)
    return memory_read(q.transpose(1, 2), coefficients, basis, scale).transpose(1, 2)
