r"""S4D as the recurrence it is, one step per token: the reference of :mod:`.scan` and of the two-kernel
:func:`.kernel.fft_convolution`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .scan import S4DCache


def s4d_recurrence(u: torch.Tensor, log_a: torch.Tensor, c: torch.Tensor,
                   cache: S4DCache | None = None) -> tuple[torch.Tensor, S4DCache]:
    """Reference: ``x_t = exp(log_a) x_{t-1} + u_t``, ``y_t = 2 Re(c . x_t)``, one step per token. Same arguments
    and results as :func:`.scan.s4d_scan`."""
    cache = S4DCache.empty(u.shape[0], *log_a.shape, dtype=log_a.dtype, device=u.device) if cache is None else cache
    decay, state = log_a.exp(), cache.state
    outputs = []
    for t in range(u.shape[1]):
        state = decay * state + u[:, t, :, None]
        outputs.append(2 * (c * state).sum(-1).real)
    return torch.stack(outputs, 1).to(u.dtype), S4DCache(state, cache.position + u.shape[1])


def bidirectional_recurrence(u: torch.Tensor, log_a: torch.Tensor, forward_c: torch.Tensor,
                             backward_c: torch.Tensor) -> torch.Tensor:
    """Reference for the two-kernel :func:`.kernel.fft_convolution`: a forward recurrence plus a backward one that reads
    only later tokens. ``u [B, T, C]`` -> ``[B, T, C]``."""
    forward, _ = s4d_recurrence(u, log_a, forward_c)
    backward, _ = s4d_recurrence(u.flip(1), log_a, backward_c)
    return forward + F.pad(backward.flip(1)[:, 1:], (0, 0, 0, 1))
