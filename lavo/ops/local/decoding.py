"""Causal sliding-window attention for a chunk of queries against cached keys: the decoding form of the window
rule of :mod:`.blocked`, shared by the local layer and LAVO's cached op."""
from __future__ import annotations

import torch

from ..common import (accumulation_dtype, check_matching, check_padding_mask, check_pos_bias, check_window, neg_inf,
                      query_scale, without_autocast, zero_padding)


def keep_visible(position: int, window: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    r"""Trim keys to what a causal query at ``position`` or later can still see.

    Args:
        position: tokens seen so far; each tensor's time axis (dim 1) ends at ``position - 1``.
        tensors: e.g. keys ``[B, L, H, D]`` and their mask ``[B, L]``.
    Returns:
        each tensor from the start of the previous window on: its last ``<= 2w - 1`` positions; a copy when
        positions are dropped (once a window), so a cache never pins the positions it no longer holds.
    """
    keep = visible_length(position, window)
    return tuple(t[:, t.shape[1] - keep:].clone() if keep < t.shape[1] else t for t in tensors)


def visible_keys(k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None, window: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of the keys, values and key mask (``real [B, T]``, None: all real) the local branch can still see
    after the ``T`` positions of ``k, v [B, T, H, D]``; copies, so a cache does not pin the whole sequence."""
    B, T = k.shape[:2]
    key_mask = torch.ones(B, T, dtype=torch.bool, device=k.device) if real is None else real
    kept = keep_visible(T, window, k, v, key_mask)  # copies when it drops positions
    return kept if visible_length(T, window) < T else tuple(x.clone() for x in kept)


def visible_length(position: int, window: int) -> int:
    """How many of the last positions a causal query at ``position`` or later can still see: those from the
    start of the previous window on, at most ``2w - 1``."""
    return position - max(0, (position // window - 1) * window)


def check_start(start: int, queries: int, keys: int) -> None:
    """Refuse a ``start`` that puts keys before position 0: the position of the first key given, rather than of
    the first query, would otherwise be taken silently."""
    if not isinstance(start, int) or isinstance(start, bool):
        raise ValueError(f"start must be an integer, the position of the first query; got {start!r}")
    if start < keys - queries:
        raise ValueError(f"start={start} puts the first of the {keys} keys at position {start + queries - keys}: "
                         f"they end at the last query's position, start + {queries} - 1, so start must be at least "
                         f"{keys} - {queries} = {keys - queries}")


@without_autocast
def local_attention_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int, window: int,
                          pos_bias: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                          scale: float | None = None) -> torch.Tensor:
    r"""Causal sliding-window attention for a chunk of queries against explicit keys (used in decoding).

    Args:
        q: ``[B, Tq, H, D]`` at absolute positions ``start .. start + Tq - 1``.
        k, v: ``[B, Tk, H, D]``, ``Tk >= Tq``, at positions ending with the queries' last position.
        key_mask: ``[B, Tk]`` bool, True for real keys.
    Returns:
        ``[B, Tq, H, D]``; costs ``O(Tq Tk D)``, so keep ``Tk`` near ``2w``.
    """
    check_window(window)
    check_matching(q=q, k=k, v=v, same_length=False)
    check_pos_bias(pos_bias, q.shape[2], window, causal=True)
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; they must match")
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    if Tk < Tq:
        raise ValueError(f"k and v hold {Tk} positions, fewer than the {Tq} queries: they end with the queries' "
                         "positions and hold at least those")
    check_padding_mask(key_mask, B, Tk, "key_mask", axes="B, Tk", device=k.device)
    check_start(start, Tq, Tk)
    k, v = zero_padding(key_mask, k, v)
    return chunk_attention(q, k, v, start=start, window=window, pos_bias=pos_bias, key_mask=key_mask,
                           scale=query_scale(scale, D))


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int, window: int,
                    pos_bias: torch.Tensor | None, key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """:func:`local_attention_chunk` after its checks, for callers whose inputs are checked, whose padded keys
    are zeros and whose autocast is off already (LAVO's cached op, a piece at a time)."""
    Tq, Tk = q.shape[1], k.shape[1]
    q_pos = torch.arange(start, start + Tq, device=q.device)
    k_pos = torch.arange(start + Tq - Tk, start + Tq, device=q.device)
    offset = q_pos[:, None] - k_pos[None, :]
    allowed = (offset >= 0) & (k_pos[None, :] >= (q_pos[:, None] // window - 1) * window)
    wide = accumulation_dtype(q.dtype)  # 16-bit inputs: the softmax in float32, as in local_attention
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(wide) * scale, k.to(wide))
    if pos_bias is not None:
        scores = scores + pos_bias[:, offset.clamp(0, 2 * window - 1)].to(wide)
    allowed = allowed if key_mask is None else allowed & key_mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, neg_inf(wide))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1).to(v.dtype), v)
