"""LAVO attention, blocked: sliding-window local attention plus the orthogonal memory over its outputs, both
computed a window at a time on ``[n, B, H, w, D]`` blocks."""
from __future__ import annotations

import torch

from ...cache import PAPER_MEMORY, LavoCache
from ..common import (accumulation_dtype, check_basis, check_pos_bias, check_window_inputs, constant_scale,
                      exclusive_cumsum, uses_triton, zero_padding)
from ..local.blocked import blocked_local_attention, blocking_window, from_blocks, real_tokens, to_blocks
from ..local.decoding import visible_keys
from .memory import memory_read, project
from .variants import (SlotState, check_triton_computes, check_variant, empty_state, is_variant, rows,
                       variant_memory_branch)


def check_inputs(q, k, v, basis, window, causal, pos_bias, padding_mask):
    """The checks of :func:`lavo_attention` and its cached form."""
    check_window_inputs(q, k, v, window, padding_mask)
    check_basis(basis, q.shape[2], q.shape[3], q.shape[1])
    check_pos_bias(pos_bias, q.shape[2], window, causal)


def check_read_scale(read_scale: torch.Tensor | None, heads: int) -> None:
    if read_scale is not None and tuple(read_scale.shape) != (heads,):
        raise ValueError(f"read_scale must have shape [H] = ({heads},), got {tuple(read_scale.shape)}")


def scaled_queries(q: torch.Tensor, read_scale: torch.Tensor | None) -> torch.Tensor:
    """``q [..., H, L, D]`` times the per-head read scale: the memory read's logits scale with it."""
    return q if read_scale is None else q * read_scale.to(q.dtype)[:, None, None]


def _memory_branch(q, features, counts, basis, scale, causal, dissection, all_counts_one):
    r"""Global branch on blocks: ``q, features [n, B, H, w, D]``, ``counts [n, B, 1, w, 1]`` ->
    (read-out ``[n, B, H, w, D]``, per-window projection sums ``[n, B, H, 1, r]``)."""
    if not all_counts_one:
        features = features * counts.to(features.dtype)
    block_count = counts.sum(3, keepdim=True)
    if dissection or not causal:
        # Projection is linear: project each window's sum rather than every token.
        block_sum = project(features.sum(3, keepdim=True, dtype=accumulation_dtype(features.dtype)), basis)
    else:
        proj = project(features, basis)  # [n, B, H, w, r]
        block_sum = proj.sum(3, keepdim=True)
    if not causal:
        coefficients = (block_sum.sum(0) / block_count.sum(0).clamp(min=1))[None]
    elif dissection:  # whole earlier windows only
        coefficients = exclusive_cumsum(block_sum, 0) / exclusive_cumsum(block_count, 0).clamp(min=1)
    else:  # every token up to and including the query
        running = exclusive_cumsum(block_sum, 0) + proj.cumsum(3)
        coefficients = running / (exclusive_cumsum(block_count, 0) + counts.cumsum(3)).clamp(min=1)
    return memory_read(q, coefficients, basis, scale), block_sum


