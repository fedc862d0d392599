r"""Attention with bounded-memory control (ABC, Peng et al., 2022), learned-control variant.

Each head keeps ``r`` memory slots. Token ``i`` has control logits ``a_i = W_phi k_i`` (``W_phi [H, r, D]``, one
linear layer as in the paper's ABC_MLP, applied here to the head's key rather than to the layer input). Slot ``s``
holds a convex combination of the keys and values, weighted by a softmax *over time* of the control logits:

    alpha_{i,s} = exp(a_{i,s}) / sum_j exp(a_{j,s}),   K~_s = sum_i alpha_{i,s} k_i,   V~_s = sum_i alpha_{i,s} v_i,

and a query reads ``softmax(q K~^T / sqrt(D)) V~``. Non-causal, ``i, j`` run over all real tokens. Causal, the memory
of step ``t`` uses the prefix ``i, j <= t``: the partition function is that of the whole prefix, so an early token's
weight shrinks as later tokens arrive (not each step's own normalisation).

The causal form keeps unnormalised prefix sums scaled by ``exp(-m)``, in at least float32 (float16 autocast is
turned off: the normalisers' inverses overflow float16), with ``m`` the maximum of the logits up to the end of the
current chunk of positions (detached: the result does not depend on it): ``O(T r D)`` time and memory, and the
same sums are the constant-size decoding cache. Outputs and gradients are exact unless, inside one chunk, a slot's
logit rises more than ~80 (float32) above every earlier logit of that slot: those earlier sums underflow.
``chunk=1`` never underflows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache import Cache
from ..common import (accumulation_dtype, check_matching, check_padding_mask, neg_inf, query_scale, reciprocal,
                      without_autocast)


@dataclass(frozen=True)
class ABCCache(Cache):
    r"""Constant-size causal cache: the memory after all tokens so far, unnormalised.

    Attributes:
        reference: ``[B, H, r]`` the running maximum ``m`` of the real tokens' control logits.
        keys, values: ``[B, H, r, D]`` ``sum_i exp(a_i - m) k_i`` and ``sum_i exp(a_i - m) v_i``.
        normaliser: ``[B, H, r]`` ``sum_i exp(a_i - m)``.
        All in the accumulation dtype (float32, or float64 for float64 inputs).
        position: tokens seen so far, padding included.
    """

    reference: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    normaliser: torch.Tensor
    position: int

    def check_dtype(self, dtype: torch.dtype) -> None:
        self.check_sums_dtype(self.keys, dtype)

    @classmethod
    def empty(cls, batch: int, heads: int, slots: int, head_dim: int, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> ABCCache:
        """The cache before the first token, for inputs of ``dtype``."""
        dtype = accumulation_dtype(torch.get_default_dtype() if dtype is None else dtype)
        memory = torch.zeros(batch, heads, slots, head_dim, dtype=dtype, device=device)
        normaliser = torch.zeros(batch, heads, slots, dtype=dtype, device=device)
        return cls(torch.full_like(normaliser, neg_inf(dtype)), memory, memory, normaliser, 0)


def _logits(k: torch.Tensor, control: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """Control logits ``[B, T, H, r]``; padding gets ``neg_inf``."""
    logits = torch.einsum("bthd,hrd->bthr", k, control)
    if padding_mask is None:
        return logits
    return logits.masked_fill(~padding_mask[:, :, None, None], neg_inf(logits.dtype))


def _read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, normaliser: torch.Tensor,
          scale: float) -> torch.Tensor:
    r"""``softmax(q K~^T scale) V~`` with ``K~ = keys / normaliser``.

    Args:
        q: ``[B, T, H, D]``.
        keys, values: ``[B, T or 1, H, r, D]`` unnormalised memories; normaliser ``[B, T or 1, H, r]``.
    Returns:
        ``[B, T, H, D]``.
    """
    inverse = reciprocal(normaliser)
    scores = torch.einsum("bthd,bthrd->bthr", q * scale, keys) * inverse
    return torch.einsum("bthr,bthrd->bthd", scores.softmax(-1) * inverse, values)


def _causal_chunk(q, k, v, logits, real, cache: ABCCache, scale: float) -> tuple[torch.Tensor, ABCCache]:
    """Causal ABC over one chunk of ``C`` positions, continuing ``cache``: head-major ``q, k, v [B, H, C, D]``,
    ``logits [B, H, C, r]``, ``real [B, C]`` -> ``[B, H, C, D]`` and the cache after them.

    Inside the chunk the prefix memories are never formed per token: with the masked ``[C, C]`` products
    ``q k^T`` and ``p w^T``, reading them costs ``O(C (C + r) D)``."""
    reference = torch.maximum(cache.reference, logits.amax(2)).detach()
    carry = torch.exp(cache.reference - reference)  # rescales the earlier sums to the new reference
    weights = torch.exp(logits - reference[:, :, None]) * real[:, None, :, None]  # [B, H, C, r]
    normaliser = carry[:, :, None] * cache.normaliser[:, :, None] + weights.cumsum(2)
    # a slot's logit far above its earlier ones in the chunk leaves their normalisers tiny (reciprocal: no overflow
    # in the backward)
    inverse = reciprocal(normaliser)
    old_keys, old_values = carry[..., None] * cache.keys, carry[..., None] * cache.values  # [B, H, r, D]
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
    q = q * scale
    qk = (q @ k.transpose(-1, -2)) * causal
    scores = (qk @ weights + q @ old_keys.transpose(-1, -2)) * inverse
    probs = scores.softmax(-1) * inverse
    mixing = (probs @ weights.transpose(-1, -2)) * causal
    out = mixing @ v + probs @ old_values
    keys = old_keys + weights.transpose(-1, -2) @ k
    values = old_values + weights.transpose(-1, -2) @ v
    return out, ABCCache(reference, keys, values, normaliser[:, :, -1], cache.position + q.shape[2])


def abc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, control: torch.Tensor, *, causal: bool = True,
                  padding_mask: torch.Tensor | None = None, cache: ABCCache | None = None,
                  scale: float | None = None, chunk: int = 64) -> tuple[torch.Tensor, ABCCache | None]:
    r"""ABC attention with learned control.

    Args:
        q, k, v: ``[B, T, H, D]``.
        control: ``W_phi``, ``[H, r, D]``.
        padding_mask: ``[B, T]`` bool, True for real tokens; padding is never written, and its output is zero.
        cache: causal only, the cache after earlier positions (None: start of the sequence).
        scale: defaults to ``D ** -0.5``.
        chunk: causal positions per step; bounds the working set to ``O(chunk r D)`` per batch and head.
    Returns:
        ``[B, T, H, D]`` and, causal, the cache after these positions (None when non-causal).
    """
    check_matching(q=q, k=k, v=v)
    B, T, H, D = q.shape
    check_padding_mask(padding_mask, B, T, device=q.device)
    if control.dim() != 3 or control.shape[0] != H or control.shape[2] != D:
        raise ValueError(f"control must have shape [H, r, D] with H={H}, D={D}, got {tuple(control.shape)}")
    if cache is not None and not causal:
        raise ValueError("a cache exists only for causal attention (causal=False was given)")
    if cache is not None and tuple(cache.keys.shape)[1:] != (H, control.shape[1], D):
        raise ValueError(f"the cache holds memories [B, H, slots, D] = {tuple(cache.keys.shape)}, this call "
                         f"{(B, H, control.shape[1], D)}: pass the cache the previous call returned")
    scale = query_scale(scale, D)
    return _abc_attention(q, k, v, control, causal, padding_mask, cache, scale, chunk)


@without_autocast  # bfloat16 autocast would undo the float32 casts inside
def _abc_attention(q, k, v, control, causal, padding_mask, cache, scale, chunk):
    """:func:`abc_attention` after its checks."""
    B, T, H, D = q.shape
    out_dtype = q.dtype
    q, k, v, control = (x.to(accumulation_dtype(out_dtype)) for x in (q, k, v, control))
    real = torch.ones(B, T, dtype=q.dtype, device=q.device) if padding_mask is None else padding_mask.to(q.dtype)
    logits = _logits(k, control, padding_mask)
    if causal:
        cache = ABCCache.empty(B, H, control.shape[1], D, dtype=q.dtype, device=q.device) if cache is None else cache
        cache.check_batch_size(B)
        outputs = []
        # head-major once, so that each chunk's products are batched matmuls of views; split(), not slicing: the
        # backward of a slice fills a zero tensor as long as the whole sequence, which made the backward
        # quadratic in T; split's backward is one concatenation.
        heads_first = [x.transpose(1, 2).contiguous() for x in (q, k, v, logits)]
        for pieces in zip(*(x.split(chunk, 2) for x in heads_first), real.split(chunk, 1)):
            out, cache = _causal_chunk(*pieces, cache, scale)
            outputs.append(out)
        out = torch.cat(outputs, 2).transpose(1, 2).contiguous()
    else:
        out = _read(q, *_whole_memory(k, v, logits, real), scale)
    return (out * real[:, :, None, None]).to(out_dtype), cache if causal else None


def _whole_memory(k: torch.Tensor, v: torch.Tensor, logits: torch.Tensor,
                  real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The memory written by every real token of ``k, v [B, S, H, D]`` (control ``logits [B, S, H, r]``, ``real
    [B, S]``): unnormalised keys and values ``[B, 1, H, r, D]`` and the normaliser ``[B, 1, H, r]``, as
    :func:`_read` takes them."""
    weights = torch.exp(logits - logits.amax(1, keepdim=True).detach()) * real[:, :, None, None]
    keys, values = (torch.einsum("bshr,bshd->bhrd", weights, x)[:, None] for x in (k, v))
    return keys, values, weights.sum(1)[:, None]


