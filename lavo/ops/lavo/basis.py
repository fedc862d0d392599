"""Orthonormal bases for the orthogonal memory."""
from __future__ import annotations

import torch

from ..common import check_positive


def orthogonal_basis(heads: int, rank: int, head_dim: int, *, generator: torch.Generator | None = None,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    r"""Random orthonormal bases, one per head.

    Returns:
        basis: ``[H, r, D]`` with ``basis[h] @ basis[h].T == I_r``.
    """
    check_positive("orthogonal_basis", heads=heads, rank=rank, head_dim=head_dim)
    if rank > head_dim:
        raise ValueError(f"rank ({rank}) must be <= head_dim ({head_dim}): at most head_dim orthonormal vectors exist")
    gaussian = torch.randn(heads, head_dim, rank, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    # Sign fix makes the draw uniform (Haar) over the orthogonal group.
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return q.transpose(-1, -2).to(dtype=dtype or torch.get_default_dtype(), device=device).contiguous()
