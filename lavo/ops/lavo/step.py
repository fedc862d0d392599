r"""One decoding step of causal LAVO on a :class:`~lavo.cache.LavoStepCache`, updating it in place: the form
generation runs on the GPU, where a step must not depend on the context nor on the host.

Both backends read the position from the cache's ``steps`` tensor and never from the host, so a step can be
captured in a CUDA graph: ``"triton"`` is one kernel per step (:mod:`.step_kernel`), ``"torch"`` a few dozen small
ops (also what runs for float64 and off CUDA). Each gives what :func:`.decoding.lavo_attention_cached` gives for
one token: the local attention over the ring's visible keys plus the new one, with the relative-position bias,
the memory read (context dissection: the memory of the completed windows; without it, of every token so far), the
average, and the memory's running sums with the new projection, folded into the memory at a window's end. The
memory variants (other write rules, the vector memory) decode through :class:`~lavo.cache.LavoCache` instead.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ...cache import LavoStepCache, check_kind, check_made_by, read_only_here
from ..common import accumulation_dtype, constant_scale, neg_inf, uses_triton, zero_padding
from .blocked import check_inputs, check_read_scale, scaled_queries
from .memory import memory_read, project


def lavo_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor, cache: LavoStepCache,
                     *, pos_bias: torch.Tensor | None = None, dissection: bool = True,
                     padding_mask: torch.Tensor | None = None, scale: float | None = None,
                     read_scale: torch.Tensor | None = None, backend: str = "auto"
                     ) -> tuple[torch.Tensor, LavoStepCache]:
    r"""Causal LAVO for the next token, continuing from ``cache`` and updating it in place.

    Args:
        q, k, v: ``[B, 1, H, D]``, the next position.
        basis: ``[H, r, D]``.
        cache: a :class:`LavoStepCache` after the previous positions; it is consumed (see there).
        pos_bias: ``[H, 2w]`` or None; ``padding_mask``: ``[B, 1]`` bool or None; ``scale``: default ``D^-0.5``;
            ``read_scale``: ``[H]`` factors on the memory read's logits, or None.
        backend: ``"triton"`` (the fused kernel), ``"torch"``, or ``"auto"``: the kernel for CUDA tensors when
            Triton 3.3+ is installed (:func:`~lavo.ops.common.uses_triton`).
    Returns:
        ``[B, 1, H, D]`` and the cache one position on (the same tensors).
    """
    check_kind(cache, LavoStepCache, "lavo_decode_step", "make one from a LavoCache with "
               "LavoStepCache.from_cache(cache, window), or layer.step_cache(cache)")
    window = cache.window
    check_inputs(q, k, v, basis, window, True, pos_bias, padding_mask)
    check_read_scale(read_scale, q.shape[2])
    B, T, H, D = q.shape
    if T != 1:
        raise ValueError(f"a decoding step takes one position, got q of shape {tuple(q.shape)}")
    # the weights too: a trainable position bias alone once ran, and its backward met the overwritten cache
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, basis, pos_bias, read_scale)):
        raise ValueError("a decoding step updates its cache in place and has no backward; run it under "
                         "torch.no_grad() (or decode through LavoCache to differentiate)")
    fits = (cache.batch_size, cache.keys.shape[1], cache.keys.shape[3], cache.memory_sum.shape[2])
    if fits != (B, H, D, basis.shape[1]):
        raise ValueError(f"the cache holds (batch, heads, head_dim, rank) = {fits}, the inputs "
                         f"{(B, H, D, basis.shape[1])}")
    check_made_by(cache, dissection=dissection)
    cache.check_dtype(q.dtype)
    if read_only_here(cache.keys):
        raise ValueError("this LavoStepCache was made under torch.inference_mode(), whose tensors torch lets only "
                         "inference mode update in place, as a step does: take the steps under "
                         "torch.inference_mode() too, or make the step cache outside it (layer.step_cache(cache) "
                         "of the LavoCache a call returned)")
    scale = constant_scale(scale, D)
    q, k, v = zero_padding(padding_mask, q, k, v)
    real = torch.ones(B, dtype=torch.bool, device=q.device) if padding_mask is None else padding_mask[:, 0]
    if uses_triton(backend, q):
        from .step_kernel import decode_step_triton
        out = decode_step_triton(q, k, v, basis, cache, pos_bias=pos_bias, dissection=dissection, real=real,
                                 scale=scale, read_scale=read_scale)
    else:
        out = _decode_step_torch(q, k, v, basis, cache, pos_bias=pos_bias, dissection=dissection, real=real,
                                 scale=scale, read_scale=read_scale)
    return out, replace(cache, position=cache.position + 1, dissection=dissection)


def _ring_positions(steps: torch.Tensor, span: int) -> torch.Tensor:
    """The position each ring slot holds once position ``steps [B, H]`` is written: ``[B, H, span]``, the latest
    ``j <= steps`` with ``j = slot mod span`` (negative for a slot not yet written)."""
    here = steps[..., None]
    return here - (here - torch.arange(span, device=steps.device)) % span


def _decode_step_torch(q, k, v, basis, cache: LavoStepCache, *, pos_bias, dissection, real, scale, read_scale):
    """:func:`lavo_decode_step` in torch ops, with no host synchronisation (so it can be captured too)."""
    window, span = cache.window, 2 * cache.window
    position = cache.steps  # [B, H]
    slot = (position % span)[..., None, None].expand(*position.shape, 1, q.shape[3])
    cache.keys.scatter_(2, slot, k.transpose(1, 2).to(cache.keys.dtype))
    cache.values.scatter_(2, slot, v.transpose(1, 2).to(cache.values.dtype))
    cache.key_mask.scatter_(1, slot[:, :1, 0, 0], real[:, None])
    held = _ring_positions(position, span)  # [B, H, 2w]
    first_seen = ((position // window - 1) * window).clamp(min=0)[..., None]
    visible = (held >= first_seen) & cache.key_mask[:, None, :]
    wide = accumulation_dtype(q.dtype)  # 16-bit inputs: the softmax in float32, as in the local op's chunk form
    scores = torch.einsum("bhd,bhsd->bhs", q[:, 0].to(wide) * scale, cache.keys.to(wide))
    if pos_bias is not None:
        offsets = (position[..., None] - held).clamp(0, span - 1)
        scores = scores + pos_bias.to(wide).expand(q.shape[0], -1, -1).gather(2, offsets)
    weights = scores.masked_fill(~visible, neg_inf(wide)).softmax(-1).to(cache.values.dtype)
    local = torch.einsum("bhs,bhsd->bhd", weights, cache.values)[:, :, None]  # [B, H, 1, D]
    counts = real.to(cache.memory_sum.dtype)[:, None].expand(position.shape)  # [B, H]
    proj = project(local if dissection else v.transpose(1, 2), basis)[:, :, 0] * counts[..., None]  # [B, H, r]
    if dissection:
        coefficients = cache.memory_sum / cache.memory_count.clamp(min=1)[..., None]
    else:
        seen = cache.memory_count + cache.window_count + counts
        coefficients = (cache.memory_sum + cache.window_sum + proj) / seen.clamp(min=1)[..., None]
    queries = scaled_queries(q.transpose(1, 2), read_scale)
    read = memory_read(queries, coefficients[:, :, None], basis, scale)
    out = ((local + read) / 2 * real[:, None, None, None].to(q.dtype)).transpose(1, 2)
    cache.window_sum.add_(proj)
    cache.window_count.add_(counts)
    ends = ((position + 1) % window == 0).to(counts.dtype)  # [B, H]: 1 where this token ends a window
    cache.memory_sum.add_(cache.window_sum * ends[..., None])
    cache.memory_count.add_(cache.window_count * ends)
    cache.window_sum.mul_(1 - ends[..., None])
    cache.window_count.mul_(1 - ends)
    cache.steps.add_(1)
    return out