def abc_cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, control: torch.Tensor, *,
                        padding_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    r"""ABC cross attention: the memory is written from the whole source, every query reads it.

    Args:
        q: ``[B, Tq, H, D]``.
        k, v: ``[B, S, H, D]`` the source's keys and values.
        control: ``W_phi``, ``[H, r, D]``.
        padding_mask: ``[B, S]`` bool over the source, True for real tokens (padding is never written; a
            source with no real token, or no token at all, is an empty memory and reads zeros).
    Returns:
        ``[B, Tq, H, D]``.
    """
    if k.dim() == 4 and k.shape[1] == 0 and v.shape == k.shape:  # an empty memory reads zeros, as one of padding
        return q.new_zeros(q.shape)
    check_matching(k=k, v=v)
    B, S, H, D = k.shape
    if q.dim() != 4 or q.shape[0] != B or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q [B, Tq, H, D] and k [B, S, H, D] must agree on B, H and D, got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")
    check_padding_mask(padding_mask, B, S, axes="B, S", device=k.device)
    if control.dim() != 3 or control.shape[0] != H or control.shape[2] != D:
        raise ValueError(f"control must have shape [H, r, D] with H={H}, D={D}, got {tuple(control.shape)}")
    scale = query_scale(scale, D)
    out_dtype = q.dtype
    q, k, v, control = (x.to(accumulation_dtype(out_dtype)) for x in (q, k, v, control))
    real = torch.ones(B, S, dtype=q.dtype, device=q.device) if padding_mask is None else padding_mask.to(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        return _read(q, *_whole_memory(k, v, _logits(k, control, padding_mask), real), scale).to(out_dtype)
