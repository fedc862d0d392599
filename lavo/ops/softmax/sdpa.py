"""Full softmax attention through ``scaled_dot_product_attention``, and the key/value cache for decoding."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch.nn.functional import scaled_dot_product_attention


@dataclass(frozen=True)
class KVCache:
    r"""Keys and values a causal layer keeps to continue a sequence.

    Attributes:
        keys, values: ``[B, L, H, D]``, the cached positions ``position - L .. position - 1``.
        key_mask: ``[B, L]`` bool, True for real (non-padding) keys.
        position: tokens seen so far, padding included.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor
    position: int

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, *, dtype: torch.dtype | None = None,
              device: torch.device | None = None) -> KVCache:
        """The cache before the first token."""
        keys = torch.zeros(batch, 0, heads, head_dim, dtype=dtype, device=device)
        return cls(keys, keys, torch.zeros(batch, 0, dtype=torch.bool, device=device), 0)

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    def append(self, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None) -> KVCache:
        """The cache after ``T`` more positions: ``k, v [B, T, H, D]``, ``padding_mask [B, T]`` or None."""
        B, T = k.shape[:2]
        if B != self.batch_size:
            raise ValueError(f"cache was built for batch size {self.batch_size}, got input of batch size {B}")
        real = torch.ones(B, T, dtype=torch.bool, device=k.device) if padding_mask is None else padding_mask
        return KVCache(torch.cat([self.keys, k], 1), torch.cat([self.values, v], 1),
                       torch.cat([self.key_mask, real], 1), self.position + T)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      key_mask: torch.Tensor | None = None, query_mask: torch.Tensor | None = None,
                      scale: float | None = None) -> torch.Tensor:
    r"""Softmax attention of every query over every allowed key.

    Args:
        q: ``[B, Tq, H, D]``. When causal, the queries are the last ``Tq`` of the ``Tk`` key positions.
        k, v: ``[B, Tk, H, D]`` (``Tk >= Tq`` when causal).
        key_mask: ``[B, Tk]`` bool, True for keys that may be attended to.
        query_mask: ``[B, Tq]`` bool; False rows (padding) return zeros.
        scale: defaults to ``D ** -0.5``.
    Returns:
        ``[B, Tq, H, D]``; a query with no allowed key returns zeros.
    """
    Tq, Tk = q.shape[1], k.shape[1]
    if causal and Tk < Tq:
        raise ValueError(f"causal attention needs at least as many keys as queries, got {Tk} keys for {Tq} queries")
    qh, kh, vh = (rearrange(x, "b t h d -> b h t d") for x in (q, k, v))
    if key_mask is None and (not causal or Tq == Tk):
        out = scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    else:
        allowed = torch.ones(1, Tk, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
        allowed = allowed[:, None, None, :]  # [B, 1, 1, Tk]
        if causal:
            key_pos = torch.arange(Tk, device=q.device)
            query_pos = torch.arange(Tk - Tq, Tk, device=q.device)
            allowed = allowed & (key_pos[None, :] <= query_pos[:, None])
        has_key = allowed.any(-1, keepdim=True)
        # Not every backend zeroes a row without keys (some give NaN): let it see everything, then zero it.
        out = scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed | ~has_key, scale=scale) * has_key
    out = rearrange(out, "b h t d -> b t h d")
    return out if query_mask is None else out * query_mask[:, :, None, None].to(out.dtype)
