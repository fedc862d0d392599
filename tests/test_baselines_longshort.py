"""Transformer-LS: blocked form vs the per-query reference, landmark visibility, errors."""
import pytest
import torch
from reference_checks import assert_same_outputs_and_grads

from lavo import build_attention
from lavo.ops.longshort import longshort_attention, longshort_attention_naive


def _inputs(B, T, H, D, r):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(H, D, r, dtype=torch.float64, requires_grad=True)


def _dual_norm(H, D):
    g = torch.Generator().manual_seed(5)
    return tuple(tuple((scale + torch.randn(H * D, generator=g, dtype=torch.float64)).requires_grad_()
                       for scale in (1.0, 0.0)) for _ in range(2))


@pytest.mark.parametrize("dual_ln", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 63])
def test_blocked_matches_naive_outputs_and_gradients(T, causal, dual_ln):
    q, k, v, projection = _inputs(2, T, 2, 7, 3)
    norms = _dual_norm(2, 7) if dual_ln else None
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, : T // 3] = False
    mask[1, T // 2: T // 2 + 9] = False  # a whole segment of padding
    fast = longshort_attention(q, k, v, projection, window=8, causal=causal, padding_mask=mask, dual_norm=norms)
    slow = longshort_attention_naive(q, k, v, projection, window=8, causal=causal, padding_mask=mask,
                                     dual_norm=norms)
    # T=1 causal: no completed segment, so the reference never touches the projection (zero gradient).
    leaves = [q, k, v, projection] + ([t for pair in norms for t in pair] if dual_ln else [])
    assert_same_outputs_and_grads(fast, slow, leaves)


def test_dual_ln_normalises_window_and_landmark_keys_separately():
    q, k, v, projection = (x.detach() for x in _inputs(1, 32, 2, 4, 1))
    plain = longshort_attention(q, k, v, projection, window=8)
    unit = tuple((torch.ones(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)) for _ in range(2))
    normed = longshort_attention(q, k, v, projection, window=8, dual_norm=unit)
    # Keys 10x larger (and a projection 10x smaller, so the landmark weights stay) score 10x higher without
    # DualLN; normalised, window keys and landmark keys are the same again.
    assert not torch.allclose(longshort_attention(q, 10 * k, v, projection / 10, window=8), plain)
    scaled = longshort_attention(q, 10 * k, v, projection / 10, window=8, dual_norm=unit)
    torch.testing.assert_close(scaled, normed, atol=1e-4, rtol=0)  # up to the layer norm's epsilon
    layer = build_attention("longshort", 16, 2)
    assert layer.short_norm is not None and layer.long_norm is not None
    assert build_attention("longshort", 16, 2, dual_ln=False).short_norm is None


def test_causal_queries_reach_past_their_window_only_through_landmarks():
    # Values are non-zero only in segment 0; from window 2 on, no window key is there, so any non-zero output
    # comes from segment 0's landmarks (and is diluted by the window keys).
    q, k, v, projection = (x.detach() for x in _inputs(1, 16, 1, 4, 2))
    v = torch.zeros_like(v)
    v[:, :4] = 1
    out = longshort_attention(q, k, v, projection, window=4)
    assert torch.all(out[:, 8:] > 0) and torch.all(out[:, 8:] < 1)
    torch.testing.assert_close(out[:, :4], torch.ones_like(out[:, :4]))


def test_layer_defaults_and_impossible_requests():
    causal, bidirectional = build_attention("longshort", 16, 2), build_attention("longshort", 16, 2, causal=False)
    assert (causal.window, causal.landmarks, bidirectional.landmarks) == (64, 1, 32)
    with pytest.raises(ValueError, match="LongShortAttention has no decoding form"):
        causal(torch.randn(1, 3, 16), cache=object())
    with pytest.raises(ValueError, match="landmarks must be a positive integer"):
        build_attention("longshort", 16, 2, landmarks=0)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        build_attention("longshort", 16, 2, window=0)
    q = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match=r"projection must have shape \[H, D, r\]"):
        longshort_attention(q, q, q, torch.randn(2, 5, 3), window=2)
