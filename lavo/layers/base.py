"""What every self-attention layer in the registry shares: projections, head split and the forward contract."""
from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import nn

from ..cache import Cache
from ..ops.common import check_padding_mask


def check_heads(dim: int, heads: int) -> int:
    """Validate the head split and return the head dimension."""
    if heads < 1 or dim < 1:
        raise ValueError(f"dim and heads must be positive, got dim={dim}, heads={heads}")
    if dim % heads:
        raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
    return dim // heads


class AttentionLayer(nn.Module):
    r"""Base of the self-attention layers: ``forward(x, padding_mask=None, cache=None) -> (y, cache)``.

    ``x`` is ``[B, T, dim]``; ``padding_mask`` ``[B, T]`` bool (True = real token); ``cache`` is whatever the
    previous call returned (None to start a sequence). Subclasses implement :meth:`attend` on per-head
    ``q, k, v [B, T, H, D]`` and return ``None`` as the cache when they have no decoding form.

    The ``supports_*`` flags say what a mechanism can do; asking for anything else raises an error naming it.
    """

    supports_causal = True
    supports_noncausal = True
    supports_decoding = True  # a causal layer can continue a sequence from the cache it returns

    def __init__(self, dim: int, heads: int, *, causal: bool = True):
        super().__init__()
        name = type(self).__name__
        if causal and not self.supports_causal:
            raise ValueError(f"{name} has no causal form; build it with causal=False")
        if not causal and not self.supports_noncausal:
            raise ValueError(f"{name} has no non-causal form; build it with causal=True")
        self.head_dim = check_heads(dim, heads)
        self.dim, self.heads, self.causal = dim, heads, causal
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None,
               cache: Any) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def empty_cache(self, batch_size: int, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> Cache:
        """The cache before the first token, on the layer's device and for its dtype unless given;
        ``layer(x, cache=layer.empty_cache(B))`` equals ``layer(x)``. A layer without a decoding form raises."""
        if not self.supports_decoding:
            raise ValueError(f"{type(self).__name__} has no decoding form; call it without a cache")
        like = next(self.parameters())
        return self._new_cache(batch_size, device=device or like.device, dtype=dtype or like.dtype)

    def _new_cache(self, batch_size: int, *, device: torch.device | str, dtype: torch.dtype) -> Cache:
        """The empty cache of a layer with a decoding form."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache: Any = None) -> tuple[torch.Tensor, Any]:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape [B, T, {self.dim}], got {tuple(x.shape)}")
        check_padding_mask(padding_mask, x.shape[0], x.shape[1])
        if cache is not None and not self.causal:
            raise ValueError(f"{type(self).__name__} was built with causal=False; a cache is only for causal decoding")
        if cache is not None and not self.supports_decoding:
            raise ValueError(f"{type(self).__name__} has no decoding form; call it without a cache")
        q, k, v = rearrange(self.to_qkv(x), "b t (three h d) -> three b t h d", three=3, h=self.heads)
        out, cache = self.attend(q, k, v, padding_mask, cache)
        return self.to_out(rearrange(out, "b t h d -> b t (h d)")), cache
