r"""FAVOR+ (Performer, Choromanski et al. 2021): softmax attention through positive orthogonal random features.

With ``x' = x / D^(1/4)`` and projection rows ``w_f``, ``phi(x)_f = exp(w_f . x' - |x'|^2 / 2)`` (the paper's
``1 / sqrt(F)`` cancels in the ratio), so ``E[phi(q) . phi(k)] = exp(q . k / sqrt(D))``.

Stabilisation subtracts, before the exponential, a constant that cancels in the ratio (and carries no gradient):
per query its largest exponent; for keys the largest real-key exponent so far, per head: over the sequence when
non-causal, a running maximum over chunks when causal (the carried sums are rescaled when it grows). No key
feature exceeds 1, so nothing overflows.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..feature_attention import causal_feature_attention, check_state, feature_attention


class PerformerState(NamedTuple):
    """Decoding state: ``kv [B, H, F, D]`` and ``k_sum [B, H, F]`` summed over the context, scaled by
    ``exp(-key_max)``; ``key_max [B, H]`` the largest key exponent so far."""

    kv: torch.Tensor
    k_sum: torch.Tensor
    key_max: torch.Tensor


def orthogonal_random_features(features: int, head_dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[F, D]``: blocks of ``D`` orthogonal directions (the last block partial), each row with the length of a
    ``D``-dimensional Gaussian vector."""
    blocks = -(-features // head_dim)
    gaussian = torch.randn(blocks, head_dim, head_dim, generator=generator)
    directions = torch.linalg.qr(gaussian).Q.transpose(1, 2).reshape(-1, head_dim)[:features]
    lengths = torch.randn(features, head_dim, generator=generator).norm(dim=1)
    return directions * lengths[:, None]


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


def tiny(x: torch.Tensor) -> float:
    return torch.finfo(x.dtype).tiny


def performer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *,
                        padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Non-causal FAVOR+. ``q [B, T, H, D]``, ``k, v [B, S, H, D]``, ``projection [F, D]`` -> ``[B, T, H, D]``."""
    exponents = key_exponents(k, projection, padding_mask)
    key_max = exponents.amax((1, 3), keepdim=True).detach().clamp(min=torch.finfo(k.dtype).min)
    return feature_attention(query_features(q, projection), torch.exp(exponents - key_max), v, eps=tiny(v))


def empty_state(v: torch.Tensor, features: int) -> PerformerState:
    """State before the first token, for values like ``v [B, T, H, D]``."""
    batch, _, heads, head_dim = v.shape
    return PerformerState(v.new_zeros(batch, heads, features, head_dim), v.new_zeros(batch, heads, features),
                          v.new_full((batch, heads), torch.finfo(v.dtype).min))


def performer_attention_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *,
                               padding_mask: torch.Tensor | None = None, state: PerformerState | None = None,
                               chunk: int = 64) -> tuple[torch.Tensor, PerformerState]:
    """Causal FAVOR+ by chunked prefix sums, continuing from ``state``. ``q, k, v [B, T, H, D]`` ->
    ``([B, T, H, D], PerformerState)``."""
    state = empty_state(v, projection.shape[0]) if state is None else state
    exponents = key_exponents(k, projection, padding_mask)
    check_state(state[:2], exponents, v)
    if state.key_max.shape != state.k_sum.shape[:2]:
        raise ValueError(f"state key_max must have shape [B, H] = {tuple(state.k_sum.shape[:2])}, "
                         f"got {tuple(state.key_max.shape)}")
    length = k.shape[1]
    chunk_max = F.pad(exponents, (0, 0, 0, 0, 0, -length % chunk), value=-math.inf).unflatten(1, (-1, chunk))
    chunk_max = chunk_max.amax((2, 4)).detach()  # [B, n, H]
    key_max = torch.maximum(chunk_max.cummax(1).values, state.key_max[:, None])
    previous = torch.cat([state.key_max[:, None], key_max[:, :-1]], 1)
    k_feat = torch.exp(exponents - key_max.repeat_interleave(chunk, 1)[:, :length, :, None])
    out, (kv, k_sum) = causal_feature_attention(query_features(q, projection), k_feat, v, state[:2], eps=tiny(v),
                                                chunk=chunk, rescale=torch.exp(previous - key_max))
    return out, PerformerState(kv, k_sum, key_max[:, -1])
