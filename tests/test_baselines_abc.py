"""ABC with learned control: chunked prefix-sum form vs the per-step reference, decoding, prefix normalisation."""
import re

import pytest
import torch
from reference_checks import assert_same_outputs_and_grads

from lavo import build_attention
from lavo.ops.abc import abc_attention, abc_attention_naive


def _inputs(B, T, H, D, r, seed=0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    control = torch.randn(H, r, D, dtype=torch.float64, requires_grad=True)
    return q, k, v, control


def _mask(B, T):
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, : T // 4] = False  # left padding
    mask[-1, T // 2: T // 2 + 3] = False  # a hole
    return mask


@pytest.mark.parametrize("T, causal, chunk", [(63, True, 5), (1, True, 64), (63, False, 64), (1, False, 64)])
def test_fast_matches_naive_outputs_and_gradients(T, causal, chunk):
    q, k, v, control = _inputs(2, T, 2, 7, 3)
    mask = _mask(2, T)
    fast, _ = abc_attention(q, k, v, control, causal=causal, padding_mask=mask, chunk=chunk)
    slow = abc_attention_naive(q, k, v, control, causal=causal, padding_mask=mask)
    assert_same_outputs_and_grads(fast, slow, [q, k, v, control])


@pytest.mark.parametrize("causal", [True, False])
def test_uniform_control_gives_the_mean_of_the_prefix_values(causal):
    # With equal logits every slot is the mean of the (prefix) keys and values, whatever the read weights: a
    # per-step normalisation would give sums, not means.
    q, k, v, control = _inputs(2, 11, 2, 5, 4)
    mask = _mask(2, 11)
    out, _ = abc_attention(q, k, v, torch.zeros_like(control), causal=causal, padding_mask=mask, chunk=4)
    real = mask[:, :, None, None].double()
    if causal:
        expected = (v * real).cumsum(1) / real.cumsum(1).clamp(min=1)
    else:
        expected = (v * real).sum(1, keepdim=True) / real.sum(1, keepdim=True)
    torch.testing.assert_close(out, (expected * real).expand_as(out))


@pytest.mark.parametrize("control_scale, chunk, least", [(3, 64, 12), (200, 1, 300)])
def test_large_control_logits_stay_finite_and_exact_in_low_precision(control_scale, chunk, least):
    # Logits past `least`: a plain exp() overflows float16 (at 12) or even float32 (at 89).
    q, k, v, control = _inputs(1, 40, 2, 6, 3)
    control = control.detach() * control_scale
    assert torch.einsum("bthd,hrd->bthr", k, control).abs().max() > least
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        inputs = [x.detach().to(dtype) for x in (q, k, v, control)]
        fast, _ = abc_attention(*inputs, chunk=chunk)
        assert fast.dtype == dtype and torch.isfinite(fast).all()
        slow = abc_attention_naive(*(x.double() for x in inputs))
        torch.testing.assert_close(fast.double(), slow, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("rise", [30, 50, 75])
def test_a_logit_rising_far_within_a_chunk_keeps_exact_gradients(rise):
    # The earlier positions' normalisers fall to exp(-rise) of the chunk's reference: past ~44, 1 / n^2 in torch's
    # backward of 1 / n overflowed float32, and the gradients of k and the control were inf and NaN.
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 8, 1, 4, dtype=torch.float64)
    k[0, :, 0] = torch.linspace(0, rise / 4, 8)[:, None]
    control = torch.ones(1, 1, 4, dtype=torch.float64)
    weights = torch.randn(1, 8, 1, 4, dtype=torch.float64)
    grads = []
    for dtype, op in ((torch.float32, abc_attention), (torch.float64, abc_attention_naive)):
        inputs = [x.to(dtype).requires_grad_() for x in (q, k, v, control)]
        out = op(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        grads.append([out, *torch.autograd.grad((out * weights.to(dtype)).sum(), inputs)])
    for got, want in zip(*grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_padded_token_by_token_decoding_matches_full_forward_with_constant_cache():
    torch.manual_seed(0)
    layer = build_attention("abc", 12, 2, causal=True, slots=5).double()
    x = torch.randn(2, 17, 12, dtype=torch.float64)
    mask = _mask(2, 17)
    full, full_cache = layer(x, padding_mask=mask)
    cache, outputs = layer.empty_cache(2), []
    for t in range(17):
        y, cache = layer(x[:, t:t + 1], padding_mask=mask[:, t:t + 1], cache=cache)
        outputs.append(y)
        assert cache.keys.shape == (2, 2, 5, 6)
    torch.testing.assert_close(torch.cat(outputs, 1), full)
    torch.testing.assert_close(cache.normaliser / cache.normaliser.sum(-1, keepdim=True),
                               full_cache.normaliser / full_cache.normaliser.sum(-1, keepdim=True))


def test_impossible_requests_are_named():
    with pytest.raises(ValueError, match="slots must be a positive integer"):
        build_attention("abc", 8, 2, slots=0)
    q = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match=r"control must have shape \[H, r, D\]"):
        abc_attention(q, q, q, torch.randn(2, 3, 5))
    layer = build_attention("abc", 8, 2)
    with pytest.raises(ValueError, match="a cache exists only for causal attention"):
        abc_attention(q, q, q, layer.control, causal=False, cache=layer.empty_cache(1))
    with pytest.raises(ValueError, match="cache was built for batch size 1"):
        layer(torch.randn(2, 3, 8), cache=layer.empty_cache(1))


@pytest.mark.parametrize("other", [dict(dim=8, heads=2, slots=3), dict(dim=8, heads=4, slots=4)])
def test_a_cache_of_another_layer_shape_is_refused_by_name(other):
    # torch's broadcasting error named neither the cache nor the slots ("The size of tensor a (4) must match ...")
    layer = build_attention("abc", 8, 2, slots=4)
    other = build_attention("abc", other.pop("dim"), other.pop("heads"), **other)
    _, cache = other(torch.randn(1, 3, 8))
    shape = tuple(cache.keys.shape)
    with pytest.raises(ValueError, match=rf"^the cache holds memories \[B, H, slots, D\] = {re.escape(str(shape))}, "
                                         r"this call \(1, 2, 4, 4\): pass the cache the previous call returned$"):
        layer(torch.randn(1, 2, 8), cache=cache)
