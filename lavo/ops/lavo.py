"""LAVO attention: sliding-window local attention plus the orthogonal memory over its outputs."""
from __future__ import annotations

import torch

from ..cache import LavoCache
from .checks import check_basis, check_pos_bias, check_window_inputs
from .local import (blocked_local_attention, from_blocks, keep_visible, local_attention_chunk, real_tokens,
                    to_blocks)
from .memory import accumulation_dtype, memory_read, project


def _check_inputs(q, k, v, basis, window, causal, pos_bias, padding_mask):
    check_window_inputs(q, k, v, window, padding_mask)
    check_basis(basis, q.shape[2], q.shape[3])
    check_pos_bias(pos_bias, q.shape[2], window, causal)


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.cumsum(dim) - x


def _memory_branch(q, features, counts, basis, scale, causal, dissection, skip_counts):
    r"""Global branch on blocks: ``q, features [n, B, H, w, D]``, ``counts [n, B, 1, w, 1]`` ->
    (read-out ``[n, B, H, w, D]``, per-window projection sums ``[n, B, H, 1, r]``)."""
    if not skip_counts:
        features = features * counts.to(features.dtype)
    block_count = counts.sum(3, keepdim=True)
    if dissection or not causal:
        # Projection is linear: project each window's sum rather than every token.
        block_sum = project(features.sum(3, keepdim=True), basis)
    else:
        proj = project(features, basis)  # [n, B, H, w, r]
        block_sum = proj.sum(3, keepdim=True)
    if not causal:
        coefficients = (block_sum.sum(0) / block_count.sum(0).clamp(min=1))[None]
    elif dissection:  # whole earlier windows only
        coefficients = _exclusive_cumsum(block_sum, 0) / _exclusive_cumsum(block_count, 0).clamp(min=1)
    else:  # every token up to and including the query
        running = _exclusive_cumsum(block_sum, 0) + proj.cumsum(3)
        coefficients = running / (_exclusive_cumsum(block_count, 0) + counts.cumsum(3)).clamp(min=1)
    return memory_read(q, coefficients, basis, scale), block_sum


def lavo_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor, *, window: int,
                   causal: bool = True, pos_bias: torch.Tensor | None = None, dissection: bool = True,
                   padding_mask: torch.Tensor | None = None, scale: float | None = None,
                   return_cache: bool = False) -> torch.Tensor | tuple[torch.Tensor, LavoCache]:
    r"""LAVO attention, blocked: ``O(T (w + r) D)`` time, ``O(T w)`` memory.

    Args:
        q, k, v: ``[B, T, H, D]``.
        basis: ``[H, r, D]`` with orthonormal rows.
        window: local window length ``w``.
        pos_bias: relative-position table, ``[H, 2w]`` causal or ``[H, 4w - 1]`` non-causal, or None.
        dissection: compress the local outputs (True) or the values (False) into the memory.
        padding_mask: ``[B, T]`` bool, True for real tokens; padded positions return zeros.
        scale: defaults to ``D ** -0.5``.
        return_cache: also return the :class:`LavoCache` that continues this sequence (causal only).
    Returns:
        ``[B, T, H, D]``, and the cache when asked.
    """
    _check_inputs(q, k, v, basis, window, causal, pos_bias, padding_mask)
    if return_cache and not causal:
        raise ValueError("a cache exists only for causal attention (causal=False was given)")
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    # Both branches work on windows, [n, B, H, w, D]: one matmul-friendly layout, views of the inputs.
    qb, kb, vb = to_blocks(q, window), to_blocks(k, window), to_blocks(v, window)
    real = real_tokens(padding_mask, B, T, window, q.device)
    local = blocked_local_attention(qb, kb, vb, real, causal=causal, pos_bias=pos_bias, scale=scale)
    counts = real[:, :, None, :, None].to(accumulation_dtype(q.dtype))  # [n, B, 1, w, 1]
    skip_counts = padding_mask is None and T % window == 0  # every count is 1
    memory, block_sum = _memory_branch(qb, local if dissection else vb, counts, basis, scale, causal, dissection,
                                       skip_counts)
    out = from_blocks(memory.add_(local).mul_(0.5), T)  # the read-out is not kept for backward: reuse it
    if padding_mask is not None:
        out = out * padding_mask[:, :, None, None].to(out.dtype)
    if not return_cache:
        return out
    done = T // window  # completed windows
    key_mask = real.transpose(0, 1).flatten(1)[:, :T]
    keys, values, key_mask = (x.clone() for x in keep_visible(T, window, k, v, key_mask))
    counts = counts.sum((2, 3, 4))  # [n, B]
    cache = LavoCache(keys=keys, values=values, key_mask=key_mask,
                      memory_sum=block_sum[:done].sum(0)[:, :, 0], memory_count=counts[:done].sum(0),
                      window_sum=block_sum[done:].sum(0)[:, :, 0], window_count=counts[done:].sum(0), position=T)
    return out, cache


def empty_cache(q: torch.Tensor, rank: int) -> LavoCache:
    """The cache before any token, shaped for inputs like ``q [B, T, H, D]``."""
    B, _, H, D = q.shape
    dtype = accumulation_dtype(q.dtype)
    memory = torch.zeros(B, H, rank, dtype=dtype, device=q.device)
    count = torch.zeros(B, dtype=dtype, device=q.device)
    return LavoCache(keys=q.new_zeros(B, 0, H, D), values=q.new_zeros(B, 0, H, D),
                     key_mask=torch.zeros(B, 0, dtype=torch.bool, device=q.device),
                     memory_sum=memory, memory_count=count, window_sum=memory, window_count=count, position=0)


def lavo_attention_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor,
                          cache: LavoCache, *, window: int, pos_bias: torch.Tensor | None = None,
                          dissection: bool = True, padding_mask: torch.Tensor | None = None,
                          scale: float | None = None) -> tuple[torch.Tensor, LavoCache]:
    r"""Causal LAVO on the next chunk of a sequence, continuing from ``cache``.

    Any chunking gives the outputs of one :func:`lavo_attention` call over the whole sequence. The chunk is
    processed in pieces that never cross a window boundary, so each costs ``O(piece (2w + r) D)``.

    Args:
        q, k, v: ``[B, T, H, D]``, the next ``T`` positions.
        cache: state after the previous positions (see :func:`empty_cache`).
    Returns:
        ``[B, T, H, D]`` and the updated cache (the input cache is not modified).
    """
    _check_inputs(q, k, v, basis, window, True, pos_bias, padding_mask)
    B, T, H, D = q.shape
    if cache.batch_size != B:
        raise ValueError(f"cache was built for batch size {cache.batch_size}, got input of batch size {B}")
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
                      window_sum=window_sum, window_count=window_count, position=position)
    return torch.cat(outputs, 1), cache
