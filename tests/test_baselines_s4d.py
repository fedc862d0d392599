"""S4D: FFT convolution and blocked scan against the explicit recurrence (outputs and gradients), and the layer."""
import math

import pytest
import torch
from reference_checks import assert_same_outputs_and_grads

from lavo import build_attention
from lavo.ops.s4d import bidirectional_recurrence, fft_convolution, s4d_kernel, s4d_recurrence, s4d_scan

CHANNELS, MODES = 5, 3


def _system(seed=0):
    """Leaf tensors of a random stable system: real and imaginary parts of log_a, and two output vectors c."""
    g = torch.Generator().manual_seed(seed)
    decay = -(0.02 + 0.3 * torch.rand(CHANNELS, MODES, generator=g, dtype=torch.float64))
    frequency = 2 * torch.randn(CHANNELS, MODES, generator=g, dtype=torch.float64)
    c = torch.randn(2, CHANNELS, MODES, 2, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (decay, frequency, c)]


def _complex(decay, frequency, c):
    return torch.complex(decay, frequency), torch.view_as_complex(c)


def _input(batch, length, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, CHANNELS, generator=g, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("length, block", [(63, 64), (63, 8), (1, 64), (130, 64)])
def test_scan_matches_recurrence(length, block):
    params, u = _system(), _input(2, length)
    log_a, c = _complex(*params)
    y, cache = s4d_scan(u, log_a, c[0], block=block)
    y_ref, cache_ref = s4d_recurrence(u, log_a, c[0])
    torch.testing.assert_close(cache.state, cache_ref.state)
    assert cache.position == cache_ref.position == length
    assert_same_outputs_and_grads(y, y_ref, [u, *params])


@pytest.mark.parametrize("length", [63, 1])
def test_scan_continues_from_a_cache(length):
    params, u = _system(), _input(2, length)
    log_a, c = _complex(*params)
    _, start = s4d_recurrence(_input(2, 9, seed=3), log_a, c[0])
    y, cache = s4d_scan(u, log_a, c[0], start, block=16)
    y_ref, cache_ref = s4d_recurrence(u, log_a, c[0], start)
    torch.testing.assert_close(cache.state, cache_ref.state)
    assert cache.position == cache_ref.position == 9 + length
    assert_same_outputs_and_grads(y, y_ref, [u, *params])


@pytest.mark.parametrize("length", [63, 1])
def test_causal_fft_matches_recurrence(length):
    params, u = _system(), _input(2, length)
    log_a, c = _complex(*params)
    y = fft_convolution(u, s4d_kernel(log_a, c[0], length))
    assert_same_outputs_and_grads(y, s4d_recurrence(u, log_a, c[0])[0], [u, *params])


@pytest.mark.parametrize("length", [63, 2, 1])
def test_bidirectional_fft_matches_two_recurrences(length):
    params, u = _system(), _input(2, length)
    log_a, c = _complex(*params)
    y = fft_convolution(u, s4d_kernel(log_a, c[0], length), s4d_kernel(log_a, c[1], length))
    assert_same_outputs_and_grads(y, bidirectional_recurrence(u, log_a, c[0], c[1]), [u, *params])


def test_bidirectional_reads_later_tokens_only_through_the_backward_kernel():
    params, u = _system(), _input(1, 20)
    log_a, c = _complex(*params)
    y = fft_convolution(u, s4d_kernel(log_a, c[0], 20), s4d_kernel(log_a, c[1], 20))
    (grad,) = torch.autograd.grad(y[0, 10, 0], u)
    assert grad[0, 11:, 0].abs().min() > 1e-6  # sees the future
    assert grad[0, :, 1:].abs().max() < 1e-12  # channels stay independent


def test_layer_init_is_s4d_lin_with_zoh():
    layer = build_attention("s4d", 8, 2, state_size=6)
    log_a, _ = layer.system()
    dt = layer.log_dt.exp()[:, None]
    torch.testing.assert_close(log_a.real, -0.5 * dt.expand(8, 3))
    torch.testing.assert_close(log_a.imag, math.pi * torch.arange(3.0) * dt)
    assert (1e-3 <= dt).all() and (dt <= 1e-1).all()


def test_layer_decoding_cache_has_constant_size():
    layer = build_attention("s4d", 8, 2, state_size=6)
    x = torch.randn(3, 50, 8)
    _, cache = layer(x[:, :10])
    _, cache_later = layer(x[:, 10:], cache=cache)
    assert cache.state.shape == cache_later.state.shape == (3, 8, 3) and cache.state.is_complex()


@pytest.mark.parametrize("causal", [True, False])
def test_layer_output_shape_and_dtype(causal):
    layer = build_attention("s4d", 12, 3, causal=causal).double()
    y, cache = layer(torch.randn(2, 7, 12, dtype=torch.float64))
    assert y.shape == (2, 7, 12) and y.dtype == torch.float64
    assert (cache is None) != causal


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="state_size must be a positive even number"):
        build_attention("s4d", 8, 2, state_size=5)
    with pytest.raises(ValueError, match=r"^S4DLayer state_size must be a positive even number \(conjugate pairs\), "
                                         r"got 4\.0$"):  # torch.full's TypeError named no option
        build_attention("s4d", 8, 2, state_size=4.0)
    with pytest.raises(ValueError, match="dt_min <= dt_max"):
        build_attention("s4d", 8, 2, dt_min=0.1, dt_max=0.01)
    for option, value in (("dt_max", float("inf")), ("dt_min", "1e-3"), ("dt_max", True)):
        # were torch's "to is out of bounds for float", a TypeError of '<', and a step range up to 1.0
        with pytest.raises(ValueError, match=rf"^S4DLayer {option} must be a finite number, got {value!r}$"):
            build_attention("s4d", 8, 2, **{option: value})
    with pytest.raises(ValueError, match="divisible by heads"):
        build_attention("s4d", 8, 3)
    bidirectional = build_attention("s4d", 8, 2, causal=False)
    with pytest.raises(ValueError, match="causal=False; a cache is only for causal decoding"):
        bidirectional(torch.randn(1, 3, 8), cache=bidirectional.empty_cache(1))
    layer = build_attention("s4d", 8, 2)
    _, cache = layer(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"^cache was built for batch size 2, got input of batch size 1$"):
        layer(torch.randn(1, 3, 8), cache=cache)
    _, smaller_state = build_attention("s4d", 8, 2, state_size=16)(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"cache must be an S4DCache with a state of shape \(2, 8, 32\)"):
        layer(torch.randn(2, 3, 8), cache=smaller_state)
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, 8\]"):
        layer(torch.randn(2, 3, 7))
    with pytest.raises(ValueError, match="padding_mask must be a bool tensor"):
        layer(torch.randn(2, 3, 8), padding_mask=torch.ones(2, 3))
