r"""Long-short attention (Transformer-LS, Zhu et al., 2021): a sliding window plus dynamic low-rank projections.

Short term: LAVO's window rule (windows of ``w``; a causal query at ``t`` sees keys ``[(c - 1) w, t]`` with
``c = t // w``, a non-causal one the previous, own and next windows), masked by :func:`lavo.ops.local.block_bias`,
without position bias.

Long range: keys and values are compressed into ``r`` landmarks with a dynamic projection ``P = softmax(K W_p)``,
``W_p [H, D, r]``, the softmax running over positions: ``K_bar = P^T K``, ``V_bar = P^T V``. Non-causal, ``P``
covers the whole sequence; causal, each completed segment of ``w`` positions has its own ``r`` landmarks, and a
query in window ``c`` sees the landmarks of segments ``0 .. c - 1``. Each query takes one softmax over its window
keys and its landmarks together. With the paper's DualLN, the window keys and values go through one layer norm
and the landmark keys and values through another (each over the ``H D`` features of a position), which the paper
finds keeps the two sets of scores on one scale.

The landmark scores cost ``O(T (T / w) r D)`` causal (``O(T r D)`` non-causal); the window ``O(T w D)``.
"""
from __future__ import annotations

import torch
from einops import rearrange
from torch.nn.functional import layer_norm, pad

from ..common import accumulation_dtype, check_window_inputs, neg_inf, query_scale, without_autocast
from ..local.blocked import block_bias

