"""Performer (FAVOR+): chunked prefix sums and the associative form against explicit quadratic weights."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint
from reference_checks import assert_matches_reference, assert_same_outputs_and_grads

from lavo import build_attention
from lavo.layers import after_optimizer_step
from lavo.ops.performer import (orthogonal_random_features, performer_attention, performer_attention_causal,
                                performer_attention_log_space, performer_attention_naive)

HEADS, HEAD_DIM, FEATURES = 3, 5, 7


def _qkv(length, batch=2, scale=0.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, length, HEADS, HEAD_DIM)
    return [(scale * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_() for _ in range(3)]


def _projection():
    return orthogonal_random_features(FEATURES, HEAD_DIM, torch.Generator().manual_seed(1)).double()


def _mask(length):
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[0, : length // 3] = False
    mask[1, -1] = length == 1  # a single position stays real
    return mask


@pytest.mark.parametrize("length, chunk", [(63, 64), (63, 8), (1, 64), (17, 1)])
@pytest.mark.parametrize("padded", [False, True])
def test_causal_prefix_sums_match_quadratic_form(length, chunk, padded):
    q, k, v = _qkv(length)
    mask = _mask(length) if padded else None
    out, _ = performer_attention_causal(q, k, v, _projection(), padding_mask=mask, chunk=chunk)
    naive = performer_attention_naive(q, k, v, _projection(), causal=True, padding_mask=mask)
    assert_same_outputs_and_grads(out, naive, [q, k, v], mask)


@pytest.mark.parametrize("length", [63, 1])
@pytest.mark.parametrize("padded", [False, True])
def test_noncausal_matches_quadratic_form(length, padded):
    q, k, v = _qkv(length)
    mask = _mask(length) if padded else None
    out = performer_attention(q, k, v, _projection(), padding_mask=mask)
    naive = performer_attention_naive(q, k, v, _projection(), causal=False, padding_mask=mask)
    assert_same_outputs_and_grads(out, naive, [q, k, v], mask)


def test_cache_continues_the_sequence():
    q, k, v = _qkv(40)
    full, full_cache = performer_attention_causal(q, k, v, _projection(), chunk=8)
    first, cache = performer_attention_causal(q[:, :13], k[:, :13], v[:, :13], _projection(), chunk=8)
    second, cache = performer_attention_causal(q[:, 13:], k[:, 13:], v[:, 13:], _projection(), cache=cache)
    torch.testing.assert_close(torch.cat([first, second], 1), full)
    assert [t.shape for t in cache.tensors()] == [t.shape for t in full_cache.tensors()]
    assert cache.position == full_cache.position == 40


def test_growing_key_maximum_is_rescaled_exactly():
    q, k, v = _qkv(30, scale=0.3)
    with torch.no_grad():
        k[:, 20:] *= 8  # much larger exponents late in the sequence
    out, _ = performer_attention_causal(q, k, v, _projection(), chunk=4)
    torch.testing.assert_close(out, performer_attention_naive(q, k, v, _projection(), causal=True))


def test_a_query_reads_its_keys_however_far_below_a_later_keys_exponents_they_lie():
    """The keys were scaled by their chunk's largest exponent, so a query whose visible keys lay more than ~87 below
    a later key's (float32) read nothing: one call gave zeros where token-by-token decoding gave the values."""
    q, k, v = (t.detach().float() for t in _qkv(8, scale=1.0))
    k[:, 0] *= 12  # -|k'|^2 / 2: the first key's exponents lie far below the later ones', in the same chunk
    projection = _projection().float()
    reference = performer_attention_naive(q.double(), k.double(), v.double(), projection.double(), causal=True)
    out, _ = performer_attention_causal(q, k, v, projection)
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-4)
    decoded, cache = [], None
    for t in range(8):
        step, cache = performer_attention_causal(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], projection, cache=cache)
        decoded.append(step)
    torch.testing.assert_close(out, torch.cat(decoded, 1), atol=1e-5, rtol=1e-5)


