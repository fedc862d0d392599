r"""FAVOR+ (Performer, Choromanski et al. 2021): softmax attention through positive orthogonal random features.

With ``x' = x / D^(1/4)`` and projection rows ``w_f``, ``phi(x)_f = exp(w_f . x' - |x'|^2 / 2)`` (the paper's
``1 / sqrt(F)`` cancels in the ratio), so ``E[phi(q) . phi(k)] = exp(q . k / sqrt(D))``.

Stabilisation subtracts, before the exponential, a constant that cancels in the ratio (and carries no gradient):
per query its largest exponent; for keys the largest real-key exponent so far, per head: over the sequence when
non-causal, a running maximum over positions when causal (each query reads the keys it sees at its position's
maximum, and the carried sums are rescaled as it grows). No key feature exceeds 1, so nothing overflows, and no
later key can make the ones a query sees underflow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...cache import Cache
from ..common import accumulation_dtype, check_padding_mask, check_queries_keys_values, neg_inf, without_autocast
from ..feature_attention import causal_feature_attention, check_sums, feature_attention


@dataclass(frozen=True)
class PerformerCache(Cache):
    """Decoding cache: ``kv [B, H, F, D]`` and ``k_sum [B, H, F]`` summed over the context, scaled by
    ``exp(-key_max)``; ``key_max [B, H]`` the largest key exponent so far; ``position`` the tokens seen."""

    kv: torch.Tensor
    k_sum: torch.Tensor
    key_max: torch.Tensor
    position: int

    def check_dtype(self, dtype: torch.dtype) -> None:
        self.check_sums_dtype(self.kv, dtype)

    @classmethod
    def empty(cls, batch: int, heads: int, features: int, head_dim: int, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> PerformerCache:
        """The cache before the first token, for values of ``dtype`` (the sums float32 for 16-bit values)."""
        dtype = torch.get_default_dtype() if dtype is None else dtype
        acc = accumulation_dtype(dtype)
        k_sum = torch.zeros(batch, heads, features, dtype=acc, device=device)
        return cls(torch.zeros(batch, heads, features, head_dim, dtype=acc, device=device), k_sum,
                   torch.full((batch, heads), neg_inf(acc), dtype=acc, device=device), 0)


def orthogonal_random_features(features: int, head_dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[F, D]`` in the default dtype: blocks of ``D`` orthogonal directions (the last block partial), each row
    with the length of a ``D``-dimensional Gaussian vector. Drawn in float32 at least, where the QR is defined."""
    dtype = torch.promote_types(torch.get_default_dtype(), torch.float32)
    blocks = -(-features // head_dim)
    gaussian = torch.randn(blocks, head_dim, head_dim, generator=generator, dtype=dtype)
    directions = torch.linalg.qr(gaussian).Q.transpose(1, 2).reshape(-1, head_dim)[:features]
    lengths = torch.randn(features, head_dim, generator=generator, dtype=dtype).norm(dim=1)
    return (directions * lengths[:, None]).to(torch.get_default_dtype())


def favor_exponents(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """``log phi(x)``: ``x [B, T, H, D]``, ``projection [F, D]`` -> ``[B, T, H, F]``."""
    x = x * x.shape[-1] ** -0.25
    return torch.einsum("bthd,fd->bthf", x, projection.to(x.dtype)) - x.square().sum(-1, keepdim=True) / 2


def query_features(q: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    exponents = favor_exponents(q, projection)
    return torch.exp(exponents - exponents.amax(-1, keepdim=True).detach())


def key_exponents(k: torch.Tensor, projection: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """``log phi(k)`` with ``-inf`` at padded keys, so they are zero features and never set the maximum."""
    exponents = favor_exponents(k, projection)
    return exponents if padding_mask is None else exponents.masked_fill(~padding_mask[:, :, None, None], -math.inf)


def widened(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` in float32 when 16-bit: the exponents reach tens (bfloat16's spacing there is 0.25 to 0.5),
    and float16 key features underflow. What follows runs with autocast off, which would round the products back."""
    return q.to(accumulation_dtype(q.dtype)), k.to(accumulation_dtype(k.dtype))


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor,
                 padding_mask: torch.Tensor | None, *, same_length: bool) -> None:
    """What both forms check first: ``q [B, T, H, D]``, ``k [B, S, H, D]``, ``v [B, S, H, Dv]`` (``S = T`` when
    ``same_length``), ``projection [F, D]`` and ``padding_mask [B, S]`` over the keys."""
    check_queries_keys_values(q, k, v, same_length=same_length)
    if projection.dim() != 2 or projection.shape[1] != q.shape[-1]:
        raise ValueError(f"projection must have shape [F, D] with D={q.shape[-1]}, got {tuple(projection.shape)}")
    check_padding_mask(padding_mask, k.shape[0], k.shape[1], device=k.device)


def performer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *,
                        padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Non-causal FAVOR+. ``q [B, T, H, D]``, ``k, v [B, S, H, D]``, ``projection [F, D]`` -> ``[B, T, H, D]`` in
    ``v``'s dtype (computed in float32 for 16-bit inputs)."""
    check_inputs(q, k, v, projection, padding_mask, same_length=False)
    if k.shape[1] == 0:  # no keys: an empty memory reads zeros, as one of padding only does
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    with torch.autocast(q.device.type, enabled=False):
        q, k = widened(q, k)
        exponents = key_exponents(k, projection, padding_mask)
        key_max = exponents.amax((1, 3), keepdim=True).detach().clamp(min=torch.finfo(k.dtype).min)
        return feature_attention(query_features(q, projection), torch.exp(exponents - key_max), v)


def performer_attention_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *,
                               padding_mask: torch.Tensor | None = None, cache: PerformerCache | None = None,
                               chunk: int = 64) -> tuple[torch.Tensor, PerformerCache]:
    """Causal FAVOR+ by chunked prefix sums, continuing from ``cache`` (None: the start). ``q, k, v [B, T, H, D]``
    -> ``([B, T, H, D], PerformerCache)``."""
    check_inputs(q, k, v, projection, padding_mask, same_length=True)
    if cache is None:
        B, _, H, D = v.shape
        cache = PerformerCache.empty(B, H, projection.shape[0], D, dtype=v.dtype, device=v.device)
    return _performer_attention_causal(*widened(q, k), v, projection, padding_mask, cache, chunk)


@without_autocast
def _performer_attention_causal(q, k, v, projection, padding_mask, cache, chunk):
    """:func:`performer_attention_causal` from its cache, ``q`` and ``k`` widened, autocast off."""
    exponents = key_exponents(k, projection, padding_mask)
    check_sums((cache.kv, cache.k_sum), exponents, v)
    if cache.key_max.shape != cache.k_sum.shape[:2]:
        raise ValueError(f"cache key_max must have shape [B, H] = {tuple(cache.k_sum.shape[:2])}, "
                         f"got {tuple(cache.key_max.shape)}")
    # the largest exponent up to each position [B, T, H], and the cache's before them
    key_max = torch.maximum(exponents.detach().amax(3).cummax(1).values, cache.key_max[:, None])
    k_feat = torch.exp(exponents - key_max[..., None])
    out, (kv, k_sum) = causal_feature_attention(query_features(q, projection), k_feat, v, (cache.kv, cache.k_sum),
                                                chunk=chunk, stabilizers=(key_max, cache.key_max))
    return out, PerformerCache(kv, k_sum, key_max[:, -1], cache.position + k.shape[1])
