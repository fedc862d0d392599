r"""Diagonal state spaces (S4D, Gu et al. 2022) as per-channel long convolutions or recurrences.

Each of ``C`` channels is a discrete linear system with ``N`` complex modes (one mode of each conjugate pair;
the pair's sum is the factor 2 of the real part). With the input matrix folded into ``c``:

    ``x_t = exp(log_a) * x_{t-1} + u_t``,   ``y_t = 2 Re(c . x_t)``

so ``y = K * u`` with the kernel ``K[l] = 2 Re(sum_n c_n exp(l log_a_n))``. Inputs are ``u [B, T, C]`` real,
``log_a, c [C, N]`` complex (``Re log_a < 0`` for a stable system), states ``[B, C, N]`` complex.

Three forms of the same map: :func:`fft_convolution` (O(T log T); circular FFT round-off makes a causal output
depend, at ~1e-16, on later inputs), :func:`s4d_scan` (blocks: an exact causal Toeplitz product inside each block,
the state carried between blocks; it starts from and returns a state, so it also decodes), and the reference
:func:`s4d_recurrence`, one step per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize(log_dt: torch.Tensor, a: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Zero-order hold with ``B = 1``: ``log_a = dt A`` and ``c_bar = c (exp(dt A) - 1) / A``.

    ``log_dt [C]`` real, ``a [C, N]`` complex, ``c [..., C, N]`` complex -> ``log_a [C, N]``, ``c_bar [..., C, N]``.
    """
    log_a = a * log_dt.exp()[:, None]
    return log_a, c * (log_a.exp() - 1) / a


def decay_powers(log_a: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """``exp(log_a * e)`` for each exponent: ``log_a [C, N]``, ``exponents [L]`` -> ``[C, N, L]``."""
    return torch.exp(log_a[..., None] * exponents.to(log_a.real.dtype))


def s4d_kernel(log_a: torch.Tensor, c: torch.Tensor, length: int) -> torch.Tensor:
    """The convolution kernel ``K [C, L]`` (real) of the system ``(log_a, c)``, both ``[C, N]``."""
    powers = decay_powers(log_a, torch.arange(length, device=log_a.device))
    return 2 * torch.einsum("cn,cnl->cl", c, powers).real


def fft_convolution(u: torch.Tensor, kernel: torch.Tensor, backward_kernel: torch.Tensor | None = None) -> torch.Tensor:
    r"""``y[t] = sum_{s <= t} K[t - s] u[s]`` (+ ``sum_{s > t} K_b[s - t - 1] u[s]`` with a backward kernel).

    ``u [B, T, C]``, ``kernel`` and ``backward_kernel`` ``[C, T]`` -> ``[B, T, C]``. Both kernels share one
    circular convolution of length ``2T``: the forward kernel on lags ``0..T-1``, the backward one reversed on
    ``T..2T-1`` (lags ``-T..-1``), so neither wraps onto the other.
    """
    length = u.shape[1]
    full = F.pad(kernel, (0, length))
    if backward_kernel is not None:
        full = full + F.pad(backward_kernel.flip(-1), (length, 0))
    spectrum = torch.fft.rfft(u, n=2 * length, dim=1) * torch.fft.rfft(full, dim=-1).transpose(0, 1)
    return torch.fft.irfft(spectrum, n=2 * length, dim=1)[:, :length]


def advance(state: torch.Tensor, u: torch.Tensor, log_a: torch.Tensor) -> torch.Tensor:
    """The state after reading ``u [B, L, C]`` from ``state [B, C, N]``: ``a^L x + sum_j a^(L-1-j) u_j``."""
    length = u.shape[1]
    weights = decay_powers(log_a, torch.arange(length - 1, -1, -1, device=u.device))
    return state * (log_a * length).exp() + torch.einsum("blc,cnl->bcn", u.to(weights.dtype), weights)


def zero_state(u: torch.Tensor, log_a: torch.Tensor) -> torch.Tensor:
    """``[B, C, N]`` zeros: the state before the first token."""
    return u.new_zeros(u.shape[0], *log_a.shape, dtype=log_a.dtype)


def s4d_scan(u: torch.Tensor, log_a: torch.Tensor, c: torch.Tensor, state: torch.Tensor | None = None,
             block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Causal S4D in blocks: exactly causal, and continues from ``state``.

    Inside a block of ``L`` tokens the output is a masked ``[L, L]`` Toeplitz product with the kernel; the state
    entering the block adds ``2 Re(c a^(i+1) x)`` at its position ``i``.

    Args:
        u: ``[B, T, C]`` real.
        log_a, c: ``[C, N]`` complex.
        state: ``[B, C, N]`` complex, the state after the previous token (None: zeros).
        block: block length; work is O(T (L + N)) per channel.
    Returns:
        ``y [B, T, C]`` in ``u``'s dtype and the state after the last token.
    """
    batch, length, channels = u.shape
    size = min(block, length)
    lag = torch.arange(size, device=u.device)
    lag = lag[:, None] - lag[None, :]
    kernel = s4d_kernel(log_a, c, size)
    toeplitz = kernel[:, lag.clamp(min=0)] * (lag >= 0)  # [C, L, L]: zero above the diagonal, exactly
    blocks = F.pad(u, (0, 0, 0, -length % size)).unflatten(1, (-1, size))  # [B, n, L, C]
    # What each whole block adds to the state, all blocks at once; only the carry between blocks is sequential.
    within = decay_powers(log_a, torch.arange(size - 1, -1, -1, device=u.device))  # [C, N, L]
    added = torch.einsum("bklc,cnl->bkcn", blocks.to(within.dtype), within)
    block_decay = (log_a * size).exp()
    entering, state = [], zero_state(u, log_a) if state is None else state
    for block_added in added.unbind(1):  # unbind: indexing in a loop would make the backward quadratic in T
        entering.append(state)
        state = state * block_decay + block_added
    if length % size:  # the last block is partial: its padding must not age the state
        state = advance(entering[-1], u[:, length - length % size:], log_a)
    readout = c[..., None] * decay_powers(log_a, torch.arange(1, size + 1, device=u.device))  # [C, N, L]
    from_state = 2 * torch.einsum("bkcn,cni->bkic", torch.stack(entering, 1), readout).real
    y = torch.einsum("bkjc,cij->bkic", blocks, toeplitz) + from_state
    return y.flatten(1, 2)[:, :length].to(u.dtype), state


def s4d_recurrence(u: torch.Tensor, log_a: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: one recurrence step per token. Same arguments and results as :func:`s4d_scan`."""
    decay = log_a.exp()
    state = zero_state(u, log_a) if state is None else state
    outputs = []
    for t in range(u.shape[1]):
        state = decay * state + u[:, t, :, None]
        outputs.append(2 * (c * state).sum(-1).real)
    return torch.stack(outputs, 1).to(u.dtype), state


def bidirectional_recurrence(u: torch.Tensor, log_a: torch.Tensor, forward_c: torch.Tensor,
                             backward_c: torch.Tensor) -> torch.Tensor:
    """Reference for the two-kernel :func:`fft_convolution`: a forward recurrence plus a backward one that reads
    only later tokens. ``u [B, T, C]`` -> ``[B, T, C]``."""
    forward, _ = s4d_recurrence(u, log_a, forward_c)
    backward, _ = s4d_recurrence(u.flip(1), log_a, backward_c)
    return forward + F.pad(backward.flip(1)[:, 1:], (0, 0, 0, 1))
