"""Rotary position embedding (RoPE, Su et al. 2021): rotate pairs of features by an angle that grows with position."""
from __future__ import annotations

import torch
from einops import rearrange

from ..common import accumulation_dtype


def rotary_angles(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    r"""Angles ``positions[t] * base ** (-2i / dim)``.

    Args:
        positions: ``[T]`` absolute positions.
        dim: the (even) feature dimension ``D``.
    Returns:
        ``[T, D / 2]`` float64 angles; pair ``i`` is features ``2i`` and ``2i + 1``.
    """
    frequencies = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    return positions.to(torch.float64)[:, None] * frequencies


def apply_rotary(x: torch.Tensor, start: int = 0, base: float = 10000.0) -> torch.Tensor:
    r"""Rotate each feature pair ``(x[2i], x[2i+1])`` of the token at position ``p`` by ``p * base ** (-2i / D)``.

    Args:
        x: ``[B, T, H, D]`` with even ``D``, tokens at absolute positions ``start .. start + T - 1``.
    Returns:
        ``[B, T, H, D]`` in ``x``'s dtype; dot products of rotated queries and keys depend only on their relative
        position. 16-bit inputs are rotated in float32 and rounded once (the cosines, the sines and each product
        rounded to 16 bits put features many roundings off where the two products cancel).
    """
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"rotary embedding needs an even head dimension, got {D}")
    wide = accumulation_dtype(x.dtype)
    angles = rotary_angles(torch.arange(start, start + x.shape[1], device=x.device), D, base)
    cos, sin = (f(angles).to(wide)[:, None, :] for f in (torch.cos, torch.sin))  # [T, 1, D/2]
    even, odd = rearrange(x.to(wide), "b t h (i two) -> two b t h i", two=2)
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos])
    return rearrange(rotated, "two b t h i -> b t h (i two)").to(x.dtype)
