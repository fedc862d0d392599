r"""The baselines every forecasting table needs: repeat the last value, repeat the last season, and a linear
map of the input window (DLinear, Zeng et al., 2023). Each is called like the transformer,
``forward(inputs [B, L, C], calendar [B, L + H, 2]) -> [B, H, C]`` (the calendar unused)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RepeatLast(nn.Module):
    """Every future step equals the last observed one."""

    def __init__(self, horizon: int):
        super().__init__()
        self.horizon = horizon

    def forward(self, inputs: torch.Tensor, calendar: torch.Tensor | None = None) -> torch.Tensor:
        return inputs[:, -1:].expand(-1, self.horizon, -1)


class SeasonalNaive(nn.Module):
    """Future step ``h`` equals the observed step one or more whole ``period``\\ s before it: the last observed
    season, repeated."""

    def __init__(self, horizon: int, period: int, input_len: int):
        super().__init__()
        if not 0 < period <= input_len:
            raise ValueError(f"the seasonal period must be in [1, input_len={input_len}], got {period}")
        self.horizon, self.period = horizon, period

    def forward(self, inputs: torch.Tensor, calendar: torch.Tensor | None = None) -> torch.Tensor:
        steps = torch.arange(self.horizon, device=inputs.device) % self.period
        return inputs[:, inputs.shape[1] - self.period + steps]


def moving_average(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """``[B, L, C]`` -> ``[B, L, C]``: the mean over ``kernel`` steps centred on each, the ends repeated."""
    front, back = (kernel - 1) // 2, kernel // 2
    padded = torch.cat([x[:, :1].expand(-1, front, -1), x, x[:, -1:].expand(-1, back, -1)], 1)
    return F.avg_pool1d(padded.transpose(1, 2), kernel, stride=1).transpose(1, 2)


class DLinear(nn.Module):
    """The input split into a moving-average trend and the remainder, each mapped to the horizon by its own
    ``Linear(L, H)`` shared by the variables; the forecast is their sum."""

    def __init__(self, input_len: int, horizon: int, kernel: int = 25):
        super().__init__()
        self.kernel = kernel
        self.trend = nn.Linear(input_len, horizon)
        self.remainder = nn.Linear(input_len, horizon)

    def forward(self, inputs: torch.Tensor, calendar: torch.Tensor | None = None) -> torch.Tensor:
        trend = moving_average(inputs, self.kernel)
        out = self.trend(trend.transpose(1, 2)) + self.remainder((inputs - trend).transpose(1, 2))
        return out.transpose(1, 2)
