"""Sliding-window attention with a learned relative-position bias: LAVO's local branch.

Windows have length ``w``; position ``t`` lies in window ``c(t) = t // w``. A causal query sees keys
``[(c(t) - 1) w, t]``; a non-causal one sees the previous, its own and the next window. The fast form works on
blocks of ``w`` queries against their ``2w`` (or ``3w``) neighbouring keys, so time is ``O(T w D)``. Memory is
``O(T w)`` while the whole sequence's softmax weights fit in :data:`SAVED_WEIGHTS_LIMIT` elements (kept for
backward), and ``O(T D)`` plus a few blocks of scores beyond (recomputed block by block in backward).
"""
from __future__ import annotations

import torch
from einops import rearrange

from ..common import (accumulation_dtype, autocast_off, check_pos_bias, check_window_inputs, constant_scale,
                      first_order_only, neg_inf, pos_bias_size, uses_triton, zero_padding)


# Elements of scores computed at once: 4 MiB in float32, about what stays in cache.
SCORES_PER_CHUNK = 1 << 20
# Softmax weights of a whole sequence up to this many elements (64 MiB in float32) are kept for backward;
# longer sequences recompute them instead, so memory stays O(T D).
SAVED_WEIGHTS_LIMIT = 1 << 24
# Scores this far below their row's maximum are clamped before exp(): their weight is < 2e-35 either way.
EXP_FLOOR = -80.0


def _neighbours(x: torch.Tensor, c0: int, c1: int, causal: bool) -> torch.Tensor:
    r"""Blocks ``c0 .. c1 - 1`` of ``x [n, ..., w, D]`` with their neighbours along the in-block axis:
    ``[c1 - c0, ..., K, D]``, ``K = 2w`` (previous, own) or ``3w`` (also next); missing neighbours are zeros."""
    n = x.shape[0]

    def shifted(step: int) -> torch.Tensor:
        lo, hi = c0 + step, c1 + step
        part = x[max(lo, 0):min(hi, n)]
        pad = [0, 0] * (x.dim() - 1) + [max(0, -lo), max(0, hi - n)]
        return torch.nn.functional.pad(part, pad)

    return torch.cat([shifted(-1), x[c0:c1]] + ([] if causal else [shifted(1)]), -2)


def _add_neighbour_grads(grad: torch.Tensor, into: torch.Tensor, c0: int, c1: int, causal: bool) -> None:
    """Adjoint of :func:`_neighbours`: scatter-add ``grad [c, ..., K, D]`` back into ``into [n, ..., w, D]``."""
    n, w = into.shape[0], into.shape[-2]
    for part, step in enumerate((-1, 0) if causal else (-1, 0, 1)):
        lo, hi = max(c0 + step, 0), min(c1 + step, n)
        if lo < hi:
            into[lo:hi] += grad[lo - c0 - step:hi - c0 - step, ..., part * w:(part + 1) * w, :]


