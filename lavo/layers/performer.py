"""Performer (FAVOR+) self-attention (Choromanski et al., 2021)."""
from __future__ import annotations

from functools import partial

import torch

from ..ops.common import accumulation_dtype, check_positive
from ..ops.performer import (PerformerCache, orthogonal_random_features, performer_attention,
                             performer_attention_causal)
from .base import AttentionLayer, CrossAttentionLayer, add_initialised, element_size


class PerformerAttention(AttentionLayer):
    r"""Softmax attention approximated with ``features`` positive orthogonal random features per head.

    The projection ``[features, head_dim]`` is drawn at construction (from the global RNG), shared by the heads
    and kept as a buffer, so it is saved with the model. With ``redraw_interval=n`` a new one is drawn after
    every ``n``-th optimizer step, as the paper redraws during training: the training loop calls
    :func:`~lavo.layers.base.after_optimizer_step` on the model (``lavo train`` does; the count is a buffer too,
    so a resumed run redraws where an uninterrupted one would). ``forward`` itself never changes the layer, so
    activation checkpointing recomputes the same function and a cache continues with the features it was made
    with. None keeps the first draw. Causal layers use chunked prefix sums and return a
    :class:`~lavo.ops.performer.PerformerCache` of constant size ``H (F (D + 1) + 1)`` per sequence.

    ``forward(x [B, T, dim], padding_mask [B, T] | None, cache | None) -> (y [B, T, dim], cache)``.
    """

    cache_types = (PerformerCache,)

    def __init__(self, dim: int, heads: int, *, causal: bool = True, features: int = 256, chunk: int = 64,
                 redraw_interval: int | None = None):
        super().__init__(dim, heads, causal=causal)
        check_positive("PerformerAttention", features=features, chunk=chunk)
        if redraw_interval is not None:
            check_positive("PerformerAttention", redraw_interval=redraw_interval)
        self.features, self.chunk, self.redraw_interval = features, chunk, redraw_interval
        add_initialised(self, "projection", partial(orthogonal_random_features, features, self.head_dim), buffer=True)
        if redraw_interval is not None:
            add_initialised(self, "optimizer_steps", partial(torch.zeros, (), dtype=torch.long), buffer=True)

    def redraw_features(self) -> None:
        """A new projection from the global RNG (a new tensor: what autograd saved of the old one stays valid)."""
        make, _ = self._initialisers["projection"]
        self.projection = make().to(self.projection)

    def after_optimizer_step(self) -> None:
        if self.redraw_interval is None:
            return
        self.optimizer_steps += 1
        if self.optimizer_steps.item() % self.redraw_interval == 0:
            self.redraw_features()

    def attend(self, q, k, v, padding_mask, cache: PerformerCache | None):
        if self.causal:
            return performer_attention_causal(q, k, v, self.projection, padding_mask=padding_mask, cache=cache,
                                              chunk=self.chunk)
        return performer_attention(q, k, v, self.projection, padding_mask=padding_mask), None

    def _new_cache(self, batch_size: int, *, device: torch.device | str, dtype: torch.dtype) -> PerformerCache:
        return PerformerCache.empty(batch_size, self.heads, self.features, self.head_dim, device=device, dtype=dtype)

    def cache_nbytes(self, batch_size: int, context: int, dtype: torch.dtype = torch.float32) -> int:
        # S [B, H, F, D], z [B, H, F] and the running key maximum [B, H], float32 for 16-bit inputs
        return batch_size * self.heads * (self.features * (self.head_dim + 1) + 1) * element_size(
            accumulation_dtype(dtype))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.heads}, features={self.features}, "
                f"redraw_interval={self.redraw_interval}, causal={self.causal}")


class PerformerCrossAttention(CrossAttentionLayer):
    r"""FAVOR+ cross attention: ``features`` positive orthogonal random features of the queries and of the
    source's keys (the projection drawn once, from the global RNG, and kept as a buffer). Invariant to permuting
    the source (it has no source positions).

    ``forward(y [B, Tq, dim], source [B, S, dim], source_padding_mask [B, S] | None,
    query_padding_mask [B, Tq] | None) -> [B, Tq, dim]``.
    """

    def __init__(self, dim: int, heads: int, *, features: int = 256):
        super().__init__(dim, heads)
        check_positive("PerformerCrossAttention", features=features)
        self.features = features
        add_initialised(self, "projection", partial(orthogonal_random_features, features, self.head_dim), buffer=True)

    def attend(self, q, k, v, source_padding_mask):
        return performer_attention(q, k, v, self.projection, padding_mask=source_padding_mask)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, features={self.features}"
