"""Transformer-LS long-short attention: a sliding window plus dynamically projected landmarks."""
from __future__ import annotations

from functools import partial

from torch import nn

from ..ops.common import check_positive, check_switches, check_window
from ..ops.longshort import longshort_attention
from .base import AttentionLayer, add_initialised, scaled_normal


class LongShortAttention(AttentionLayer):
    r"""Long-short attention (Zhu et al., 2021); see :mod:`lavo.ops.longshort`.

    ``forward(x [B, T, dim], padding_mask [B, T] | None, cache=None) -> (y [B, T, dim], None)``.

    Args:
        window: sliding-window length ``w``; causal, also the segment length of the landmarks.
        landmarks: over the whole sequence (non-causal; default 32) or per completed segment (causal;
            default 1).
        dual_ln: the paper's DualLN, one layer norm for the window keys and values and one for the landmarks'.

    Time: causal, each query also scores the landmarks of every earlier segment, ``T / w`` of them, so the
    landmark term costs ``O(T^2 r D / w)``, quadratic by the paper's design (``time_complexity`` says so);
    non-causal, ``O(T r D)``.

    No decoding form: causal landmarks accumulate ``landmarks`` per segment, so the state grows with the context, and
    there is no exact constant-size recurrence; decode by re-running the forward pass.
    """

    supports_decoding = False
    absolute_positions = True
    time_complexity = "quadratic"

    def __init__(self, dim: int, heads: int, *, causal: bool = True, window: int = 64,
                 landmarks: int | None = None, dual_ln: bool = True):
        super().__init__(dim, heads, causal=causal)
        check_window(window)
        landmarks = (1 if causal else 32) if landmarks is None else landmarks
        check_positive("LongShortAttention", landmarks=landmarks)
        check_switches("LongShortAttention", dual_ln=dual_ln)
        self.window, self.landmarks = window, landmarks
        add_initialised(self, "projection", partial(scaled_normal, heads, self.head_dim, landmarks,
                                                    std=self.head_dim ** -0.5))
        self.short_norm, self.long_norm = (nn.LayerNorm(dim), nn.LayerNorm(dim)) if dual_ln else (None, None)

    def attend(self, q, k, v, padding_mask, cache):
        norms = None if self.short_norm is None else tuple((n.weight, n.bias)
                                                           for n in (self.short_norm, self.long_norm))
        out = longshort_attention(q, k, v, self.projection, window=self.window, causal=self.causal,
                                  padding_mask=padding_mask, dual_norm=norms)
        return out, None

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.heads}, window={self.window}, landmarks={self.landmarks}, "
                f"dual_ln={self.short_norm is not None}, causal={self.causal}")
