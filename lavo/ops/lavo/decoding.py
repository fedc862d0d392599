"""Causal LAVO continued from a constant-size cache: the decoding form of :func:`.blocked.lavo_attention`."""
from __future__ import annotations

import torch

from ...cache import PAPER_MEMORY, LavoCache, check_kind
from ..common import constant_scale, without_autocast, zero_padding
from ..local.decoding import chunk_attention, keep_visible
from .blocked import check_inputs, check_read_scale, scaled_queries
from .memory import memory_read, project
from .variants import (SlotState, check_variant, empty_state, head_shift, is_variant, merge, read_variant, summarise,
                       write_logits)


@without_autocast
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
    check_kind(cache, LavoCache, "lavo_attention_cached", "start a sequence from LavoCache.empty(...) (a "
               "LavoStepCache continues through lavo_decode_step)")
    cache.check_fits(B, H, D, basis.shape[1], window=window, dissection=dissection, write=write, memory=memory)
    cache.check_dtype(q.dtype)
    scale = constant_scale(scale, D)
    q, k, v = zero_padding(padding_mask, q, k, v)
    if is_variant(write, memory):
        state = _VariantMemory(cache, basis, scale=scale, write=write, memory=memory, decay=decay, gate=gate,
                               window=window)
    else:
        state = _PaperMemory(cache, basis, scale=scale, dissection=dissection)
    real = torch.ones(B, T, dtype=torch.bool, device=q.device) if padding_mask is None else padding_mask
    keys, values, key_mask, position = cache.keys, cache.values, cache.key_mask, cache.position
    outputs, begin = [], 0
    while begin < T:  # in pieces that never cross a window boundary
        end = min(T, begin + window - position % window)
        piece = slice(begin, end)
        keys, values = torch.cat([keys, k[:, piece]], 1), torch.cat([values, v[:, piece]], 1)
        key_mask = torch.cat([key_mask, real[:, piece]], 1)
        local = chunk_attention(q[:, piece], keys, values, start=position, window=window, pos_bias=pos_bias,
                                key_mask=key_mask, scale=scale)
        queries = scaled_queries(q[:, piece].transpose(1, 2), read_scale)  # [B, H, L, D]
        read = state.step(queries, v[:, piece], local, real[:, piece], position % window)
        outputs.append((local + read) / 2 * real[:, piece, None, None].to(q.dtype))
        position += end - begin
        if position % window == 0:
            state.close_window()
        keys, values, key_mask = keep_visible(position, window, keys, values, key_mask)
        begin = end
    return torch.cat(outputs, 1), state.cache(keys=keys, values=values, key_mask=key_mask, position=position,
                                              window=window)


class _PaperMemory:
    """The paper's memory through a chunk: sums of the coordinates (float32 for 16-bit inputs) and counts, of the
    whole windows before and of the window under way."""

    def __init__(self, cache: LavoCache, basis: torch.Tensor, *, scale, dissection: bool):
        if cache.memory_top is not None:
            raise ValueError("this cache holds a memory variant's states; the paper's memory continues from "
                             "LavoCache.empty or from a cache it returned")
        self.basis, self.scale, self.dissection = basis, scale, dissection
        self.memory_sum, self.memory_count = cache.memory_sum, cache.memory_count
        self.window_sum, self.window_count = cache.window_sum, cache.window_count

    def step(self, queries, v, local, real, offset: int) -> torch.Tensor:
        """Read the memory for a piece of one window (``queries [B, H, L, D]``, read-scaled; ``v`` and ``local``
        ``[B, L, H, D]``; ``real [B, L]``), then write it."""
        counts = real[:, None, :, None].to(self.memory_sum.dtype)  # [B, 1, L, 1]
        proj = project((local if self.dissection else v).transpose(1, 2), self.basis) * counts  # [B, H, L, r]
        if self.dissection:  # the whole windows before
            coefficients = (self.memory_sum / self.memory_count.clamp(min=1)[:, None, None])[:, :, None]
        else:  # every position up to the query
            running = (self.memory_sum + self.window_sum)[:, :, None] + proj.cumsum(2)
            seen = (self.memory_count + self.window_count)[:, None, None, None] + counts.cumsum(2)
            coefficients = running / seen.clamp(min=1)
        self.window_sum = self.window_sum + proj.sum(2)
        self.window_count = self.window_count + counts.sum((1, 2, 3))
        return memory_read(queries, coefficients, self.basis, self.scale).transpose(1, 2)

    def close_window(self) -> None:
        self.memory_sum, self.memory_count = self.memory_sum + self.window_sum, self.memory_count + self.window_count
        self.window_sum, self.window_count = torch.zeros_like(self.window_sum), torch.zeros_like(self.window_count)

    def cache(self, **kept) -> LavoCache:
        return LavoCache(memory_sum=self.memory_sum, memory_count=self.memory_count, window_sum=self.window_sum,
                         window_count=self.window_count, dissection=self.dissection, **PAPER_MEMORY, **kept)


class _VariantMemory:
    """A memory variant (:mod:`.variants`) through a chunk: ``(top, sum, count)`` states of the whole windows
    before and of the window under way. The unfinished window's state is referenced to its start; when it closes
    it is merged into the memory, whose decay logits drop by a whole window."""

    def __init__(self, cache: LavoCache, basis: torch.Tensor, *, scale, write: str, memory: str, decay, gate,
                 window: int):
        if cache.memory_top is None:
            raise ValueError("this cache holds the paper's memory; a memory variant continues from "
                             "LavoCache.empty_variant or from a cache the variant returned")
        self.basis, self.scale = basis, scale
        self.write, self.memory, self.decay, self.gate, self.window = write, memory, decay, gate, window
        self.memory_state = SlotState(cache.memory_top, cache.memory_sum, cache.memory_count)
        self.window_state = SlotState(cache.window_top, cache.window_sum, cache.window_count)

    def step(self, queries, v, local, real, offset: int) -> torch.Tensor:
        """Read the memory for a piece of one window starting ``offset`` positions into it (arguments as
        :meth:`_PaperMemory.step`), then write the piece into the window's state."""
        offsets = torch.arange(offset, offset + local.shape[1], device=local.device)
        logits, written = write_logits(local.transpose(1, 2), self.basis, self.memory, self.decay, self.gate,
                                       offsets)
        counts = real[:, None, :, None].to(logits.dtype)  # [B, 1, L, 1]
        self.window_state = merge(self.window_state, summarise(logits, written, counts, self.memory), 0.0)
        return read_variant(queries, self.memory_state.mean(), self.basis, self.scale, self.memory).transpose(1, 2)

    def close_window(self) -> None:
        self.memory_state = merge(self.memory_state, self.window_state, head_shift(self.decay, self.window))
        self.window_state = empty_state(self.window_state.top, self.window_state.total.shape[-1])

    def cache(self, **kept) -> LavoCache:
        memory, window = self.memory_state, self.window_state
        return LavoCache(memory_top=memory.top, memory_sum=memory.total, memory_count=memory.norm,
                         window_top=window.top, window_sum=window.total, window_count=window.norm, dissection=True,
                         write=self.write, memory=self.memory, **kept)
