"""Causal LAVO continued from a constant-size cache: the decoding form of :func:`.blocked.lavo_attention`."""
from __future__ import annotations

import torch

from ...cache import PAPER_MEMORY, LavoCache
from ..common import constant_scale
from ..local.decoding import keep_visible, local_attention_chunk
from .blocked import check_inputs, check_read_scale, scaled_queries
from .memory import memory_read, project
from .variants import (SlotState, check_variant, empty_state, head_shift, is_variant, merge, read_variant, summarise,
                       write_logits)


def lavo_attention_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor,
                          cache: LavoCache, *, window: int, pos_bias: torch.Tensor | None = None,
                          dissection: bool = True, padding_mask: torch.Tensor | None = None,
                          scale: float | None = None, write: str = "mean", memory: str = "scalar",
                          decay: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                          read_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, LavoCache]:
    r"""Causal LAVO on the next chunk of a sequence, continuing from ``cache``.

    Any chunking gives the outputs of one :func:`lavo_attention` call over the whole sequence. The chunk is
    processed in pieces that never cross a window boundary, so each costs ``O(piece (2w + r) D)``.

    Args:
        q, k, v: ``[B, T, H, D]``, the next ``T`` positions.
        cache: after the previous positions (:meth:`LavoCache.empty` before the first, or
            :meth:`LavoCache.empty_variant` for a memory variant).
        write, memory, decay, gate, read_scale: as in :func:`lavo_attention`.
    Returns:
        ``[B, T, H, D]`` and the updated cache (the input cache is not modified).
    """
    check_inputs(q, k, v, basis, window, True, pos_bias, padding_mask)
    check_variant(write, memory, True, dissection, decay, gate, *basis.shape[:2], q.shape[3])
    check_read_scale(read_scale, q.shape[2])
    B, T, H, D = q.shape
    cache.check_fits(B, H, D, basis.shape[1], window=window, dissection=dissection, write=write, memory=memory)
    cache.check_dtype(q.dtype)
    if is_variant(write, memory):
        return _variant_cached(q, k, v, basis, cache, window=window, pos_bias=pos_bias, real=padding_mask,
                               scale=scale, write=write, memory=memory, decay=decay, gate=gate,
                               read_scale=read_scale)
    if cache.memory_top is not None:
        raise ValueError("this cache holds a memory variant's states; the paper's memory continues from "
                         "LavoCache.empty or from a cache it returned")
    scale = constant_scale(scale, D)
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
        queries = scaled_queries(q[:, piece].transpose(1, 2), read_scale)
        memory = memory_read(queries, coefficients, basis, scale).transpose(1, 2)
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
                      window_sum=window_sum, window_count=window_count, position=position, window=window,
                      dissection=dissection, **PAPER_MEMORY)
    return torch.cat(outputs, 1), cache


def _variant_cached(q, k, v, basis, cache: LavoCache, *, window, pos_bias, real, scale, write, memory, decay, gate,
                    read_scale) -> tuple[torch.Tensor, LavoCache]:
    """:func:`lavo_attention_cached` for a memory variant (:mod:`.variants`): the same pieces, with the memories
    kept as ``(top, sum, count)`` states. The unfinished window's state is referenced to its start; at a
    boundary it is merged into the memory, whose decay logits drop by a whole window."""
    if cache.memory_top is None:
        raise ValueError("this cache holds the paper's memory; a memory variant continues from "
                         "LavoCache.empty_variant or from a cache the variant returned")
    B, T, H, D = q.shape
    cache.check_batch_size(B)
    scale = constant_scale(scale, D)
    real = torch.ones(B, T, dtype=torch.bool, device=q.device) if real is None else real
    keys, values, key_mask, position = cache.keys, cache.values, cache.key_mask, cache.position
    memory_state = SlotState(cache.memory_top, cache.memory_sum, cache.memory_count)
    window_state = SlotState(cache.window_top, cache.window_sum, cache.window_count)
    outputs, begin = [], 0
    while begin < T:
        end = min(T, begin + window - position % window)
        piece = slice(begin, end)
        keys, values = torch.cat([keys, k[:, piece]], 1), torch.cat([values, v[:, piece]], 1)
        key_mask = torch.cat([key_mask, real[:, piece]], 1)
        local = local_attention_chunk(q[:, piece], keys, values, start=position, window=window, pos_bias=pos_bias,
                                      key_mask=key_mask, scale=scale)
        offsets = torch.arange(position % window, position % window + end - begin, device=q.device)
        logits, written = write_logits(local.transpose(1, 2), basis, memory, decay, gate, offsets)
        counts = real[:, None, piece, None].to(logits.dtype)  # [B, 1, L, 1]
        window_state = merge(window_state, summarise(logits, written, counts, memory), 0.0)
        queries = scaled_queries(q[:, piece].transpose(1, 2), read_scale)
        read = read_variant(queries, memory_state.mean(), basis, scale, memory).transpose(1, 2)
        outputs.append((local + read) / 2 * real[:, piece, None, None].to(q.dtype))
        position += end - begin
        if position % window == 0:
            memory_state = merge(memory_state, window_state, head_shift(decay, window))
            window_state = empty_state(window_state.top, window_state.total.shape[-1])
        keys, values, key_mask = keep_visible(position, window, keys, values, key_mask)
        begin = end
    cache = LavoCache(keys=keys, values=values, key_mask=key_mask, position=position, window=window,
                      memory_top=memory_state.top, memory_sum=memory_state.total, memory_count=memory_state.norm,
                      window_top=window_state.top, window_sum=window_state.total, window_count=window_state.norm,
                      dissection=True, write=write, memory=memory)
    return torch.cat(outputs, 1), cache
