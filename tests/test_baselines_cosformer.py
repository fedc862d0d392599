"""cosFormer: chunked prefix sums and the associative form against the explicit cos-weighted quadratic form."""
import math

import pytest
import torch
from reference_checks import assert_same_outputs_and_grads

from lavo import build_attention
from lavo.ops.cosformer import (CosformerCache, cosformer_attention, cosformer_attention_causal,
                                 cosformer_attention_naive)

HEADS, HEAD_DIM = 3, 5


def _qkv(length, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, length, HEADS, HEAD_DIM)
    return [torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3)]


def _mask(length):
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[0, : length // 3] = False
    mask[1, length // 2: length // 2 + 3] = length < 4
    return mask


@pytest.mark.parametrize("length, chunk, max_length", [(63, 64, 63), (63, 8, 100), (1, 64, 1), (17, 1, 40)])
@pytest.mark.parametrize("padded", [False, True])
def test_causal_prefix_sums_match_quadratic_form(length, chunk, max_length, padded):
    q, k, v = _qkv(length)
    mask = _mask(length) if padded else None
    out, cache = cosformer_attention_causal(q, k, v, max_length, padding_mask=mask, chunk=chunk)
    naive = cosformer_attention_naive(q, k, v, causal=True, max_length=max_length, padding_mask=mask)
    assert_same_outputs_and_grads(out, naive, [q, k, v], mask)
    assert cache.position == length


@pytest.mark.parametrize("length", [63, 2, 1])
@pytest.mark.parametrize("padded", [False, True])
def test_noncausal_matches_quadratic_form(length, padded):
    q, k, v = _qkv(length)
    mask = _mask(length) if padded else None
    out = cosformer_attention(q, k, v, padding_mask=mask)
    reference = cosformer_attention_naive(q, k, v, causal=False, padding_mask=mask)
    assert_same_outputs_and_grads(out, reference, [q, k, v], mask)


def test_noncausal_right_padding_equals_the_shorter_sequence():
    q, k, v = _qkv(20)
    mask = torch.ones(q.shape[:2], dtype=torch.bool)
    mask[:, 13:] = False
    padded = cosformer_attention(q, k, v, padding_mask=mask)
    torch.testing.assert_close(padded[:, :13], cosformer_attention(q[:, :13], k[:, :13], v[:, :13]))


def test_cache_continues_the_sequence():
    q, k, v = _qkv(40)
    full, _ = cosformer_attention_causal(q, k, v, 50, chunk=8)
    first, cache = cosformer_attention_causal(q[:, :13], k[:, :13], v[:, :13], 50, chunk=8)
    second, cache = cosformer_attention_causal(q[:, 13:], k[:, 13:], v[:, 13:], 50, cache=cache)
    torch.testing.assert_close(torch.cat([first, second], 1), full)
    assert cache.position == 40


def test_reweighting_favours_nearby_keys():
    # Equal, positive queries and keys: the weights are exactly the cos re-weighting.
    length = 9
    q = k = torch.ones(1, length, 1, 1, dtype=torch.float64)
    v = torch.eye(length, dtype=torch.float64)[None, :, None, :]
    out, _ = cosformer_attention_causal(q, k, v, max_length=length)
    distance = torch.arange(length - 1, -1, -1, dtype=torch.float64)
    expected = torch.cos(math.pi / 2 * distance / length)
    torch.testing.assert_close(out[0, -1, 0], expected / expected.sum())


def test_layer_cache_has_constant_size():
    layer = build_attention("cosformer", 16, 2, max_length=100)
    _, cache = layer(torch.randn(3, 4, 16))
    _, later = layer(torch.randn(3, 70, 16), cache=cache)
    assert cache.kv.shape == later.kv.shape == (3, 2, 16, 8) and cache.k_sum.shape == later.k_sum.shape == (3, 2, 16)
    assert later.position == 74


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="max_length must be a positive integer"):
        build_attention("cosformer", 16, 2, max_length=0)
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        build_attention("cosformer", 16, 2, chunk=1.5)
    layer = build_attention("cosformer", 16, 2, max_length=10)
    with pytest.raises(ValueError, match="reached position 10 but was built with max_length=10"):
        layer(torch.randn(1, 11, 16))
    _, cache = layer(torch.randn(2, 8, 16))
    with pytest.raises(ValueError, match="reached position 11 but was built with max_length=10"):
        layer(torch.randn(2, 4, 16), cache=cache)
    with pytest.raises(ValueError, match=r"^cache was built for batch size 2, got input of batch size 1$"):
        layer(torch.randn(1, 1, 16), cache=cache)
    _, other_heads = build_attention("cosformer", 16, 4, max_length=10)(torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match=r"cache sums must have shapes S \(2, 2, 16, 8\)"):
        layer(torch.randn(2, 1, 16), cache=other_heads)
    bidirectional = build_attention("cosformer", 16, 2, causal=False)
    with pytest.raises(ValueError, match="causal=False; a cache is only for causal decoding"):
        bidirectional(torch.randn(2, 4, 16), cache=cache)


@pytest.mark.parametrize("make_cache", [lambda layer: layer(torch.randn(1, 8, 16))[1],
                                        lambda layer: layer.empty_cache(1)])
def test_layer_refuses_a_cache_of_another_max_length(make_cache):
    # max_length is no weight, so a checkpoint loads into a layer of another one; the sums of a cache made with
    # M = 16 have the shapes of M = 4096's, and continuing them re-weighted the context wrongly without an error
    short = build_attention("cosformer", 16, 2, max_length=16)
    long = build_attention("cosformer", 16, 2, max_length=4096)
    long.load_state_dict(short.state_dict())
    with pytest.raises(ValueError, match=r"^the cache was made with max_length=16 \(this call: 4096\): its sums "
                                         r"carry that length's cos re-weighting; continue with the cache this layer "
                                         r"returned$"):
        long(torch.randn(1, 4, 16), cache=make_cache(short))


def test_layer_cache_records_its_max_length():
    layer = build_attention("cosformer", 16, 2, max_length=100)
    x = torch.randn(2, 12, 16)
    first, cache = layer(x[:, :5])
    second, later = layer(x[:, 5:], cache=cache)
    assert cache.max_length == later.max_length == layer.empty_cache(2).max_length == 100
    torch.testing.assert_close(torch.cat([first, second], 1), layer(x)[0])
    # an op's own cache of no length (CosformerCache.empty) fits any
    q, k, v = _qkv(6)
    empty = CosformerCache.empty(2, HEADS, HEAD_DIM, dtype=torch.float64)
    torch.testing.assert_close(cosformer_attention_causal(q, k, v, 50, cache=empty)[0],
                               cosformer_attention_causal(q, k, v, 50)[0])
