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


def _relative_error(y, expected):
    return ((y.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("how", ["module", "autocast"])
def test_cosformer_in_float16_keeps_its_sums_out_of_float16s_range(how):
    """S sums T products: past ~10K tokens of unit inputs it leaves float16's range. Computed in float16 (and,
    under autocast, read back through float16 einsums) the outputs were far off, or NaN, at 16K and 32K."""
    from lavo.ops.cosformer import cosformer_attention, cosformer_attention_causal
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 32768, 1, 16) for _ in range(3))
    half = [x.half() for x in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.float16, enabled=how == "autocast"):
        noncausal, (causal, _) = cosformer_attention(*half), cosformer_attention_causal(*half, 32768)
    assert noncausal.dtype == causal.dtype == torch.float16
    wide = [x.double() for x in (q, k, v)]
    assert _relative_error(noncausal, cosformer_attention(*wide)) < 0.005
    assert _relative_error(causal, cosformer_attention_causal(*wide, 32768)[0]) < 0.005


def test_performers_first_positions_in_float16_do_not_lose_their_denominator():
    """A query's and a key's features are normalised separately, so their products can be tiny: in float16 the
    first positions' denominators underflowed to zero or below the clamp, and their outputs were far off."""
    from lavo.ops.performer import orthogonal_random_features, performer_attention_causal
    torch.manual_seed(0)
    projection = orthogonal_random_features(64, 16)
    q, k, v = (torch.randn(1, 1024, 4, 16) * 2 for _ in range(3))
    expected = performer_attention_causal(q.double(), k.double(), v.double(), projection.double())[0]
    y = performer_attention_causal(q.half(), k.half(), v.half(), projection.half())[0]
    per_position = (y.double() - expected).norm(dim=-1) / expected.norm(dim=-1)
    # what is left is the features' own float16 rounding
    assert per_position[0, :8].max() < 0.1
