"""Constant-size decoding state of a causal LAVO layer."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class LavoCache:
    r"""Everything a causal LAVO layer needs to continue a sequence; its size does not grow with context.

    Attributes:
        keys, values: ``[B, L, H, D]`` for the last ``L <= 2w - 1`` positions, from the start of the previous
            window to ``position - 1``: all the local branch can still see.
        key_mask: ``[B, L]`` bool, True for real (non-padding) keys.
        memory_sum: ``[B, H, r]`` float32, sum of the projections over all completed windows.
        memory_count: ``[B]`` float32, real tokens in those windows.
        window_sum: ``[B, H, r]`` float32, sum over the current, unfinished window.
        window_count: ``[B]`` float32, real tokens in it.
        position: tokens seen so far (padding included): fixes window boundaries and relative positions.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor
    memory_sum: torch.Tensor
    memory_count: torch.Tensor
    window_sum: torch.Tensor
    window_count: torch.Tensor
    position: int

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors."""
        return sum(t.numel() * t.element_size() for f in fields(self)
                   if isinstance(t := getattr(self, f.name), torch.Tensor))

    @staticmethod
    def max_nbytes(batch: int, heads: int, head_dim: int, rank: int, window: int,
                   dtype: torch.dtype = torch.float32) -> int:
        """Upper bound of ``nbytes()`` for any context length: ``2w - 1`` cached keys and values."""
        length = 2 * window - 1
        element = torch.empty((), dtype=dtype).element_size()
        return (2 * batch * length * heads * head_dim * element + batch * length
                + 2 * (batch * heads * rank * 4 + batch * 4))
