r"""S4D as the recurrence it is, one step per token: the reference of :mod:`.scan` and of the two-kernel
:func:`.kernel.fft_convolution`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .scan import zero_state


def s4d_recurrence(u: torch.Tensor, log_a: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: one recurrence step per token. Same arguments and results as :func:`.scan.s4d_scan`."""
    decay = log_a.exp()
    state = zero_state(u, log_a) if state is None else state
    outputs = []
    for t in range(u.shape[1]):
        state = decay * state + u[:, t, :, None]
        outputs.append(2 * (c * state).sum(-1).real)
    return torch.stack(outputs, 1).to(u.dtype), state


def bidirectional_recurrence(u: torch.Tensor, log_a: torch.Tensor, forward_c: torch.Tensor,
                             backward_c: torch.Tensor) -> torch.Tensor:
    """Reference for the two-kernel :func:`.kernel.fft_convolution`: a forward recurrence plus a backward one that reads
    only later tokens. ``u [B, T, C]`` -> ``[B, T, C]``."""
    forward, _ = s4d_recurrence(u, log_a, forward_c)
    backward, _ = s4d_recurrence(u.flip(1), log_a, backward_c)
    return forward + F.pad(backward.flip(1)[:, 1:], (0, 0, 0, 1))