class _BlockedLocalAttention(torch.autograd.Function):
    """Softmax attention of each block of queries over its neighbouring key blocks, computed a few blocks at a
    time: scores never exist for the whole sequence. Backward recomputes them (as in FlashAttention) unless the
    whole sequence's weights fit in ``SAVED_WEIGHTS_LIMIT`` elements, so long inputs keep only the inputs and each
    query's score maximum and weight sum (``dO . O`` comes from the weights and ``dO V^T``, not the output). With
    these two (rather than their log-sum-exp) the recomputation repeats the forward's arithmetic, so its weights
    equal the saved ones in every dtype.

    16-bit inputs get the softmax in float32, as in FlashAttention and the Triton kernels: scores, weights and
    score gradients are float32 (from float32 copies of a few blocks at a time: torch has no 16-bit matmul with a
    float32 result), the products with ``v`` and the gradients of ``q`` and ``k`` take the weights and score
    gradients rounded to the input dtype, and key gradients are summed over neighbouring blocks in float32. Scores
    rounded to bfloat16 (spacing 0.125 at 30) made outputs 8 times less accurate than SDPA's on sharp heads."""

    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, bias, key_valid, causal, scale):
        # q, k, v: [n, B, H, w, D] (views are fine); bias: [H or 1, w, K] float32 or wider; key_valid: [n, B, K].
        n, K = q.shape[0], bias.shape[-1]
        wide = accumulation_dtype(q.dtype)
        scores_per_block = q[0].numel() // q.shape[-1] * K
        chunk = max(1, SCORES_PER_CHUNK // scores_per_block)
        # Which blocks have a masked key, to skip masking the others; a compiled graph cannot read it, so masks all.
        masked = [True] * n if torch.compiler.is_compiling() else (~key_valid).flatten(1).any(1).tolist()
        keep_weights = n * scores_per_block <= SAVED_WEIGHTS_LIMIT
        allowed = _allowed_keys(bias, causal)
        # Outputs and gradients are contiguous blocks: matmul into strided slices of a [B, T, H, D] layout copies
        # through a temporary at every chunk, which cost far more than one copy back at the end.
        out = q.new_empty(q.shape)
        peaks, totals = (q.new_empty(*q.shape[:-1], 1, dtype=wide) for _ in range(2))
        saved = q.new_empty(*q.shape[:-1], K, dtype=wide) if keep_weights else None
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            weights, peak = _block_weights(q[c0:c1], _neighbours(k, c0, c1, causal), scale, bias, key_valid, masked,
                                           c0, allowed, into=saved[c0:c1] if keep_weights else None)
            total = weights.sum(-1, keepdim=True).clamp_(min=torch.finfo(weights.dtype).tiny)  # 0: no key at all
            weights.div_(total)
            peaks[c0:c1], totals[c0:c1] = peak, total
            torch.matmul(weights.to(v.dtype), _neighbours(v, c0, c1, causal), out=out[c0:c1])
        ctx.save_for_backward(q, k, v, bias, key_valid, peaks, totals, saved)
        ctx.causal, ctx.chunk, ctx.masked, ctx.scale = causal, chunk, masked, scale
        return out

    @staticmethod
    @first_order_only("The sliding-window attention (PyTorch path)",
                      "lavo.ops.local_attention_naive or lavo_attention_naive")
    @autocast_off
    def backward(ctx, grad_out):
        q, k, v, bias, key_valid, peaks, totals, saved = ctx.saved_tensors
        causal, chunk, masked, scale = ctx.causal, ctx.chunk, ctx.masked, ctx.scale
        wide = peaks.dtype
        grad_q = q.new_empty(q.shape)
        grad_k, grad_v = k.new_zeros(k.shape, dtype=wide), v.new_zeros(v.shape, dtype=wide)
        grad_bias = torch.zeros_like(bias)
        allowed = _allowed_keys(bias, causal) if saved is None else None
        for c0 in range(0, q.shape[0], chunk):
            c1 = min(q.shape[0], c0 + chunk)
            queries = q[c0:c1] * scale
            keys, values = _neighbours(k, c0, c1, causal), _neighbours(v, c0, c1, causal)
            if saved is None:
                weights, _ = _block_weights(q[c0:c1], keys, scale, bias, key_valid, masked, c0, allowed, peaks[c0:c1])
                weights.div_(totals[c0:c1])
            else:
                weights = saved[c0:c1]
            grad = grad_out[c0:c1]
            _add_neighbour_grads(weights.to(grad.dtype).transpose(-1, -2) @ grad, grad_v, c0, c1, causal)
            grad_weights = grad.to(wide) @ values.to(wide).transpose(-1, -2)
            # dO . O from the weights' own products, not from the output rounded to 16 bits (13 to 15 times the
            # error of the q and k gradients when the values share an offset)
            row_dot = (grad_weights * weights).sum(-1, keepdim=True)
            grad_scores = grad_weights.sub_(row_dot).mul_(weights)
            if ctx.needs_input_grad[3]:
                grad_bias += grad_scores.sum_to_size(bias.shape)
            grad_scores = grad_scores.to(q.dtype)
            torch.matmul(grad_scores, keys, out=grad_q[c0:c1]).mul_(scale)
            _add_neighbour_grads(grad_scores.transpose(-1, -2) @ queries, grad_k, c0, c1, causal)
        return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype), grad_bias, None, None, None


