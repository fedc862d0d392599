"""Full softmax attention through ``scaled_dot_product_attention``."""
from __future__ import annotations

import torch
from einops import rearrange
from torch.nn.functional import scaled_dot_product_attention

from ..common import check_padding_mask, check_queries_keys_values


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
    check_queries_keys_values(q, k, v, same_length=False)
    (B, Tq), Tk = q.shape[:2], k.shape[1]
    check_padding_mask(key_mask, B, Tk, "key_mask", axes="B, Tk", device=k.device)
    check_padding_mask(query_mask, B, Tq, "query_mask", axes="B, Tq", device=q.device)
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
