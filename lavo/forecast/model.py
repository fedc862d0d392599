r"""A compact Informer-style encoder-decoder forecaster whose cross attention is the mechanism under test.

The encoder reads the ``L`` input steps (softmax self-attention); the decoder reads Informer's start token, the
last ``label_len`` observed steps followed by zeros for the ``H`` steps to forecast, with causal softmax
self-attention and cross attention to the encoder's output, and predicts every variable at the last ``H``
positions. Each step is embedded as a linear map of its values, plus a linear map of its calendar (sin/cos of
the time of day and of the year), plus a sinusoidal encoding of its place on a timeline shared by encoder and
decoder. Blocks are pre-norm.

Only the cross attention varies between models; the decoder's feed-forward width is set so that every
mechanism's model has the parameter count of the softmax one (to within one hidden unit's parameters).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..layers.softmax import SoftmaxAttention
from ..model import count_parameters, feed_forward, sinusoidal_positions
from ..registry import build_cross_attention

CALENDAR_FEATURES = 4  # sin and cos of the time of day and of the time of year


def calendar_features(calendar: torch.Tensor) -> torch.Tensor:
    """``[B, T, 2]`` fractions of the day and year -> ``[B, T, 4]`` their sines and cosines."""
    angles = 2 * math.pi * calendar
    return torch.cat([angles.sin(), angles.cos()], -1)


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, dropout: float):
        super().__init__()
        self.attention = SoftmaxAttention(dim, heads, causal=False)
        self.feed_forward = feed_forward(dim, hidden)
        self.norms = nn.ModuleList([nn.LayerNorm(dim), nn.LayerNorm(dim)])
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.norms[0](x))[0])
        return x + self.dropout(self.feed_forward(self.norms[1](x)))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, dropout: float, cross: str, cross_options: dict):
        super().__init__()
        self.attention = SoftmaxAttention(dim, heads, causal=True)
        self.cross = build_cross_attention(cross, dim, heads, **cross_options)
        self.feed_forward = feed_forward(dim, hidden)
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(3)])
        self.dropout = nn.Dropout(dropout)

    def forward(self, y: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        y = y + self.dropout(self.attention(self.norms[0](y))[0])
        y = y + self.dropout(self.cross(self.norms[1](y), source))
        return y + self.dropout(self.feed_forward(self.norms[2](y)))


def cross_parameters(cross: str, dim: int, heads: int, cross_options: dict) -> int:
    return count_parameters(build_cross_attention(cross, dim, heads, **cross_options))


class Forecaster(nn.Module):
    r"""``forward(inputs [B, L, C], calendar [B, L + H, 2]) -> [B, H, C]`` forecasts of the next ``horizon``
    steps.

    Args:
        channels: variables ``C``.
        input_len, label_len, horizon: ``L``, the observed steps the decoder starts from, ``H``.
        cross: the cross attention's name in :data:`lavo.registry.CROSS_ATTENTIONS`; ``cross_options`` its options.
        dim, heads, layers: width, heads and the number of encoder and of decoder layers.
        hidden: the feed-forward width; the decoder's is adjusted by the parameters the cross attention has
            more or fewer than softmax's.
    """

    def __init__(self, channels: int, input_len: int, label_len: int, horizon: int, *, cross: str = "softmax",
                 cross_options: dict | None = None, dim: int = 32, heads: int = 4, layers: int = 1,
                 hidden: int = 64, dropout: float = 0.05):
        super().__init__()
        if not 0 < label_len <= input_len:
            raise ValueError(f"label_len must be in [1, input_len={input_len}], got {label_len}")
        cross_options = cross_options or {}
        self.input_len, self.label_len, self.horizon = input_len, label_len, horizon
        extra = cross_parameters(cross, dim, heads, cross_options) - cross_parameters("softmax", dim, heads, {})
        decoder_hidden = hidden - round(extra / (2 * dim + 1))  # each hidden unit holds 2 dim + 1 parameters
        if decoder_hidden < 1:
            raise ValueError(f"the {cross!r} cross attention has {extra} parameters more than softmax's, more than "
                             f"the decoder's feed-forward width {hidden} can give back")
        self.value_embedding = nn.Linear(channels, dim)
        self.calendar_embedding = nn.Linear(CALENDAR_FEATURES, dim)
        self.register_buffer("timeline", sinusoidal_positions(0, input_len + horizon, dim),
                             persistent=False)
        self.encoder = nn.ModuleList([EncoderLayer(dim, heads, hidden, dropout) for _ in range(layers)])
        self.decoder = nn.ModuleList([DecoderLayer(dim, heads, decoder_hidden, dropout, cross, cross_options)
                                      for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim), nn.LayerNorm(dim)])
        self.head = nn.Linear(dim, channels)
        self.dropout = nn.Dropout(dropout)

    def embed(self, values: torch.Tensor, calendar: torch.Tensor, start: int) -> torch.Tensor:
        """Steps ``start ..`` of the shared timeline: ``values [B, T, C]``, ``calendar [B, T, 2]`` ->
        ``[B, T, dim]``."""
        place = self.timeline[start:start + values.shape[1]]
        return self.dropout(self.value_embedding(values) + self.calendar_embedding(calendar_features(calendar))
                            + place)

    def forward(self, inputs: torch.Tensor, calendar: torch.Tensor) -> torch.Tensor:
        L, H = self.input_len, self.horizon
        if inputs.dim() != 3 or inputs.shape[1] != L or calendar.shape[1] != L + H:
            raise ValueError(f"inputs must be [B, {L}, C] and calendar [B, {L + H}, 2], got {tuple(inputs.shape)} "
                             f"and {tuple(calendar.shape)}")
        source = self.embed(inputs, calendar[:, :L], 0)
        for layer in self.encoder:
            source = layer(source)
        source = self.norms[0](source)
        start = L - self.label_len
        observed = inputs[:, start:]
        y = self.embed(torch.cat([observed, observed.new_zeros(observed.shape[0], H, observed.shape[2])], 1),
                       calendar[:, start:], start)
        for layer in self.decoder:
            y = layer(y, source)
        return self.head(self.norms[1](y))[:, -H:]
