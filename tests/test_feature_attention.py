"""The feature-map attention Performer and cosFormer share: the associative and chunked prefix-sum forms against
the explicit [T, S] weights, on outputs and gradients, with padded keys and a sequence split across calls."""
import pytest
import torch
from reference_checks import assert_same_outputs_and_grads

from lavo.ops.feature_attention import causal_feature_attention, feature_attention, feature_attention_naive

EPS = 1e-6


def _inputs(T, S, padded):
    g = torch.Generator().manual_seed(T + S)
    q_feat, k_feat = (torch.rand(2, n, 3, 20, generator=g, dtype=torch.float64) for n in (T, S))
    v = torch.randn(2, S, 3, 60, generator=g, dtype=torch.float64)
    if padded:  # a padded key is one whose features are zero
        k_feat[1, : S // 3] = 0
    return [x.requires_grad_() for x in (q_feat, k_feat, v)]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("T,S", [(1, 1), (63, 63), (7, 40)])
def test_noncausal_form_matches_the_explicit_weights(T, S, padded):
    q_feat, k_feat, v = _inputs(T, S, padded)
    assert_same_outputs_and_grads(feature_attention(q_feat, k_feat, v, EPS),
                                  feature_attention_naive(q_feat, k_feat, v, causal=False, eps=EPS),
                                  [q_feat, k_feat, v])


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (63, 8), (63, 1), (40, 7)])
def test_causal_prefix_sums_match_the_explicit_weights(T, chunk, padded):
    q_feat, k_feat, v = _inputs(T, T, padded)
    out, _ = causal_feature_attention(q_feat, k_feat, v, eps=EPS, chunk=chunk)
    assert_same_outputs_and_grads(out, feature_attention_naive(q_feat, k_feat, v, causal=True, eps=EPS),
                                  [q_feat, k_feat, v])


@pytest.mark.parametrize("split", [1, 20, 62])
def test_the_carried_sums_continue_a_sequence(split):
    q_feat, k_feat, v = _inputs(63, 63, padded=True)
    first, sums = causal_feature_attention(q_feat[:, :split], k_feat[:, :split], v[:, :split], eps=EPS, chunk=8)
    rest, _ = causal_feature_attention(q_feat[:, split:], k_feat[:, split:], v[:, split:], sums, eps=EPS, chunk=8)
    assert_same_outputs_and_grads(torch.cat([first, rest], 1),
                                  feature_attention_naive(q_feat, k_feat, v, causal=True, eps=EPS),
                                  [q_feat, k_feat, v])
