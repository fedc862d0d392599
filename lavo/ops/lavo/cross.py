"""Cross attention through the orthogonal memory (CODE): the source is compressed once, every query reads it."""
from __future__ import annotations

import torch

from ..common import check_basis, check_padding_mask, constant_scale, uses_triton, zero_padding
from .memory import memory_read, project


def code_cross_attention(q: torch.Tensor, x: torch.Tensor, basis: torch.Tensor, *,
                         padding_mask: torch.Tensor | None = None, scale: float | None = None,
                         backend: str = "auto") -> torch.Tensor:
    r"""Cross attention through the orthogonal memory: the source is compressed to ``r`` slots per head.

    Args:
        q: ``[B, Tq, H, D]`` queries.
        x: ``[B, S, H, D]`` per-head source features.
        basis: ``[H, r, D]``.
        padding_mask: ``[B, S]`` bool over the source, True for real tokens.
        backend: ``"triton"`` (the read kernel, :mod:`.gpu`), ``"torch"`` or ``"auto"`` (Triton for CUDA tensors
            when Triton 3.3+ is installed).
    Returns:
        ``[B, Tq, H, D]``.
    """
    if q.dim() != 4 or x.dim() != 4 or q.shape[0] != x.shape[0] or q.shape[2:] != x.shape[2:]:
        raise ValueError(f"q [B, Tq, H, D] and x [B, S, H, D] must agree on B, H and D, got q {tuple(q.shape)} "
                         f"and x {tuple(x.shape)}")
    if q.shape[0] == 0 or q.shape[1] == 0:  # refused as the layers refuse them (the read divided by Tq)
        raise ValueError(f"q has an empty batch or query axis, shape {tuple(q.shape)}; a call needs at least one "
                         "sequence and one query")
    B, S, H, D = x.shape
    check_basis(basis, H, D, S)
    check_padding_mask(padding_mask, B, S, axes="B, S", device=x.device)
    scale = constant_scale(scale, D)
    (x,) = zero_padding(padding_mask, x)
    if uses_triton(backend, q):
        from .gpu import code_cross_attention_triton
        return code_cross_attention_triton(q, x, basis, padding_mask=padding_mask, scale=scale)
    proj = project(x.transpose(1, 2), basis)  # [B, H, S, r]
    # the mean over real source tokens; an empty source (S = 0, or all padding) is an empty memory: zeros
    if padding_mask is None:
        count = torch.tensor(float(S), dtype=proj.dtype, device=proj.device)
    else:
        proj = proj * padding_mask[:, None, :, None].to(proj.dtype)
        count = padding_mask.sum(1).to(proj.dtype)[:, None, None, None]
    coefficients = proj.sum(2, keepdim=True) / count.clamp(min=1)
    return memory_read(q.transpose(1, 2), coefficients, basis, scale).transpose(1, 2)
