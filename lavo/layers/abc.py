"""ABC (attention with bounded-memory control) with a learned control: a fixed number of memory slots per head."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..ops.abc import ABCCache, abc_attention, abc_cross_attention
from ..ops.common import accumulation_dtype, check_positive
from .base import AttentionLayer, CrossAttentionLayer, add_initialised, element_size, scaled_normal


def add_control(module: nn.Module, slots: int) -> None:
    """Give ``module.control [H, slots, D]``, the learned control ``W_phi``, and ``module.slots``."""
    check_positive(type(module).__name__, slots=slots)
    module.slots = slots
    add_initialised(module, "control", partial(scaled_normal, module.heads, slots, module.head_dim,
                                               std=module.head_dim ** -0.5))


class ABCAttention(AttentionLayer):
    r"""ABC self-attention (Peng et al., 2022) with ``slots`` memory slots per head; see :mod:`lavo.ops.abc`.

    ``forward(x [B, T, dim], padding_mask [B, T] | None, cache | None) -> (y [B, T, dim], cache)``; a causal layer
    returns an :class:`~lavo.ops.abc.ABCCache` of ``2 slots (D + 1)`` numbers per batch and head, whatever the
    context length.
    """

    cache_types = (ABCCache,)

    def __init__(self, dim: int, heads: int, *, causal: bool = True, slots: int = 64):
        super().__init__(dim, heads, causal=causal)
        add_control(self, slots)

    def attend(self, q, k, v, padding_mask, cache):
        return abc_attention(q, k, v, self.control, causal=self.causal, padding_mask=padding_mask, cache=cache)

    def _new_cache(self, batch_size: int, *, device: torch.device | str, dtype: torch.dtype) -> ABCCache:
        return ABCCache.empty(batch_size, self.heads, self.slots, self.head_dim, device=device, dtype=dtype)

    def cache_nbytes(self, batch_size: int, context: int, dtype: torch.dtype = torch.float32) -> int:
        # running maximum, normaliser [B, H, r] and key and value sums [B, H, r, D], in the accumulation dtype
        numbers = batch_size * self.heads * self.slots * (2 + 2 * self.head_dim)
        return numbers * element_size(accumulation_dtype(dtype))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, slots={self.slots}, causal={self.causal}"


class ABCCrossAttention(CrossAttentionLayer):
    r"""ABC cross attention: ``slots`` memory slots per head written from the whole source (a softmax over the
    source per slot), read by every query. Invariant to permuting the source (the control sees content only).

    ``forward(y [B, Tq, dim], source [B, S, dim], source_padding_mask [B, S] | None,
    query_padding_mask [B, Tq] | None) -> [B, Tq, dim]``.
    """

    def __init__(self, dim: int, heads: int, *, slots: int = 64):
        super().__init__(dim, heads)
        add_control(self, slots)

    def attend(self, q, k, v, source_padding_mask):
        return abc_cross_attention(q, k, v, self.control, padding_mask=source_padding_mask)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, slots={self.slots}"
