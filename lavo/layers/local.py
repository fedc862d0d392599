"""Sliding-window attention alone: LAVO's local branch without the orthogonal memory."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..cache import KVCache, in_autocast_dtype
from ..ops.common import check_backend, check_switches, check_window, pos_bias_size, zero_padding
from ..ops.local import local_attention, local_attention_chunk, visible_keys, visible_length
from .base import AttentionLayer, add_initialised


def add_position_bias(module: nn.Module, heads: int, window: int, causal: bool, enabled: bool) -> None:
    """Give ``module.pos_bias``: the relative-position bias of the window, zero at first (None when disabled)."""
    module.pos_bias = None
    if enabled:
        add_initialised(module, "pos_bias", partial(torch.zeros, heads, pos_bias_size(window, causal)))


class LocalAttention(AttentionLayer):
    r"""Blocked sliding-window attention with LAVO's window rule and learned relative-position bias.

    Position ``t`` lies in window ``t // w``; a causal query sees the previous and its own window up to ``t``, a
    non-causal one the previous, own and next windows (see :mod:`lavo.ops.local`).
    ``forward(x [B, T, dim], padding_mask [B, T] | None, cache | None) -> (y [B, T, dim], cache)``; a causal layer
    returns a :class:`~lavo.cache.KVCache` of at most ``2w - 1`` positions, whatever the context length.
    A chunk decoded from a cache costs ``O(T (2w + T) D)``: start long prompts without a cache.
    """

    cache_types = (KVCache,)
    absolute_positions = True

    def __init__(self, dim: int, heads: int, *, causal: bool = True, window: int = 64, position_bias: bool = True,
                 backend: str = "auto"):
        super().__init__(dim, heads, causal=causal)
        check_window(window)
        check_backend(backend)
        check_switches("LocalAttention", position_bias=position_bias)
        self.window, self.backend = window, backend
        add_position_bias(self, heads, window, causal, position_bias)

    def attend(self, q, k, v, padding_mask, cache):
        options = dict(window=self.window, pos_bias=self.pos_bias)
        if cache is None:
            out = local_attention(q, k, v, causal=self.causal, padding_mask=padding_mask, backend=self.backend,
                                  **options)
            if not self.causal:
                return out, None
            kept = visible_keys(k, v, padding_mask, self.window)
            return out, KVCache(*kept, k.shape[1], padding_mask is not None, rotary=False)
        cache.check_rotary(False)
        start = cache.position
        if cache.keys.shape[1] < (needed := visible_length(start, self.window)):
            raise ValueError(f"the cache holds {cache.keys.shape[1]} keys at position {start}, but a local layer with "
                             f"window {self.window} needs the last {needed}: it was made by a layer with a smaller "
                             "window; continue with the cache this layer returned")
        cache = in_autocast_dtype(cache, k.dtype).append(k, v, padding_mask)
        out = local_attention_chunk(q, cache.keys, cache.values, start=start, key_mask=cache.key_mask, **options)
        return zero_padding(padding_mask, out)[0], cache.keep_last(visible_length(cache.position, self.window))

    def _new_cache(self, batch_size: int, *, device: torch.device | str, dtype: torch.dtype) -> KVCache:
        return KVCache.empty(batch_size, self.heads, self.head_dim, device=device, dtype=dtype, rotary=False)

    def no_weight_decay(self) -> list[nn.Parameter]:
        return [self.pos_bias] if self.pos_bias is not None else []

    def cache_nbytes(self, batch_size: int, context: int, dtype: torch.dtype = torch.float32) -> int:
        return self.key_value_nbytes(batch_size, min(context, 2 * self.window - 1), dtype)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.heads}, window={self.window}, causal={self.causal}, "
                f"position_bias={self.pos_bias is not None}, backend={self.backend!r}")
