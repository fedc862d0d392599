"""S4D: a diagonal state-space layer in place of attention (Gu et al., 2022)."""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common import accumulation_dtype, positive_int
from ..ops.s4d import S4DCache, discretize, fft_convolution, s4d_kernel, s4d_scan
from .base import Mechanism, add_initialised, element_size, zero_padded

SYSTEM_LR_CAP = 1e-3  # the S4D reference's peak learning rate for A and dt


def log_uniform(size: int, *, low: float, high: float) -> torch.Tensor:
    """``[size]`` logs drawn uniformly between ``log(low)`` and ``log(high)`` (S4D's ``dt``)."""
    return torch.empty(size).uniform_(math.log(low), math.log(high))


def imaginary_parts(dim: int, modes: int) -> torch.Tensor:
    """S4D-Lin's ``Im(A) = pi n`` for each mode ``n``, ``[dim, modes]``, in the default dtype (computed in float32 at
    least), as the layer's other tensors are."""
    dtype = accumulation_dtype(torch.get_default_dtype())
    return (math.pi * torch.arange(modes, dtype=dtype)).expand(dim, modes).to(torch.get_default_dtype(), copy=True)


def complex_normal(*shape: int) -> torch.Tensor:
    """A standard complex normal ``[*shape]`` as ``[*shape, 2]`` real numbers in the default dtype (drawn in
    complex64, complex128 under a float64 default: torch has no complex bfloat16)."""
    complex_dtype = torch.cdouble if torch.get_default_dtype() == torch.float64 else torch.cfloat
    return torch.view_as_real(torch.randn(*shape, dtype=complex_dtype)).to(torch.get_default_dtype())


def check_time_steps(dt_min: float, dt_max: float) -> None:
    """Refuse a range of initial steps that is not ``0 < dt_min <= dt_max``, finite numbers (an infinite one failed
    in the uniform draw, a string in the comparison, neither naming the option)."""
    for name, value in (("dt_min", dt_min), ("dt_max", dt_max)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"S4DLayer {name} must be a finite number, got {value!r}")
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"S4DLayer needs 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")