DualNorm = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _windows(x: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """The keys around each block: ``x [B, T, ...]`` -> ``[B, n, ..., K]`` (``K = 2w`` causal, else ``3w``), zero
    where the window runs past the sequence. Block ``c`` starts at position ``(c - 1) w``."""
    T = x.shape[1]
    n = -(-T // window)
    after = n * window - T + (0 if causal else window)
    blocks = pad(x, [0, 0] * (x.dim() - 2) + [window, after]).unflatten(1, (-1, window))
    # Shifted copies, not overlapping unfold() windows: Inductor's unfold backward sums overlaps wrongly
    # (pytorch/pytorch#171370), so a compiled model would get wrong gradients.
    neighbours = torch.cat([blocks[:, step:step + n] for step in range(2 if causal else 3)], 2)
    return neighbours.movedim(2, -1)


def _landmarks(k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, real: torch.Tensor,
               segment: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Dynamic projection of each segment (the whole sequence when ``segment`` is None).

    Args:
        k, v: ``[B, T, H, D]``; projection: ``W_p [H, D, r]``; real: ``[B, T]`` bool.
    Returns:
        keys, values ``[B, S, H, r, D]`` and valid ``[B, S]`` (the segment has a real token), ``S`` segments.
    """
    T = k.shape[1]
    size = T if segment is None else segment
    after = -(-T // size) * size - T
    logits = pad(torch.einsum("bthd,hdr->bthr", k, projection), (0, 0, 0, 0, 0, after))
    real = pad(real, (0, after))
    logits = logits.masked_fill(~real[:, :, None, None], neg_inf(logits.dtype))
    weights = rearrange(logits, "b (s l) h r -> b s l h r", l=size).softmax(2)  # over the segment's positions
    keys, values = (torch.einsum("bslhr,bslhd->bshrd", weights, rearrange(pad(x, (0, 0, 0, 0, 0, after)),
                                                                               "b (s l) h d -> b s l h d", l=size))
                    for x in (k, v))
    return keys, values, real.view(real.shape[0], -1, size).any(-1)


def _norm(x: torch.Tensor, weight_and_bias: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Layer norm over the last two axes (heads and features) of ``x [..., H, D]``; None: ``x`` unchanged."""
    if weight_and_bias is None:
        return x
    weight, bias = weight_and_bias
    return layer_norm(x.flatten(-2), weight.shape, weight, bias).view_as(x)


def longshort_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *,
                        window: int, causal: bool = True, padding_mask: torch.Tensor | None = None,
                        scale: float | None = None, dual_norm: DualNorm | None = None) -> torch.Tensor:
    r"""Transformer-LS attention, blocked.

    Args:
        q, k, v: ``[B, T, H, D]``.
        projection: ``W_p [H, D, r]``.
        window: ``w``, the window and (causal) segment length.
        padding_mask: ``[B, T]`` bool, True for real tokens; padding is never attended to and returns zeros.
        scale: defaults to ``D ** -0.5``.
        dual_norm: DualLN, ``((weight, bias), (weight, bias))`` ``[H D]`` each: the layer norm of the window keys
            and values, then that of the landmark keys and values. None: no normalisation.
    Returns:
        ``[B, T, H, D]`` in ``q``'s dtype, computed in float32 for 16-bit inputs (as ABC is): scores and both
        softmaxes in bfloat16 made outputs and gradients 9 to 27 times float32's error on sharp heads
        (tests/test_16_bit_numerics.py).
    """
    check_window_inputs(q, k, v, window, padding_mask)
    B, T, H, D = q.shape
    if projection.dim() != 3 or projection.shape[:2] != (H, D):
        raise ValueError(f"projection must have shape [H, D, r] with H={H}, D={D}, got {tuple(projection.shape)}")
    scale = query_scale(scale, D)
    wide = accumulation_dtype(q.dtype)
    if dual_norm is not None:
        dual_norm = tuple(tuple(x.to(wide) for x in pair) for pair in dual_norm)
    out = _longshort_attention(*(x.to(wide) for x in (q, k, v, projection)), window, causal, padding_mask, scale,
                               dual_norm)
    return out.to(q.dtype)


@without_autocast  # autocast would round the float32 products back
def _longshort_attention(q, k, v, projection, window, causal, padding_mask, scale, dual_norm):
    """:func:`longshort_attention` after its checks, in one dtype with autocast off."""
    B, T, H, D = q.shape
    w, n = window, -(-T // window)
    real = torch.ones(B, T, dtype=torch.bool, device=q.device) if padding_mask is None else padding_mask

    queries = rearrange(pad(q * scale, (0, 0, 0, 0, 0, n * w - T)), "b (n w) h d -> b h n w d", w=w)
    short_norm, long_norm = (None, None) if dual_norm is None else dual_norm
    local_keys, local_values = (rearrange(_windows(_norm(x, short_norm), w, causal), "b n h d k -> b h n k d")
                                for x in (k, v))
    local = queries @ local_keys.transpose(-1, -2) + block_bias(None, w, causal, q.dtype, q.device)  # [B, H, n, w, K]
    local = local.masked_fill(~_windows(real, w, causal)[:, None, :, None, :], neg_inf(local.dtype))

    keys, values, valid = _landmarks(k, v, projection, real, w if causal else None)
    keys, values = (rearrange(_norm(x.transpose(2, 3), long_norm), "b s r h d -> b h (s r) d") for x in (keys, values))
    seen = valid[:, None, :]  # [B, 1 or n, S]: which landmark segments each block of queries may see
    if causal:
        block = torch.arange(n, device=q.device)
        seen = seen & (block[None, None, :] < block[None, :, None])
    far = torch.einsum("bhnwd,bhmd->bhnwm", queries, keys)
    far = far.masked_fill(~seen.repeat_interleave(projection.shape[2], -1)[:, None, :, None, :], neg_inf(far.dtype))

    # split(), not two slices: each slice's backward fills a zero tensor as large as all the weights
    near_weights, far_weights = torch.cat([local, far], -1).softmax(-1).split([local.shape[-1], far.shape[-1]], -1)
    out = near_weights @ local_values + torch.einsum("bhnwm,bhmd->bhnwd", far_weights, values)
    out = rearrange(out, "b h n w d -> b (n w) h d")[:, :T]
    return out * real[:, :, None, None].to(out.dtype)
