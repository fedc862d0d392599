r"""Causal S4D in blocks (see :mod:`lavo.ops.s4d`): an exact causal Toeplitz product inside each block, the state
carried between blocks, so it starts from and returns a cache and also decodes."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...cache import Cache
from .kernel import decay_powers, kernel_from_powers


@dataclass(frozen=True)
class S4DCache(Cache):
    """Decoding cache: the complex ``state [B, C, N]`` after the last token, and ``position``, the tokens seen."""

    state: torch.Tensor
    position: int

    @classmethod
    def empty(cls, batch: int, channels: int, modes: int, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> S4DCache:
        """The cache before the first token: a zero state, complex of ``dtype``'s precision (complex64 for
        float32 or complex64, complex128 for float64 or complex128)."""
        dtype = torch.promote_types(torch.get_default_dtype() if dtype is None else dtype, torch.complex64)
        return cls(torch.zeros(batch, channels, modes, dtype=dtype, device=device), 0)


def advance(state: torch.Tensor, u: torch.Tensor, log_a: torch.Tensor) -> torch.Tensor:
    """The state after reading ``u [B, L, C]`` from ``state [B, C, N]``: ``a^L x + sum_j a^(L-1-j) u_j``."""
    length = u.shape[1]
    weights = decay_powers(log_a, torch.arange(length - 1, -1, -1, device=u.device))
    return state * (log_a * length).exp() + torch.einsum("blc,cnl->bcn", u.to(weights.dtype), weights)


def s4d_scan(u: torch.Tensor, log_a: torch.Tensor, c: torch.Tensor, cache: S4DCache | None = None,
             block: int = 64) -> tuple[torch.Tensor, S4DCache]:
    r"""Causal S4D in blocks: exactly causal, and continues from ``cache``.

    Inside a block of ``L`` tokens the output is a masked ``[L, L]`` Toeplitz product with the kernel; the state
    entering the block adds ``2 Re(c a^(i+1) x)`` at its position ``i``.

    Args:
        u: ``[B, T, C]`` real.
        log_a, c: ``[C, N]`` complex.
        cache: the state after the previous token (None: the start, a zero state).
        block: block length; work is O(T (L + N)) per channel.
    Returns:
        ``y [B, T, C]`` in ``u``'s dtype and the cache after the last token.
    """
    batch, length, channels = u.shape
    size = min(block, length)
    lag = torch.arange(size, device=u.device)
    lag = lag[:, None] - lag[None, :]
    powers = decay_powers(log_a, torch.arange(size + 1, device=u.device))  # [C, N, L + 1]: a^0 .. a^L, once
    kernel = kernel_from_powers(c, powers[..., :size])
    toeplitz = kernel[:, lag.clamp(min=0)] * (lag >= 0)  # [C, L, L]: zero above the diagonal, exactly
    blocks = F.pad(u, (0, 0, 0, -length % size)).unflatten(1, (-1, size))  # [B, n, L, C]
    # What each whole block adds to the state, all blocks at once; only the carry between blocks is sequential.
    # The input is real: a real product with the powers' real and imaginary parts, not a complex one with u + 0i.
    within = torch.view_as_real(powers[..., :size].flip(-1))  # [C, N, L, 2]: a^(L-1) .. a^0
    with torch.autocast(u.device.type, enabled=False):  # the system's precision (autocast leaves complex alone)
        added = torch.einsum("bklc,cnlz->bkcnz", blocks.to(within.dtype), within)
    added = torch.view_as_complex(added.contiguous())  # [B, n, C, N]
    block_decay = (log_a * size).exp()
    cache = S4DCache.empty(batch, *log_a.shape, dtype=log_a.dtype, device=u.device) if cache is None else cache
    entering, state = [], cache.state.to(log_a.dtype)  # the system's precision, whatever the cache was made in
    for block_added in added.unbind(1):  # unbind: indexing in a loop would make the backward quadratic in T
        entering.append(state)
        state = state * block_decay + block_added
    if length % size:  # the last block is partial: its padding must not age the state
        state = advance(entering[-1], u[:, length - length % size:], log_a)
    readout = c[..., None] * powers[..., 1:]  # [C, N, L]: c a^(i+1)
    # only the real part is kept: Re(x r) = x.re r.re - x.im r.im as one real product
    readout = torch.stack([readout.real, -readout.imag], -1)
    with torch.autocast(u.device.type, enabled=False):
        from_state = 2 * torch.einsum("bkcnz,cniz->bkic", torch.view_as_real(torch.stack(entering, 1)), readout)
    y = torch.einsum("bkjc,cij->bkic", blocks, toeplitz) + from_state
    return y.flatten(1, 2)[:, :length].to(u.dtype), S4DCache(state, cache.position + length)
