r"""cosFormer (Qin et al. 2022): ReLU features with a cos re-weighting that decays with distance.

The weight of key ``j`` for query ``i`` is ``relu(q_i) . relu(k_j) cos(pi/2 (i - j) / M)``; since
``cos(a - b) = cos a cos b + sin a sin b`` it is a product of the ``2D`` features
``phi(x_i) = [relu(x_i) cos(pi i / 2M), relu(x_i) sin(pi i / 2M)]``. Weights stay non-negative while
``|i - j| < M``: non-causal attention takes ``M`` = the sequence's length: one past its last real token when
padded, so that right padding changes nothing and weights stay non-negative whatever the mask; causal attention a
fixed ``M`` (``max_length``), since a decoder does not know the final length, and positions from ``M`` on are
refused. Denominators are clamped at
``1e-6`` as in the paper.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...cache import Cache
from ..common import accumulation_dtype, check_padding_mask, check_queries_keys_values
from ..feature_attention import causal_feature_attention, feature_attention

EPS = 1e-6


@dataclass(frozen=True)
class CosformerCache(Cache):
    """Decoding cache: ``kv [B, H, 2D, D]`` and ``k_sum [B, H, 2D]`` over the context, and its length.

    ``max_length`` is the ``M`` its sums were re-weighted with (None: not yet tied to one): the sums of another
    ``M`` have the same shapes, so a call with another ``max_length`` refuses the cache by it."""

    kv: torch.Tensor
    k_sum: torch.Tensor
    position: int
    max_length: int | None = None

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None, max_length: int | None = None) -> CosformerCache:
        """The cache before the first token, for values of ``dtype`` (the sums float32 for 16-bit values)."""
        acc = accumulation_dtype(torch.get_default_dtype() if dtype is None else dtype)
        k_sum = torch.zeros(batch, heads, 2 * head_dim, dtype=acc, device=device)
        return cls(torch.zeros(batch, heads, 2 * head_dim, head_dim, dtype=acc, device=device), k_sum, 0,
                   max_length)


def cosformer_features(x: torch.Tensor, positions: torch.Tensor, horizon: int | torch.Tensor,
                       padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, T, H, D]`` at ``positions [T]`` (or ``[B, T]``) with ``M = horizon`` (a number, or ``[B, 1]`` one
    per sequence) -> ``[B, T, H, 2D]``, float32 for 16-bit ``x`` (the sums are, and the angle rounded to bfloat16
    moved the re-weighting); zero at padded positions when masked."""
    wide = accumulation_dtype(x.dtype)
    angle = (math.pi / 2 * positions.to(wide) / horizon)[..., None, None]
    relu = torch.relu(x.to(wide))
    if padding_mask is not None:
        relu = relu * padding_mask[:, :, None, None]
    return torch.cat([relu * angle.cos(), relu * angle.sin()], -1)


def cosformer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Non-causal cosFormer with ``M`` = one past each sequence's last real token (``T`` without padding).
    ``q, k, v [B, T, H, D]`` -> ``[B, T, H, D]``."""
    check_queries_keys_values(q, k, v, same_length=True)
    check_padding_mask(padding_mask, q.shape[0], q.shape[1], device=q.device)
    positions = torch.arange(q.shape[1], device=q.device)
    length = q.shape[1] if padding_mask is None else (positions * padding_mask).amax(1, keepdim=True) + 1
    return feature_attention(cosformer_features(q, positions, length),
                             cosformer_features(k, positions, length, padding_mask), v, eps=EPS)


def source_fractions(padding_mask: torch.Tensor | None, batch: int, length: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's place among the real ones of its sequence and their number: positions ``[B, S]`` (a padded
    token repeats its predecessor's; its features are zeroed anyway) and counts ``[B, 1]`` (at least 1)."""
    if padding_mask is None:
        return torch.arange(length, device=device).expand(batch, length), torch.full((batch, 1), length,
                                                                                      device=device)
    real = padding_mask.long()
    return (real.cumsum(1) - 1).clamp(min=0), real.sum(1, keepdim=True).clamp(min=1)


def cosformer_cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                              padding_mask: torch.Tensor | None = None,
                              query_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    r"""cosFormer cross attention. Real query ``i`` of ``m`` and real source token ``j`` of ``n`` are re-weighted
    by ``cos(pi/2 (i / m - j / n))``: each side's position is its fraction of its own sequence, so weights stay
    non-negative whatever the two lengths and, for ``m = n``, equal the self-attention form with ``M = T``.
    Positions count real tokens only, so padding either side changes nothing; a padded query reads zeros.

    ``q [B, Tq, H, D]``, ``k, v [B, S, H, D]``, ``padding_mask [B, S]``, ``query_padding_mask [B, Tq]``
    -> ``[B, Tq, H, D]``.
    """
    check_queries_keys_values(q, k, v, same_length=False)
    (B, Tq), S = q.shape[:2], k.shape[1]
    check_padding_mask(padding_mask, B, S, axes="B, S", device=k.device)
    check_padding_mask(query_padding_mask, B, Tq, "query_padding_mask", axes="B, Tq", device=q.device)
    query_positions, queries = source_fractions(query_padding_mask, B, Tq, q.device)
    positions, counts = source_fractions(padding_mask, B, S, k.device)
    return feature_attention(cosformer_features(q, query_positions, queries, query_padding_mask),
                             cosformer_features(k, positions, counts, padding_mask), v, eps=EPS)


def cosformer_attention_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_length: int, *,
                               padding_mask: torch.Tensor | None = None, cache: CosformerCache | None = None,
                               chunk: int = 64) -> tuple[torch.Tensor, CosformerCache]:
    """Causal cosFormer with ``M = max_length``, by chunked prefix sums, continuing from ``cache`` (None: the
    start). ``q, k, v [B, T, H, D]`` -> ``([B, T, H, D], CosformerCache)``."""
    check_queries_keys_values(q, k, v, same_length=True)
    check_padding_mask(padding_mask, q.shape[0], q.shape[1], device=q.device)
    if cache is not None and cache.max_length not in (None, max_length):
        raise ValueError(f"the cache was made with max_length={cache.max_length} (this call: {max_length}): its sums "
                         "carry that length's cos re-weighting; continue with the cache this layer returned")
    start = 0 if cache is None else cache.position
    end = start + q.shape[1]
    if end > max_length:
        raise ValueError(f"cosFormer reached position {end - 1} but was built with max_length={max_length}: the "
                         "cos re-weighting turns negative beyond it; build the layer with a larger max_length (a "
                         "model's model.attention_options.max_length: a trained model reads at most that many "
                         "positions)")
    positions = torch.arange(start, end, device=q.device)
    out, (kv, k_sum) = causal_feature_attention(
        cosformer_features(q, positions, max_length), cosformer_features(k, positions, max_length, padding_mask),
        v, None if cache is None else (cache.kv, cache.k_sum), eps=EPS, chunk=chunk)
    return out, CosformerCache(kv, k_sum, end, max_length)