def _allowed_keys(bias: torch.Tensor, causal: bool) -> torch.Tensor | None:
    """``[H or 1, w, K]``, 1 where the causal bias lets a query see a key and 0 at the keys after it (``neg_inf``
    in its bias, or a -inf given); None when every key is in reach (non-causal)."""
    return (bias > neg_inf(bias.dtype)).to(bias.dtype) if causal else None


def _block_weights(q, keys, scale, bias, key_valid, masked, c0, allowed, shift=None, into=None):
    """Unnormalised softmax weights ``exp(score - shift)`` of the query blocks ``q`` starting at block ``c0``:
    ``[c, B, H, w, K]`` in float32 for 16-bit inputs (from float32 copies of ``q`` and ``keys``), exactly zero
    where masked (padded keys, and where ``allowed`` from :func:`_allowed_keys` is 0). ``shift`` defaults to each
    row's maximum; returns it too. ``into``: a contiguous buffer to compute them in (the weights kept for backward),
    or None."""
    wide = accumulation_dtype(q.dtype)
    scores = torch.matmul(q.to(wide) * scale, keys.to(wide).transpose(-1, -2), out=into)
    scores += bias
    c1 = c0 + scores.shape[0]
    padded = any(masked[c0:c1])
    if padded:
        scores.masked_fill_(~key_valid[c0:c1, :, None, None, :], neg_inf(scores.dtype))
    shift = scores.amax(-1, keepdim=True) if shift is None else shift
    # exp() of a value that underflows takes a slow path on CPU (about 10x); clamp, then zero what is masked.
    weights = scores.sub_(shift).clamp_(min=EXP_FLOOR).exp_()
    # Zeroed by products with 0/1 masks, exact on these finite weights: a broadcast masked_fill_ is several times
    # slower on CPU.
    if padded:
        weights.mul_(key_valid[c0:c1, :, None, None, :])
    if allowed is not None:
        weights.mul_(allowed)
    return weights, shift


def causal_window_mask(window: int, device: torch.device | None = None) -> torch.Tensor:
    """``[w, 2w]`` bool: which of its ``2w`` neighbouring keys (previous and own block) each query may see."""
    a = torch.arange(window, device=device)[:, None]
    b = torch.arange(2 * window, device=device)[None, :]
    return b <= window + a