def lavo_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor, *, window: int,
                   causal: bool = True, pos_bias: torch.Tensor | None = None, dissection: bool = True,
                   padding_mask: torch.Tensor | None = None, scale: float | None = None,
                   return_cache: bool = False, write: str = "mean", memory: str = "scalar",
                   decay: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                   read_scale: torch.Tensor | None = None,
                   backend: str = "auto") -> torch.Tensor | tuple[torch.Tensor, LavoCache]:
    r"""LAVO attention, blocked: ``O(T (w + r) D)`` time; memory as :mod:`lavo.ops.local.blocked` says.

    Args:
        q, k, v: ``[B, T, H, D]``.
        basis: ``[H, r, D]`` with orthonormal rows.
        window: local window length ``w``.
        pos_bias: relative-position table, ``[H, 2w]`` causal or ``[H, 4w - 1]`` non-causal, or None.
        dissection: compress the local outputs (True) or the values (False) into the memory.
        padding_mask: ``[B, T]`` bool, True for real tokens; padded positions return zeros, and what they
            hold (NaN included) reaches no output.
        scale: defaults to ``D ** -0.5``.
        return_cache: also return the :class:`LavoCache` that continues this sequence (causal only).
        write, memory: the memory's write rule (``"mean"``, the paper; ``"decay"``; ``"gated"``) and slot kind
            (``"scalar"``, the paper; ``"vector"``), see :mod:`.variants`.
        decay: ``[H]`` decay rates per position, with ``write="decay"``.
        gate: ``[H, r, D]`` write-gate vectors, with ``write="gated"``.
        read_scale: ``[H]`` factors on the memory read's logits (a learned read temperature), or None.
        backend: ``"triton"`` (the GPU kernels of :mod:`.gpu`; the paper's memory only), ``"torch"`` (this
            module) or ``"auto"``: Triton for CUDA tensors when Triton 3.3+ is installed and the memory is the
            paper's (see :func:`~lavo.ops.common.uses_triton`).
    Returns:
        ``[B, T, H, D]``, and the cache when asked.
    """
    check_inputs(q, k, v, basis, window, causal, pos_bias, padding_mask)
    check_variant(write, memory, causal, dissection, decay, gate, *basis.shape[:2], q.shape[3])
    check_read_scale(read_scale, q.shape[2])
    if return_cache and not causal:
        raise ValueError("a cache exists only for causal attention (causal=False was given)")
    B, T, H, D = q.shape
    scale = constant_scale(scale, D)
    q, k, v = zero_padding(padding_mask, q, k, v)
    variant = is_variant(write, memory)
    check_triton_computes(backend, variant or read_scale is not None)
    if not variant and read_scale is None and uses_triton(backend, q):
        from .gpu import lavo_attention_triton
        return lavo_attention_triton(q, k, v, basis, window=window, causal=causal, pos_bias=pos_bias,
                                     dissection=dissection, padding_mask=padding_mask, scale=scale,
                                     return_cache=return_cache)
    # Both branches work on windows, [n, B, H, w, D]: one matmul-friendly layout, views of the inputs. A sequence
    # shorter than the window is one window either way, so its blocks are only as long as it (the cache below
    # keeps the layer's window).
    block, block_pos_bias = blocking_window(window, T, pos_bias, causal)
    qb, kb, vb = to_blocks(q, block), to_blocks(k, block), to_blocks(v, block)
    real = real_tokens(padding_mask, B, T, block, q.device)
    local = blocked_local_attention(qb, kb, vb, real, causal=causal, pos_bias=block_pos_bias, scale=scale)
    counts = real[:, :, None, :, None].to(accumulation_dtype(q.dtype))  # [n, B, 1, w, 1]
    all_counts_one = padding_mask is None and T % block == 0  # no padding, and no block padded past T
    qr = scaled_queries(qb, read_scale)
    # the variants and the paper's memory differ here, in the memory branch, and in the cache they return
    if variant:
        read, window_states, states_upto = variant_memory_branch(qr, local, counts, basis, scale, causal, memory,
                                                                 decay, gate)
    else:
        read, block_sum = _memory_branch(qr, local if dissection else vb, counts, basis, scale, causal, dissection,
                                         all_counts_one)
    out = from_blocks(read.add_(local).mul_(0.5), T)  # the read-out is not kept for backward: reuse it
    (out,) = zero_padding(padding_mask, out)
    if not return_cache:
        return out
    if variant:
        keys, values, key_mask = visible_keys(k, v, padding_mask, window)
        return out, LavoCache(keys=keys, values=values, key_mask=key_mask, position=T, window=window,
                              dissection=True, write=write, memory=memory,  # variants need dissection
                              **variant_cache_states(window_states, states_upto, T // window))
    window_proj = block_sum[..., 0, :].permute(1, 2, 0, 3)  # [B, H, n, r]
    return out, cache_after(k, v, padding_mask, window_proj, counts.sum((2, 3, 4)).T, window, dissection)


def cache_after(k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None, window_proj: torch.Tensor,
                counts: torch.Tensor, window: int, dissection: bool) -> LavoCache:
    r"""The cache of the paper's memory that continues a sequence of ``T`` positions: ``k, v [B, T, H, D]``,
    ``padding_mask [B, T]`` or None, the projections of each window's feature sums ``[B, H, n, r]`` (of the local
    outputs with ``dissection``, else of the values) and its counts of real tokens ``[B, n]``."""
    done = k.shape[1] // window  # completed windows
    keys, values, key_mask = visible_keys(k, v, padding_mask, window)
    return LavoCache(keys=keys, values=values, key_mask=key_mask, memory_sum=window_proj[:, :, :done].sum(2),
                     memory_count=counts[:, :done].sum(1), window_sum=window_proj[:, :, done:].sum(2),
                     window_count=counts[:, done:].sum(1), position=k.shape[1], window=window,
                     dissection=dissection, **PAPER_MEMORY)


def variant_cache_states(windows: SlotState, upto: SlotState, done: int) -> dict[str, torch.Tensor]:
    """The cache fields of a variant's memory after ``done`` complete windows: the state of those windows
    (``upto[done - 1]``, referenced to the last one's start) and of the unfinished one (referenced to its start).
    ``windows``: per-window states; ``upto``: their inclusive scan. Copies, so a cache does not pin every
    window's state."""
    nothing = empty_state(windows.top[0], windows.total.shape[-1])
    memory = rows(upto, done - 1) if done > 0 else nothing
    unfinished = rows(windows, done) if done < windows.top.shape[0] else nothing
    fields = dict(memory_top=memory.top, memory_sum=memory.total, memory_count=memory.norm,
                  window_top=unfinished.top, window_sum=unfinished.total, window_count=unfinished.norm)
    return {name: state.clone() for name, state in fields.items()}

