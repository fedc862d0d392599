"""Sliding-window attention with a learned relative-position bias: LAVO's local branch.

Windows have length ``w``; position ``t`` lies in window ``c(t) = t // w``. A causal query sees keys
``[(c(t) - 1) w, t]``; a non-causal one sees the previous, its own and the next window. The fast form works on
blocks of ``w`` queries against their ``2w`` (or ``3w``) neighbouring keys, so time is ``O(T w D)`` and memory
``O(T w)``.
"""
from __future__ import annotations

import torch
from einops import rearrange

from .checks import check_padding_mask, check_pos_bias, check_same_shape, check_window


def neg_inf(dtype: torch.dtype) -> float:
    """A finite stand-in for -inf: masked rows stay NaN-free, and exp() of it is exactly zero."""
    return torch.finfo(dtype).min


def _with_neighbours(x: torch.Tensor, dim: int, causal: bool) -> torch.Tensor:
    r"""Concatenate each block with its neighbours.

    Args:
        x: blocked tensor, block index at ``dim`` and in-block position at ``dim + 1``.
    Returns:
        the same layout with ``dim + 1`` of size ``2w`` (previous, own) or ``3w`` (previous, own, next);
        missing neighbours are zeros.
    """
    n = x.shape[dim]
    zero = torch.zeros_like(x.narrow(dim, 0, 1))
    parts = [torch.cat([zero, x.narrow(dim, 0, n - 1)], dim), x]
    if not causal:
        parts.append(torch.cat([x.narrow(dim, 1, n - 1), zero], dim))
    return torch.cat(parts, dim + 1)


def block_bias(pos_bias: torch.Tensor | None, heads: int, window: int, causal: bool,
               dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    r"""Additive score bias for one block of queries against its neighbouring keys.

    Returns:
        ``[H, w, K]`` (``[1, w, K]`` without ``pos_bias``), ``K = 2w`` causal or ``3w``; future keys carry
        ``neg_inf``.
    """
    w = window
    a = torch.arange(w, device=device)[:, None]
    b = torch.arange(3 * w if not causal else 2 * w, device=device)[None, :]
    if causal:
        offset = w + a - b  # t - j, in [-(w - 1), 2w - 1]
        allowed = offset >= 0
        index = offset.clamp(min=0)
    else:
        index = b - a + w - 1  # (j - t) + 2w - 1, in [0, 4w - 2]
        allowed = torch.ones_like(index, dtype=torch.bool)
    if pos_bias is None:
        bias = torch.zeros(1, w, b.shape[1], dtype=dtype, device=device)
    else:
        bias = pos_bias[:, index].to(dtype)
    return bias.masked_fill(~allowed, neg_inf(dtype))


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, causal: bool = True,
                    pos_bias: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    r"""Blocked sliding-window attention.

    Args:
        q, k, v: ``[B, T, H, D]``.
        window: ``w``, the window length.
        pos_bias: ``[H, 2w]`` (causal, indexed by ``t - j``) or ``[H, 4w - 1]`` (non-causal, ``j - t + 2w - 1``).
        padding_mask: ``[B, T]`` bool, True for real tokens. Padded keys are never attended to; padded queries
            return zeros.
        scale: defaults to ``D ** -0.5``.
    Returns:
        ``[B, T, H, D]``.
    """
    check_window(window)
    check_same_shape(q=q, k=k, v=v)
    B, T, H, D = q.shape
    check_pos_bias(pos_bias, H, window, causal)
    check_padding_mask(padding_mask, B, T)
    scale = D ** -0.5 if scale is None else scale
    w = window
    n = -(-T // w)
    pad = n * w - T

    def to_blocks(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return rearrange(x, "b (n w) h d -> b h n w d", w=w)

    qb = to_blocks(q * scale)
    kb = _with_neighbours(to_blocks(k), 2, causal)
    vb = _with_neighbours(to_blocks(v), 2, causal)

    real = torch.ones(B, T, dtype=torch.bool, device=q.device) if padding_mask is None else padding_mask
    key_valid = _with_neighbours(torch.nn.functional.pad(real, (0, pad)).view(B, n, w), 1, causal)  # [B, n, K]

    scores = qb @ kb.transpose(-1, -2)  # [B, H, n, w, K]
    scores.add_(block_bias(pos_bias, H, w, causal, scores.dtype, q.device).unsqueeze(1))
    fill = neg_inf(scores.dtype)
    if padding_mask is not None:
        scores.masked_fill_(~key_valid[:, None, :, None, :], fill)
    else:
        # Without padding only the first block (no previous window) and, non-causal, the last two (keys past T)
        # hold invalid keys; a causal query never reaches past T.
        edges = [slice(0, 1)] if causal else [slice(0, 1), slice(max(n - 2, 0), n)]
        for edge in edges:
            scores[:, :, edge].masked_fill_(~key_valid[:, None, edge, None, :], fill)
    out = scores.softmax(-1) @ vb
    out = rearrange(out, "b h n w d -> b (n w) h d")[:, :T]
    if padding_mask is not None:
        out = out * padding_mask[:, :, None, None].to(out.dtype)
    return out


def keep_visible(position: int, window: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    r"""Trim keys to what a causal query at ``position`` or later can still see.

    Args:
        position: tokens seen so far; each tensor's time axis (dim 1) ends at ``position - 1``.
        tensors: e.g. keys ``[B, L, H, D]`` and their mask ``[B, L]``.
    Returns:
        each tensor from the start of the previous window on: its last ``<= 2w - 1`` positions.
    """
    keep = position - max(0, (position // window - 1) * window)
    return tuple(t[:, t.shape[1] - keep:] for t in tensors)


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
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    q_pos = torch.arange(start, start + Tq, device=q.device)
    k_pos = torch.arange(start + Tq - Tk, start + Tq, device=q.device)
    offset = q_pos[:, None] - k_pos[None, :]
    allowed = (offset >= 0) & (k_pos[None, :] >= (q_pos[:, None] // window - 1) * window)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if pos_bias is not None:
        scores = scores + pos_bias[:, offset.clamp(0, 2 * window - 1)].to(scores.dtype)
    allowed = allowed if key_mask is None else allowed & key_mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, neg_inf(scores.dtype))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
