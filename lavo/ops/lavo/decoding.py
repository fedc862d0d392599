"""Causal LAVO continued from a constant-size cache: the decoding form of :func:`.blocked.lavo_attention`."""
from __future__ import annotations

import torch

from ...cache import LavoCache
from ..local.decoding import keep_visible, local_attention_chunk
from .blocked import check_inputs
from .memory import memory_read, project


def lavo_attention_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor,
                          cache: LavoCache, *, window: int, pos_bias: torch.Tensor | None = None,
                          dissection: bool = True, padding_mask: torch.Tensor | None = None,
                          scale: float | None = None) -> tuple[torch.Tensor, LavoCache]:
    r"""Causal LAVO on the next chunk of a sequence, continuing from ``cache``.

    Any chunking gives the outputs of one :func:`lavo_attention` call over the whole sequence. The chunk is
    processed in pieces that never cross a window boundary, so each costs ``O(piece (2w + r) D)``.

    Args:
        q, k, v: ``[B, T, H, D]``, the next ``T`` positions.
        cache: after the previous positions (:meth:`LavoCache.empty` before the first).
    Returns:
        ``[B, T, H, D]`` and the updated cache (the input cache is not modified).
    """
    check_inputs(q, k, v, basis, window, True, pos_bias, padding_mask)
    B, T, H, D = q.shape
    cache.check_fits(B, H, D, basis.shape[1], window)
    scale = D ** -0.5 if scale is None else scale
    real = torch.ones(B, T, dtype=torch.bool, device=q.device) if padding_mask is None else padding_mask
    keys, values, key_mask = cache.keys, cache.values, cache.key_mask
    memory_sum, memory_count = cache.memory_sum, cache.memory_count
    window_sum, window_count = cache.window_sum, cache.window_count
    position = cache.position
    outputs = []
    begin = 0
    while begin < T:
        end = min(T, begin + window - position % window)
        piece = slice(begin, end)
        keys = torch.cat([keys, k[:, piece]], 1)
        values = torch.cat([values, v[:, piece]], 1)
        key_mask = torch.cat([key_mask, real[:, piece]], 1)
        local = local_attention_chunk(q[:, piece], keys, values, start=position, window=window, pos_bias=pos_bias,
                                      key_mask=key_mask, scale=scale)
        counts = real[:, None, piece, None].to(memory_sum.dtype)  # [B, 1, L, 1]
        proj = project((local if dissection else v[:, piece]).transpose(1, 2), basis) * counts  # [B, H, L, r]
        if dissection:
            coefficients = (memory_sum / memory_count.clamp(min=1)[:, None, None])[:, :, None]
        else:
            running = (memory_sum + window_sum)[:, :, None] + proj.cumsum(2)
            seen = (memory_count + window_count)[:, None, None, None] + counts.cumsum(2)
            coefficients = running / seen.clamp(min=1)
        memory = memory_read(q[:, piece].transpose(1, 2), coefficients, basis, scale).transpose(1, 2)
        outputs.append((local + memory) / 2 * real[:, piece, None, None].to(q.dtype))
        window_sum = window_sum + proj.sum(2)
        window_count = window_count + counts.sum((1, 2, 3))
        position += end - begin
        if position % window == 0:
            memory_sum, memory_count = memory_sum + window_sum, memory_count + window_count
            window_sum, window_count = torch.zeros_like(window_sum), torch.zeros_like(window_count)
        keys, values, key_mask = keep_visible(position, window, keys, values, key_mask)
        begin = end
    cache = LavoCache(keys=keys, values=values, key_mask=key_mask, memory_sum=memory_sum, memory_count=memory_count,
                      window_sum=window_sum, window_count=window_count, position=position, window=window)
    return torch.cat(outputs, 1), cache
