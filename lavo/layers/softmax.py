"""Full softmax attention: the quadratic baseline, with a key/value cache that grows with the context."""
from __future__ import annotations

import torch

from ..cache import KVCache
from ..ops.common import check_switches
from ..ops.softmax import apply_rotary, softmax_attention
from .base import AttentionLayer, CrossAttentionLayer


class SoftmaxAttention(AttentionLayer):
    r"""Standard multi-head softmax attention (Vaswani et al., 2017), optionally with rotary position embedding.

    ``forward(x [B, T, dim], padding_mask [B, T] | None, cache | None) -> (y [B, T, dim], cache)``. A causal layer
    returns a :class:`~lavo.cache.KVCache` holding every key and value seen so far, so decoding cost and
    state grow with the context.

    Args:
        rotary: rotate queries and keys by their absolute positions (RoPE, base 10000); needs an even head dim.
    """

    accepts_rotary = True
    time_complexity = "quadratic"
    cache_types = (KVCache,)

    def __init__(self, dim: int, heads: int, *, causal: bool = True, rotary: bool = False):
        super().__init__(dim, heads, causal=causal)
        check_switches("SoftmaxAttention", rotary=rotary)
        if rotary and self.head_dim % 2:
            raise ValueError(f"rotary=True needs an even head dimension, got dim={dim} / heads={heads} "
                             f"= {self.head_dim}")
        self.rotary = rotary

    def attend(self, q, k, v, padding_mask, cache):
        start = 0 if cache is None else cache.position
        if self.rotary:
            q, k = apply_rotary(q, start), apply_rotary(k, start)
        if not self.causal:
            return softmax_attention(q, k, v, causal=False, key_mask=padding_mask, query_mask=padding_mask), None
        if cache is None:  # every key is in this call: None as the mask keeps the fused is_causal path
            out = softmax_attention(q, k, v, causal=True, key_mask=padding_mask, query_mask=padding_mask)
            return out, KVCache.of(k, v, padding_mask, rotary=self.rotary)
        cache.check_rotary(self.rotary)
        if cache.keys.shape[1] != cache.position:
            raise ValueError(f"the cache holds the last {cache.keys.shape[1]} of {cache.position} positions (a "
                             "sliding-window layer's): softmax attends to every earlier position; pass the cache "
                             "this layer's previous call returned")
        cache = cache.append(k, v, padding_mask)
        if q.shape[1] == 1 and not cache.padded:
            # one query, at the last position, sees every cached key: no mask, so SDPA takes its fused path
            return softmax_attention(q, cache.keys, cache.values, causal=False), cache
        out = softmax_attention(q, cache.keys, cache.values, causal=True, key_mask=cache.key_mask,
                                query_mask=padding_mask)
        return out, cache

    def _new_cache(self, batch_size: int, *, device: torch.device | str, dtype: torch.dtype) -> KVCache:
        return KVCache.empty(batch_size, self.heads, self.head_dim, device=device, dtype=dtype, rotary=self.rotary)

    def cache_nbytes(self, batch_size: int, context: int, dtype: torch.dtype = torch.float32) -> int:
        return self.key_value_nbytes(batch_size, context, dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, causal={self.causal}, rotary={self.rotary}"


class SoftmaxCrossAttention(CrossAttentionLayer):
    r"""Softmax cross attention through SDPA: every query over every real source token. Invariant to permuting
    the source (it has no source positions).

    ``forward(y [B, Tq, dim], source [B, S, dim], source_padding_mask [B, S] | None,
    query_padding_mask [B, Tq] | None) -> [B, Tq, dim]``.
    """

    def attend(self, q, k, v, source_padding_mask):
        return softmax_attention(q, k, v, causal=False, key_mask=source_padding_mask)