class S4DLayer(Mechanism):
    r"""The S4D block: a complex diagonal SSM on every channel of ``x``, a ``D`` skip, GELU, then a linear map to
    ``2 dim`` and a GLU, as in the reference S4D block. There is no input projection and no q/k/v: channels are
    independent and ``heads`` only has to divide ``dim``.

    Each channel has ``state_size / 2`` complex modes (the other half are their conjugates), initialised S4D-Lin
    (``A_n = -1/2 + i pi n``), discretised by zero-order hold with a learned step ``dt`` (log-uniform in
    ``[dt_min, dt_max]`` at init); as in the reference, ``A`` and ``dt`` are not weight-decayed and train at a
    peak learning rate of at most ``1e-3``. Causal: the exact blocked scan of :func:`~lavo.ops.s4d.s4d_scan`, whose
    complex state ``[B, dim, state_size / 2]`` is the cache, so decoding equals the full forward. Non-causal: one
    FFT convolution with a forward and a backward kernel (shared ``A`` and ``dt``, separate ``C``).

    Padded inputs are zeroed before the SSM: they never reach real positions, but still count as elapsed time.

    ``forward(x [B, T, dim], padding_mask [B, T] | None, cache: S4DCache | None) -> (y [B, T, dim], cache)``.
    """

    cache_types = (S4DCache,)

    def __init__(self, dim: int, heads: int, *, causal: bool = True, state_size: int = 64, dt_min: float = 1e-3,
                 dt_max: float = 1e-1):
        super().__init__(dim, heads, causal=causal)
        if not positive_int(state_size) or state_size < 2 or state_size % 2:  # 64.0 failed in torch.full
            raise ValueError(f"S4DLayer state_size must be a positive even number (conjugate pairs), got {state_size}")
        check_time_steps(dt_min, dt_max)
        modes = state_size // 2
        self.state_size = state_size
        add_initialised(self, "log_dt", partial(log_uniform, dim, low=dt_min, high=dt_max))
        add_initialised(self, "log_a_real", partial(torch.full, (dim, modes), math.log(0.5)))
        add_initialised(self, "a_imag", partial(imaginary_parts, dim, modes))
        add_initialised(self, "c", partial(complex_normal, 1 if causal else 2, dim, modes))
        add_initialised(self, "skip", partial(torch.randn, dim))
        self.to_glu = nn.Linear(dim, 2 * dim)

    def system(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The discrete system: ``log_a [dim, N/2]`` and ``c_bar [directions, dim, N/2]``, complex64 (complex128 for
        float64 parameters): a bfloat16 or float16 layer keeps its system in float32, as torch has no complex
        bfloat16 and few complex float16 ops."""
        dtype = accumulation_dtype(self.log_dt.dtype)
        a = torch.complex(-self.log_a_real.to(dtype).exp(), self.a_imag.to(dtype))
        return discretize(self.log_dt.to(dtype), a, torch.view_as_complex(self.c.to(dtype)))

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache: S4DCache | None = None) -> tuple[torch.Tensor, S4DCache | None]:
        self.check_call(x, padding_mask, cache)
        u = x if padding_mask is None else x.masked_fill(~padding_mask[..., None], 0)
        log_a, c = self.system()
        if cache is not None:
            self.check_cache(cache, x.shape[0])
        ssm_input = u.to(log_a.real.dtype)  # the SSM runs in the system's precision (no bfloat16 FFT either)
        if self.causal:
            y, cache = s4d_scan(ssm_input, log_a, c[0], cache)
        else:
            length = x.shape[1]
            y = fft_convolution(ssm_input, s4d_kernel(log_a, c[0], length), s4d_kernel(log_a, c[1], length))
        y = F.gelu(y.to(x.dtype) + self.skip * u)
        return zero_padded(F.glu(self.to_glu(y), dim=-1), padding_mask), cache

    def no_weight_decay(self) -> list[nn.Parameter]:
        # As in the S4D reference: the system's A and dt are neither decayed nor trained faster than 1e-3.
        return self.system_parameters()

    def learning_rate_caps(self) -> list[tuple[list[nn.Parameter], float]]:
        return [(self.system_parameters(), SYSTEM_LR_CAP)]

    def system_parameters(self) -> list[nn.Parameter]:
        """What sets the state matrix and the step: ``log_dt``, ``log_a_real`` and ``a_imag``."""
        return [self.log_dt, self.log_a_real, self.a_imag]

    def residual_weights(self) -> list[nn.Parameter]:
        # The GLU's output is what this layer adds to the residual stream; its scale follows this projection.
        return [self.to_glu.weight]

    def cache_nbytes(self, batch_size: int, context: int, dtype: torch.dtype = torch.float32) -> int:
        # one complex number per channel and mode, in the parameters' precision, at least float32 (torch has no
        # bfloat16 complex numbers, and the recurrence sums in float32 for 16-bit layers anyway)
        real = accumulation_dtype(torch.promote_types(dtype, self.log_a_real.dtype))
        return batch_size * self.dim * (self.state_size // 2) * 2 * element_size(real)

    def check_cache(self, cache: S4DCache, batch: int) -> None:
        expected = (batch, self.dim, self.state_size // 2)
        if not isinstance(cache, S4DCache) or tuple(cache.state.shape) != expected:
            raise ValueError(f"S4DLayer cache must be an S4DCache with a state of shape {expected}; pass what the "
                             f"previous call returned")

    def _new_cache(self, batch_size: int, *, device: torch.device | str, dtype: torch.dtype) -> S4DCache:
        return S4DCache.empty(batch_size, self.dim, self.state_size // 2, device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, state_size={self.state_size}, causal={self.causal}"
