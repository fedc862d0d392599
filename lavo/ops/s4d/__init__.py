r"""Diagonal state spaces (S4D, Gu et al. 2022) as per-channel long convolutions or recurrences.

Each of ``C`` channels is a discrete linear system with ``N`` complex modes (one mode of each conjugate pair;
the pair's sum is the factor 2 of the real part). With the input matrix folded into ``c``:

    ``x_t = exp(log_a) * x_{t-1} + u_t``,   ``y_t = 2 Re(c . x_t)``

so ``y = K * u`` with the kernel ``K[l] = 2 Re(sum_n c_n exp(l log_a_n))``. Inputs are ``u [B, T, C]`` real,
``log_a, c [C, N]`` complex (``Re log_a < 0`` for a stable system), states ``[B, C, N]`` complex
(held with the position by :class:`S4DCache`).

Three forms of the same map: ``kernel.fft_convolution`` (O(T log T); circular FFT round-off makes a causal output
depend, at ~1e-16, on later inputs), ``scan.s4d_scan`` (blocks: an exact causal Toeplitz product inside each block,
the state carried between blocks; it starts from and returns a state, so it also decodes), and the reference
``naive.s4d_recurrence``, one step per token.
"""
from .kernel import decay_powers, discretize, fft_convolution, s4d_kernel
from .naive import bidirectional_recurrence, s4d_recurrence
from .scan import S4DCache, advance, s4d_scan

__all__ = ["discretize", "decay_powers", "s4d_kernel", "fft_convolution", "advance", "s4d_scan", "S4DCache",
           "s4d_recurrence", "bidirectional_recurrence"]
