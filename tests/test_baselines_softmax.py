"""Softmax attention: against an explicit quadratic reference with explicit rotation matrices, padding, decoding."""
import pytest
import torch
from reference_checks import assert_same_outputs_and_grads

from lavo import build_attention
from lavo.ops.softmax import apply_rotary, softmax_attention, softmax_attention_naive


def _inputs(B, T, H, D):
    torch.manual_seed(1)
    return [torch.randn(B, T, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 63])
def test_layer_with_rotary_matches_explicit_rotation_matrices(causal, T):
    B, H, D = 2, 2, 30
    layer = build_attention("softmax", H * D, H, causal=causal, rotary=True).double()
    q, k, v = _inputs(B, T, H, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    fast, _ = layer.attend(q, k, v, None, None)
    slow = softmax_attention_naive(q, k, v, causal=causal, padding_mask=mask, rotary_start=0)
    assert_same_outputs_and_grads(fast, slow, [q, k, v])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16_bit_features_are_rotated_in_float32_and_rounded_once(dtype):
    """Each rotated feature within one rounding of the exact rotation. Was: the cosines, sines and each product
    rounded to 16 bits, errors many times one rounding where the two products cancel."""
    x = (4 * torch.randn(2, 300, 2, 64, generator=torch.Generator().manual_seed(0))).to(dtype)
    exact = apply_rotary(x.double(), 1000)
    rotated = apply_rotary(x, 1000)
    assert rotated.dtype == dtype
    one_rounding = exact.abs() * torch.finfo(dtype).eps / 2 + 1e-6
    assert ((rotated.double() - exact).abs() <= one_rounding).all()


def test_rotary_scores_depend_only_on_relative_position():
    q, k, _ = _inputs(1, 9, 2, 8)
    scores = [torch.einsum("bqhd,bkhd->bhqk", apply_rotary(q, s), apply_rotary(k, s)) for s in (0, 1000)]
    torch.testing.assert_close(scores[0], scores[1])
    assert not torch.allclose(apply_rotary(q, 0), apply_rotary(q, 1000))


@pytest.mark.parametrize("causal", [True, False])
def test_padding_matches_reference_and_fully_padded_rows_are_zero(causal):
    B, T, H, D = 3, 17, 2, 7
    q, k, v = _inputs(B, T, H, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0] = False  # nothing real at all
    mask[1, :5] = False  # left padding: the first real query has only itself
    mask[2, 9:12] = False
    fast = softmax_attention(q, k, v, causal=causal, key_mask=mask, query_mask=mask)
    assert torch.isfinite(fast).all() and torch.all(fast[~mask] == 0)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(fast.sum(), [q, k, v], retain_graph=True))
    assert_same_outputs_and_grads(fast, softmax_attention_naive(q, k, v, causal=causal, padding_mask=mask), [q, k, v])


def test_rows_without_any_allowed_key_are_zero_not_nan():
    q, k, v = _inputs(1, 4, 1, 6)
    key_mask = torch.tensor([[False, False, True, True]])
    out = softmax_attention(q, k, v, causal=True, key_mask=key_mask)  # queries 0 and 1 see no key
    assert torch.all(out[:, :2] == 0) and torch.isfinite(out).all()


def test_padded_chunked_decoding_with_rotary_matches_full_forward_and_cache_grows():
    torch.manual_seed(0)
    layer = build_attention("softmax", 24, 3, causal=True, rotary=True).double()
    x = torch.randn(2, 20, 24, dtype=torch.float64)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, :4] = False
    mask[1, 11:13] = False
    full, full_cache = layer(x, padding_mask=mask)
    cache, outputs = None, []
    for lo, hi in ((0, 1), (1, 7), (7, 8), (8, 20)):
        y, cache = layer(x[:, lo:hi], padding_mask=mask[:, lo:hi], cache=cache)
        outputs.append(y)
    torch.testing.assert_close(torch.cat(outputs, 1), full)
    assert cache.keys.shape[1] == full_cache.keys.shape[1] == cache.position == 20
    torch.testing.assert_close(cache.key_mask, mask)


def test_impossible_requests_are_named():
    with pytest.raises(ValueError, match="rotary=True needs an even head dimension"):
        build_attention("softmax", 10, 2, rotary=True)
    q = torch.randn(1, 5, 1, 4)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        softmax_attention(q, q[:, :3], q[:, :3], causal=True)
    layer = build_attention("softmax", 8, 2, causal=False)
    with pytest.raises(ValueError, match="causal=False; a cache is only for causal decoding"):
        layer(torch.randn(1, 3, 8), cache=layer.empty_cache(1))
    causal = build_attention("softmax", 8, 2)
    with pytest.raises(ValueError, match="cache was built for batch size 1"):
        causal(torch.randn(2, 3, 8), cache=causal.empty_cache(1))


def test_one_token_steps_without_padding_call_sdpa_without_a_mask(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **options):
        calls.append((q.shape[2], k.shape[2], options.get("attn_mask"), options.get("is_causal", False)))
        return real(q, k, v, **options)

    torch.manual_seed(0)
    layer = build_attention("softmax", 24, 3, rotary=True).double()
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    full, _ = layer(x)
    monkeypatch.setattr("lavo.ops.softmax.sdpa.scaled_dot_product_attention", spy)
    with torch.no_grad():
        _, cache = layer(x[:, :6])
        steps = []
        for t in range(6, 9):
            y, cache = layer(x[:, t:t + 1], cache=cache)
            steps.append(y)
    assert calls == [(6, 6, None, True), (1, 7, None, False), (1, 8, None, False), (1, 9, None, False)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 6:])


def test_a_cache_of_keys_rotated_otherwise_is_refused_by_name():
    """Was: a rotary layer continued a plain layer's cache (or a local layer's, before it dropped a key), its
    rotated queries scored against unrotated keys without an error."""
    torch.manual_seed(0)
    plain, rotary = (build_attention("softmax", 8, 2, rotary=r) for r in (False, True))
    local = build_attention("local", 8, 2, window=4, position_bias=False)
    x = torch.randn(1, 3, 8)
    caches = {"plain": plain(x)[1], "rotary": rotary(x)[1], "local": local(x)[1],
              "empty rotary": rotary.empty_cache(1)}
    unrotated = r"^the cache holds keys stored unrotated \(rotary=False\), and this layer has rotary=True: pass "
    rotated = r"^the cache holds keys stored rotated by their positions \(rotary=True\), and this layer has "
    for layer, given, message in [(rotary, "plain", unrotated), (rotary, "local", unrotated),
                                  (plain, "rotary", rotated + "rotary=False"), (local, "rotary", rotated),
                                  (plain, "empty rotary", rotated)]:
        with pytest.raises(ValueError, match=message):
            layer(x[:, :1], cache=caches[given])
    # the cache a layer made continues it: the same as one call over the whole sequence
    whole = torch.cat([x, x[:, :1]], dim=1)
    for layer, name in [(plain, "plain"), (rotary, "rotary"), (local, "local")]:
        torch.testing.assert_close(layer(x[:, :1], cache=caches[name])[0], layer(whole)[0][:, 3:])