def test_stabilised_features_survive_where_plain_exponentials_underflow():
    q, k, v = (t.detach().float() for t in _qkv(20))
    # Keys of scaled length 15: exponents -|k'|^2 / 2 + w.k' in about [-145, -79], below float32's smallest
    # normal number (e^-87), though within e^-66 of each other.
    k = 15 * HEAD_DIM ** 0.25 * k / k.norm(dim=-1, keepdim=True)
    projection = _projection().float()
    plain = performer_attention_naive(q, k, v, projection, causal=True)
    out, _ = performer_attention_causal(q, k, v, projection)
    reference = performer_attention_naive(q.double(), k.double(), v.double(), projection.double(), causal=True)
    assert not torch.allclose(plain.double(), reference, atol=1e-2)
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_log_space_reference_equals_the_explicit_weights(causal, padded):
    q, k, v = _qkv(23)
    mask = _mask(23) if padded else None
    explicit = performer_attention_naive(q, k, v, _projection(), causal=causal, padding_mask=mask)
    log_space = performer_attention_log_space(q, k, v, _projection(), causal=causal, padding_mask=mask)
    assert_same_outputs_and_grads(log_space, explicit, [q, k, v], mask)


@pytest.mark.parametrize("causal", [False, True])
def test_float32_holds_to_the_reference_on_heads_far_sharper_than_its_features_range(causal):
    """Head dimension 64 with queries and keys of standard deviation 6: logits q.k / sqrt(D) of up to 160 and
    feature exponents from -50 to -265 (median -140), so nearly every explicit float32 feature underflows. The
    stabilised fast forms hold to the float64 log-space reference on outputs and on every gradient. (Past
    logits of about 500 they do not: DESIGN, "Performer's range", and tests/performer_range.py.)"""
    g = torch.Generator().manual_seed(5)
    q, k = (6 * torch.randn(2, 70, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 70, 2, 64, generator=g, dtype=torch.float64)
    projection = orthogonal_random_features(64, 64, torch.Generator().manual_seed(6))
    plain = performer_attention_naive(q.float(), k.float(), v.float(), projection, causal=causal)
    reference = performer_attention_log_space(q, k, v, projection.double(), causal=causal)
    assert (plain.double() - reference).abs().max() > 0.5


    def fast(*qkv):
        if causal:
            return performer_attention_causal(*qkv, projection, chunk=16)[0]
        return performer_attention(*qkv, projection)
    assert_matches_reference(fast, lambda *qkv: performer_attention_log_space(*qkv, projection.double(), causal=causal),
                             [q, k, v], device="cpu", atol=1e-4, rtol=1e-3)


def test_feature_blocks_are_orthogonal_with_gaussian_lengths():
    projection = orthogonal_random_features(2 * HEAD_DIM + 2, HEAD_DIM, torch.Generator().manual_seed(3)).double()
    directions = projection / projection.norm(dim=1, keepdim=True)
    for block in directions.split(HEAD_DIM):
        torch.testing.assert_close(block @ block.T, torch.eye(len(block), dtype=block.dtype), atol=1e-6, rtol=0)
    assert not torch.allclose(directions[:HEAD_DIM], directions[HEAD_DIM:2 * HEAD_DIM])
    lengths = projection.norm(dim=1)
    assert lengths.std() > 0.05 and ((lengths - HEAD_DIM ** 0.5).abs() < 3).all()


def test_many_features_approximate_softmax_attention():
    q, k, v = (t.detach()[:1] for t in _qkv(16, scale=0.5))
    projection = orthogonal_random_features(8192, HEAD_DIM, torch.Generator().manual_seed(4)).double()
    out = performer_attention(q, k, v, projection)
    exact = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    uniform = v.mean(1, keepdim=True)  # what attention without the q.k weighting would give
    assert (out - exact).abs().max() < 0.1 < (uniform - exact).abs().max()


def test_layer_projection_is_a_buffer_saved_with_the_model():
    torch.manual_seed(0)
    layer = build_attention("performer", 16, 2, features=12)
    assert layer.projection.shape == (12, 8) and "projection" not in dict(layer.named_parameters())
    torch.manual_seed(1)
    other = build_attention("performer", 16, 2, features=12)
    x = torch.randn(1, 5, 16)
    assert not torch.allclose(other(x)[0], layer(x)[0])  # another draw gives other outputs
    other.load_state_dict(layer.state_dict())
    torch.testing.assert_close(other(x)[0], layer(x)[0])


def test_redrawing_draws_new_features_every_interval_of_optimizer_steps():
    torch.manual_seed(0)
    layer = build_attention("performer", 16, 2, features=12, redraw_interval=2)
    fixed = build_attention("performer", 16, 2, features=12)
    assert "optimizer_steps" in layer.state_dict() and "optimizer_steps" not in fixed.state_dict()
    x = torch.randn(1, 5, 16)
    draws = []
    for _ in range(5):
        draws.append(layer.projection.clone())
        layer(x)[0].sum().backward()
        layer(x)  # forward calls alone never redraw
        after_optimizer_step(layer)
    # new features after steps 2 and 4: draws[2] and draws[4] are the new ones
    assert [torch.equal(a, b) for a, b in zip(draws, draws[1:])] == [True, False, True, False]
    assert int(layer.optimizer_steps) == 5
    directions = layer.projection / layer.projection.norm(dim=1, keepdim=True)
    torch.testing.assert_close(directions[:8] @ directions[:8].T, torch.eye(8), atol=1e-5, rtol=0)
    before = fixed.projection.clone()
    after_optimizer_step(fixed)
    assert torch.equal(fixed.projection, before)


def test_with_redraws_a_forward_is_a_function_checkpointing_and_caches_can_rely_on():
    """Activation checkpointing runs the forward again during backward, and a training step may carry a cache
    across chunks: with the redraw inside the forward, both used other features the second time."""
    torch.manual_seed(0)
    layer = build_attention("performer", 16, 2, features=12, redraw_interval=1).train()
    x = torch.randn(2, 12, 16, requires_grad=True)
    plain = torch.autograd.grad(layer(x)[0].square().sum(), x)[0]
    recomputed = checkpoint(lambda a: layer(a)[0], x, use_reentrant=False).square().sum()
    torch.testing.assert_close(torch.autograd.grad(recomputed, x)[0], plain)
    whole, _ = layer(x)
    first, cache = layer(x[:, :7])
    rest, _ = layer(x[:, 7:], cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, atol=1e-5, rtol=1e-5)


def test_redraw_interval_is_checked():
    with pytest.raises(ValueError, match="redraw_interval must be a positive integer"):
        build_attention("performer", 16, 2, redraw_interval=0)


def test_layer_cache_has_constant_size():
    layer = build_attention("performer", 16, 2, features=12)
    _, cache = layer(torch.randn(3, 4, 16))
    _, later = layer(torch.randn(3, 70, 16), cache=cache)
    assert [t.shape for t in later.tensors()] == [(3, 2, 12, 8), (3, 2, 12), (3, 2)] == [t.shape for t in
                                                                                         cache.tensors()]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="features must be a positive integer"):
        build_attention("performer", 16, 2, features=0)
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        build_attention("performer", 16, 2, chunk=0)
    layer = build_attention("performer", 16, 2, features=12)
    _, cache = layer(torch.randn(3, 4, 16))
    with pytest.raises(ValueError, match=r"^cache was built for batch size 3, got input of batch size 2$"):
        layer(torch.randn(2, 4, 16), cache=cache)
    _, other_features = build_attention("performer", 16, 2, features=16)(torch.randn(3, 4, 16))
    with pytest.raises(ValueError, match=r"cache sums must have shapes S \(3, 2, 12, 8\)"):
        layer(torch.randn(3, 4, 16), cache=other_features)
    bidirectional = build_attention("performer", 16, 2, causal=False, features=12)
    with pytest.raises(ValueError, match="causal=False; a cache is only for causal decoding"):
        bidirectional(torch.randn(3, 4, 16), cache=cache)
