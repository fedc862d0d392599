"""cosFormer self-attention (Qin et al., 2022)."""
from __future__ import annotations

import torch

from ..ops.common import accumulation_dtype, check_positive
from ..ops.cosformer import (CosformerCache, cosformer_attention, cosformer_attention_causal,
                             cosformer_cross_attention)
from .base import AttentionLayer, CrossAttentionLayer, element_size


class CosformerAttention(AttentionLayer):
    r"""Linear attention with ReLU features and the cos re-weighting ``cos(pi/2 (i - j) / M)``.

    Non-causal layers take ``M`` = the sequence length, as in the paper: one past the last real token when
    padded, so that right padding changes nothing. Causal layers fix
    ``M = max_length`` so that decoding never changes earlier weights; a sequence (all cached calls together)
    longer than ``max_length`` raises an error. Causal layers return a
    :class:`~lavo.ops.cosformer.CosformerCache` of constant size ``H (2D (D + 1))`` per sequence, plus the position.

    ``forward(x [B, T, dim], padding_mask [B, T] | None, cache | None) -> (y [B, T, dim], cache)``.
    """

    cache_types = (CosformerCache,)
    absolute_positions = True

    def __init__(self, dim: int, heads: int, *, causal: bool = True, max_length: int = 4096, chunk: int = 64):
        super().__init__(dim, heads, causal=causal)
        check_positive("CosformerAttention", max_length=max_length, chunk=chunk)
        self.max_length, self.chunk = max_length, chunk

    @property
    def max_positions(self) -> int | None:
        return self.max_length if self.causal else None  # the non-causal form re-weights by the sequence's length

    def attend(self, q, k, v, padding_mask, cache: CosformerCache | None):
        if self.causal:
            return cosformer_attention_causal(q, k, v, self.max_length, padding_mask=padding_mask, cache=cache,
                                              chunk=self.chunk)
        return cosformer_attention(q, k, v, padding_mask=padding_mask), None

    def _new_cache(self, batch_size: int, *, device: torch.device | str, dtype: torch.dtype) -> CosformerCache:
        return CosformerCache.empty(batch_size, self.heads, self.head_dim, device=device, dtype=dtype,
                                     max_length=self.max_length)

    def cache_nbytes(self, batch_size: int, context: int, dtype: torch.dtype = torch.float32) -> int:
        # kv [B, H, 2D, D] and k_sum [B, H, 2D], float32 for 16-bit inputs
        numbers = batch_size * self.heads * 2 * self.head_dim * (self.head_dim + 1)
        return numbers * element_size(accumulation_dtype(dtype))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, max_length={self.max_length}, causal={self.causal}"


class CosformerCrossAttention(CrossAttentionLayer):
    r"""cosFormer cross attention: real query ``i`` of ``m`` and real source token ``j`` of ``n`` re-weighted by
    ``cos(pi/2 (i / m - j / n))`` (:func:`~lavo.ops.cosformer.cosformer_cross_attention`). Not invariant to
    permuting the source: the re-weighting is positional.

    ``forward(y [B, Tq, dim], source [B, S, dim], source_padding_mask [B, S] | None,
    query_padding_mask [B, Tq] | None) -> [B, Tq, dim]``.
    """

    query_positions = True

    def attend(self, q, k, v, source_padding_mask, query_padding_mask):
        return cosformer_cross_attention(q, k, v, padding_mask=source_padding_mask,
                                         query_padding_mask=query_padding_mask)
