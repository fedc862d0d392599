r"""Attention through positive feature maps, ``o_t = phi(q_t) S / phi(q_t) z``, shared by the kernel baselines.

``S = sum_s phi(k_s) v_s^T [F, D]`` and ``z = sum_s phi(k_s) [F]`` run over all keys (non-causal) or, as prefix
sums, over keys up to the query (causal). Features are ``[B, T, H, F]``, values ``[B, T, H, D]``; a padded key is
one whose features are zero. Denominators are clamped below at ``eps`` (:func:`~lavo.ops.common.normalize`).
The causal form carries ``S`` and ``z`` in float32 for 16-bit inputs (DESIGN, decision 5): summed in bfloat16,
they drift once a few thousand tokens have been added. 16-bit inputs are computed in float32 (float16's range:
the product of a query's and a key's separately normalised features underflows, and ``S`` overflows; bfloat16's
precision: products and sums in it gave Performer 14 to 36 times float32's error on sharp heads, with its
bfloat16 features; tests/test_16_bit_numerics.py), and autocast is off inside, so that it does not round the
float32 sums back to 16 bits; outputs have the dtype of ``v``.
"""
from __future__ import annotations

import torch

from ..common import accumulation_dtype, normalize


def _computed(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor, eps: float | None):
    """The inputs in the dtype the sums are computed in, and ``eps`` (default: that dtype's smallest normal)."""
    dtype = accumulation_dtype(v.dtype)
    return *(t.to(dtype) for t in (q_feat, k_feat, v)), torch.finfo(dtype).tiny if eps is None else eps


def feature_attention(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor,
                      eps: float | None = None) -> torch.Tensor:
    """Non-causal, by associativity: ``[B, T, H, F]``, ``[B, S, H, F]``, ``[B, S, H, D]`` -> ``[B, T, H, D]``."""
    with torch.autocast(v.device.type, enabled=False):
        queries, keys, values, eps = _computed(q_feat, k_feat, v, eps)
        numerator = torch.einsum("bthf,bhfd->bthd", queries, torch.einsum("bshf,bshd->bhfd", keys, values))
        return normalize(numerator, torch.einsum("bthf,bhf->bth", queries, keys.sum(1)), eps).to(v.dtype)


def check_sums(sums: tuple[torch.Tensor, torch.Tensor], k_feat: torch.Tensor, v: torch.Tensor) -> None:
    """Raise unless the carried ``(S, z)`` fit the batch, heads and sizes of ``k_feat`` and ``v``."""
    batch, _, heads, features = k_feat.shape
    expected = (batch, heads, features, v.shape[-1]), (batch, heads, features)
    if tuple(tuple(t.shape) for t in sums) != expected:
        raise ValueError(f"cache sums must have shapes S {expected[0]} and z {expected[1]}, got "
                         f"{tuple(sums[0].shape)} and {tuple(sums[1].shape)}; pass the cache the previous call "
                         f"returned")


def causal_feature_attention(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor,
                             sums: tuple[torch.Tensor, torch.Tensor] | None = None, *, eps: float | None = None,
                             chunk: int = 64, rescale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    r"""Causal, ``chunk`` tokens at a time: inside a chunk the masked ``[chunk, chunk]`` weights
    ``phi(q) phi(k)^T``, across chunks the carried sums ``S`` and ``z``. Time ``O(T (chunk + D) F)``; no per-token
    ``[F, D]`` sums are ever formed.

    Args:
        q_feat, k_feat: ``[B, T, H, F]``; v: ``[B, T, H, D]``.
        sums: ``(S [B, H, F, D], z [B, H, F])`` over earlier tokens (None: zeros, float32 for 16-bit inputs).
        rescale: ``[B, n_chunks, H]``, a factor on the carried sums before each chunk (for stabilised features
            whose scale changes between chunks).
    Returns:
        ``[B, T, H, D]`` and the sums after the last token.
    """
    batch, _, heads, features = k_feat.shape
    if sums is None:
        acc = accumulation_dtype(v.dtype)
        sums = (v.new_zeros(batch, heads, features, v.shape[-1], dtype=acc), v.new_zeros(batch, heads, features,
                                                                                        dtype=acc))
    check_sums(sums, k_feat, v)
    kv, k_sum = sums
    outputs = []
    with torch.autocast(v.device.type, enabled=False):
        queries, keys, values, eps = _computed(q_feat, k_feat, v, eps)
        # head-major [B, H, T, F] once, so that each chunk's products are batched matmuls of views (einsums on
        # [B, T, H, F] chunks copied their operands into that layout, chunk by chunk)
        queries, keys, values = (x.transpose(1, 2).contiguous() for x in (queries, keys, values))
        # split(), not slicing: a slice's backward fills a zero tensor as long as the whole sequence (quadratic in T)
        for index, (q, k, vs) in enumerate(zip(queries.split(chunk, 2), keys.split(chunk, 2), values.split(chunk, 2))):
            if rescale is not None:
                kv, k_sum = kv * rescale[:, index, :, None, None], k_sum * rescale[:, index, :, None]
            weights = (q @ k.transpose(-1, -2)).tril()  # [B, H, t, s]
            carried = q.to(kv.dtype)  # the carried sums are read at their own precision
            numerator = weights @ vs + carried @ kv  # [B, H, t, D]
            denominator = weights.sum(-1) + (carried @ k_sum[..., None])[..., 0]
            outputs.append(normalize(numerator, denominator, eps).to(v.dtype))
            kv = kv + k.transpose(-1, -2) @ vs
            k_sum = k_sum + k.sum(2)
    return torch.cat(outputs, 2).transpose(1, 2).contiguous(), (kv, k_sum)