def block_bias(pos_bias: torch.Tensor | None, window: int, causal: bool, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    r"""Additive score bias for one block of queries against its neighbouring keys.

    Returns:
        ``[H, w, K]`` (``[1, w, K]`` without ``pos_bias``), ``K = 2w`` causal or ``3w``; future keys carry
        ``neg_inf``.
    """
    w = window
    a = torch.arange(w, device=device)[:, None]
    b = torch.arange(3 * w if not causal else 2 * w, device=device)[None, :]
    if causal:
        index = (w + a - b).clamp(min=0)  # t - j, in [0, 2w - 1] where allowed
    else:
        index = b - a + w - 1  # (j - t) + 2w - 1, in [0, 4w - 2]
    if pos_bias is None:
        bias = torch.zeros(1, w, b.shape[1], dtype=dtype, device=device)
    else:
        bias = pos_bias[:, index].to(dtype)
    return bias.masked_fill(~causal_window_mask(w, device), neg_inf(dtype)) if causal else bias


def blocking_window(window: int, length: int, pos_bias: torch.Tensor | None,
                    causal: bool) -> tuple[int, torch.Tensor | None]:
    """The block length to compute a sequence of ``length`` positions in, and the part of the position table it
    uses. A sequence shorter than its window lies in one window, where every query sees every key the rule allows
    (the earlier ones, causal; all, non-causal) at offsets below ``length``: blocks of ``length`` give the same
    result on a ``T x 2T`` score table instead of ``w x 2w`` (whose float32 ``[H, w, 2w]`` bias alone is 2 GiB at
    ``H = 4, w = 8192``)."""
    if length >= window:
        return window, pos_bias
    if pos_bias is not None:  # causal: offsets t - j from 0; non-causal: j - t from -(T - 1), at 2w - 1 + (j - t)
        start = 0 if causal else 2 * (window - length)
        pos_bias = pos_bias[:, start:start + pos_bias_size(length, causal)]
    return length, pos_bias


def to_blocks(x: torch.Tensor, window: int) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[n, B, H, w, D]``, zero-padded to ``n = ceil(T / w)`` whole windows; a view when
    ``T`` is a multiple of ``w``."""
    pad = -x.shape[1] % window
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
    return rearrange(x, "b (n w) h d -> n b h w d", w=window)


def from_blocks(x: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: ``[n, B, H, w, D]`` -> ``[B, T, H, D]``."""
    return rearrange(x, "n b h w d -> b (n w) h d")[:, :length]


def real_tokens(padding_mask: torch.Tensor | None, batch: int, length: int, window: int,
                device: torch.device) -> torch.Tensor:
    """``[n, B, w]`` bool: True at real tokens, False at padding and past the end."""
    real = torch.ones(batch, length, dtype=torch.bool, device=device) if padding_mask is None else padding_mask
    return torch.nn.functional.pad(real, (0, -length % window)).view(batch, -1, window).transpose(0, 1)


def blocked_local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, *,
                            causal: bool, pos_bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    r"""Sliding-window attention on blocked inputs (see :func:`to_blocks`).

    Args:
        q, k, v: ``[n, B, H, w, D]``.
        real: ``[n, B, w]`` bool from :func:`real_tokens`.
    Returns:
        ``[n, B, H, w, D]``; rows of padded queries hold garbage, the caller masks them.
    """
    n, w = q.shape[0], q.shape[3]
    key_valid = _neighbours(real[..., None], 0, n, causal)[..., 0]  # [n, B, K]
    bias = block_bias(pos_bias, w, causal, accumulation_dtype(q.dtype), q.device)
    return _BlockedLocalAttention.apply(q, k, v, bias, key_valid, causal, scale)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, causal: bool = True,
                    pos_bias: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                    scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    r"""Blocked sliding-window attention, or its Triton kernel (:mod:`.kernels`).

    Args:
        q, k, v: ``[B, T, H, D]``.
        window: ``w``, the window length.
        pos_bias: ``[H, 2w]`` (causal, indexed by ``t - j``) or ``[H, 4w - 1]`` (non-causal, ``j - t + 2w - 1``).
        padding_mask: ``[B, T]`` bool, True for real tokens. Padded keys are never attended to; padded queries
            return zeros.
        scale: defaults to ``D ** -0.5``.
        backend: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton for CUDA tensors when Triton 3.3+ is installed).
    Returns:
        ``[B, T, H, D]``.
    """
    check_window_inputs(q, k, v, window, padding_mask)
    B, T, H, D = q.shape
    check_pos_bias(pos_bias, H, window, causal)
    scale = constant_scale(scale, D)
    q, k, v = zero_padding(padding_mask, q, k, v)
    if uses_triton(backend, q):
        from .kernels import window_attention
        out = window_attention(q, k, v, window=window, causal=causal, pos_bias=pos_bias, padding_mask=padding_mask,
                               scale=scale)
    else:
        window, pos_bias = blocking_window(window, T, pos_bias, causal)
        out = blocked_local_attention(to_blocks(q, window), to_blocks(k, window), to_blocks(v, window),
                                      real_tokens(padding_mask, B, T, window, q.device), causal=causal,
                                      pos_bias=pos_bias, scale=scale)
        out = from_blocks(out, T)
    return zero_padding(padding_mask, out)[0]

