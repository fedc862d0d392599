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
                             chunk: int = 64, stabilizers: tuple[torch.Tensor, torch.Tensor] | None = None
                             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    r"""Causal, ``chunk`` tokens at a time: inside a chunk the masked ``[chunk, chunk]`` weights
    ``phi(q) phi(k)^T``, across chunks the carried sums ``S`` and ``z``. Time ``O(T (chunk + D) F)``; no per-token
    ``[F, D]`` sums are ever formed.

    Args:
        q_feat, k_feat: ``[B, T, H, F]``; v: ``[B, T, H, D]``.
        sums: ``(S [B, H, F, D], z [B, H, F])`` over earlier tokens (None: zeros, float32 for 16-bit inputs).
        stabilizers: for features stabilised by a running maximum, ``(m [B, T, H], m0 [B, H])``: key ``s``'s
            features are ``phi(k_s) exp(-m_s)``, ``m`` never decreases, and the carried sums are scaled by
            ``exp(-m0)``. Query ``t`` then reads every key at its own scale, ``exp(-m_t)``, so that a larger key
            later in its chunk cannot make the ones it sees underflow. The sums returned are scaled by
            ``exp(-m_T)``, the last position's.
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
        if stabilizers is None:
            scales, before = [None] * -(-queries.shape[2] // chunk), None
        else:
            scales, before = stabilizers[0].transpose(1, 2).to(kv.dtype).split(chunk, 2), stabilizers[1].to(kv.dtype)
        # split(), not slicing: a slice's backward fills a zero tensor as long as the whole sequence (quadratic in T)
        for q, k, vs, m in zip(queries.split(chunk, 2), keys.split(chunk, 2), values.split(chunk, 2), scales):
            weights = q @ k.transpose(-1, -2)  # [B, H, t, s]
            carried = q.to(kv.dtype)  # the carried sums are read at their own precision
            read, read_sum = carried @ kv, (carried @ k_sum[..., None])[..., 0]  # [B, H, t, D], [B, H, t]
            if m is None:
                weights = weights.tril()
            else:  # key s at query t's scale: exp(m_s - m_t) <= 1 where s <= t, 0 after
                upper = torch.ones(m.shape[-1], m.shape[-1], dtype=torch.bool, device=m.device).triu(1)
                weights = weights * (m[..., None, :] - m[..., :, None]).masked_fill(upper, -torch.inf).exp()
                earlier = torch.exp(before[..., None] - m)  # the carried sums at each query's scale
                read, read_sum = read * earlier[..., None], read_sum * earlier
                # the sums move to the chunk's last scale
                last = m[..., -1]
                k = k * torch.exp(m - last[..., None])[..., None].to(k.dtype)
                kv, k_sum = kv * torch.exp(before - last)[..., None, None], k_sum * torch.exp(before - last)[..., None]
                before = last
            numerator = weights @ vs + read
            outputs.append(normalize(numerator, weights.sum(-1) + read_sum, eps).to(v.dtype))
            kv = kv + k.transpose(-1, -2) @ vs
            k_sum = k_sum + k.sum(2)
    return torch.cat(outputs, 2).transpose(1, 2).contiguous(), (kv, k_sum)
