r"""The S4D system and its convolution kernel (see :mod:`lavo.ops.s4d`): zero-order-hold discretisation, the kernel
``K[l] = 2 Re(sum_n c_n exp(l log_a_n))``, and the FFT convolution with it (the non-causal form)."""
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
    return kernel_from_powers(c, decay_powers(log_a, torch.arange(length, device=log_a.device)))


def kernel_from_powers(c: torch.Tensor, powers: torch.Tensor) -> torch.Tensor:
    """``K [C, L]`` from ``c [C, N]`` and the powers ``a^0 .. a^(L-1)`` of :func:`decay_powers`, ``[C, N, L]``."""
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
