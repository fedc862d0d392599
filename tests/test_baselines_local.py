"""Local (sliding-window) baseline: layer vs the token-by-token reference, decoding with a bounded cache, errors."""
import pytest
import torch
from reference_checks import assert_same_outputs_and_grads

from lavo import build_attention
from lavo.ops.local import keep_visible, local_attention_naive


def _layer(causal, window, position_bias=True, dim=14, heads=2):
    torch.manual_seed(0)
    layer = build_attention("local", dim, heads, causal=causal, window=window, position_bias=position_bias).double()
    if position_bias:
        with torch.no_grad():
            layer.pos_bias.normal_()
    return layer


@pytest.mark.parametrize("position_bias", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 63])
def test_layer_matches_naive_outputs_and_gradients(T, causal, position_bias):
    layer = _layer(causal, window=5, position_bias=position_bias)  # head dim 7
    q, k, v = (torch.randn(2, T, 2, 7, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, : T // 3] = False
    fast, _ = layer.attend(q, k, v, mask, None)
    slow = local_attention_naive(q, k, v, window=5, causal=causal, pos_bias=layer.pos_bias, padding_mask=mask)
    assert_same_outputs_and_grads(fast, slow, [q, k, v] + ([layer.pos_bias] if position_bias else []))


def test_padded_decoding_matches_full_forward_with_a_bounded_cache():
    w, T = 4, 23
    layer = _layer(True, window=w)
    x = torch.randn(2, T, 14, dtype=torch.float64)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, :6] = False
    mask[1, 9:14] = False
    full, full_cache = layer(x, padding_mask=mask)
    cache, outputs, start = None, [], 0
    for size in (1, 2, 1, 7, 1, 1, 10):
        y, cache = layer(x[:, start:start + size], padding_mask=mask[:, start:start + size], cache=cache)
        outputs.append(y)
        start += size
        expected = start - max(0, (start // w - 1) * w)  # from the start of the previous window
        assert cache.keys.shape[1] == cache.key_mask.shape[1] == expected <= 2 * w - 1
    torch.testing.assert_close(torch.cat(outputs, 1), full)
    for name in ("keys", "values", "key_mask"):
        torch.testing.assert_close(getattr(cache, name), getattr(full_cache, name))


def test_keep_visible_keeps_from_the_start_of_the_previous_window():
    x = torch.arange(11)[None]
    assert keep_visible(11, 4, x)[0].tolist() == [list(range(4, 11))]
    assert keep_visible(3, 4, x[:, :3])[0].tolist() == [[0, 1, 2]]
    assert keep_visible(8, 4, x[:, :8])[0].tolist() == [[4, 5, 6, 7]]


def test_impossible_requests_are_named():
    with pytest.raises(ValueError, match="window must be a positive integer"):
        build_attention("local", 8, 2, window=0)
    layer = build_attention("local", 8, 2, causal=False, window=2)
    with pytest.raises(ValueError, match="causal=False; a cache is only for causal decoding"):
        layer(torch.randn(1, 3, 8), cache=build_attention("local", 8, 2, window=2).empty_cache(1))


def test_a_cache_of_a_layer_with_a_smaller_window_is_refused_by_name():
    small = build_attention("local", 8, 2, window=4, position_bias=False)
    large = build_attention("local", 8, 2, window=8, position_bias=False)
    large.load_state_dict(small.state_dict())
    _, cache = small(torch.randn(1, 12, 8))
    with pytest.raises(ValueError, match=r"^the cache holds 4 keys at position 12, but a local layer with window 8 "
                                         r"needs the last 12: it was made by a layer with a smaller window; continue "
                                         r"with the cache this layer returned$"):
        large(torch.randn(1, 1, 8), cache=cache)
    x = torch.randn(1, 13, 8)
    _, cache = large(x[:, :12])  # more keys than the small window needs: the earliest are out of its reach
    torch.testing.assert_close(small(x[:, 12:], cache=cache)[0], small(x)[0][:, 12:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16_bit_inputs_are_as_accurate_as_sdpa_on_sharp_heads(dtype):
    """The PyTorch path's softmax runs in float32 for 16-bit inputs, as SDPA's does: with a window spanning the
    sequence, causal local attention is causal softmax attention, so both are held to the float64 result of the
    same rounded inputs, outputs and gradients. Was: scores rounded to bfloat16, 7.7 times SDPA's output error and
    5 times its gradients' on scores of tens (and the one-call and cached forms both)."""
    from lavo.ops import local_attention, local_attention_chunk
    g = torch.Generator().manual_seed(0)
    q, k = (4 * torch.randn(2, 96, 4, 64, generator=g, dtype=torch.float64) for _ in range(2))  # scores of ~16
    v, grad_out = (torch.randn(2, 96, 4, 64, generator=g, dtype=torch.float64) for _ in range(2))
    inputs = [x.to(dtype) for x in (q, k, v)]

    def local(q, k, v):
        return local_attention(q, k, v, window=96, backend="torch")

    def sdpa(q, k, v):
        heads_first = [x.transpose(1, 2) for x in (q, k, v)]
        return torch.nn.functional.scaled_dot_product_attention(*heads_first, is_causal=True).transpose(1, 2)

    def errors(op):
        """Relative errors of the output and the three input gradients against float64."""
        exact = [x.double().requires_grad_() for x in inputs]
        low = [x.clone().requires_grad_() for x in inputs]
        results = []
        for args, out_grad in ((exact, grad_out), (low, grad_out.to(dtype))):
            out = op(*args)
            results.append([out, *torch.autograd.grad(out, args, out_grad)])
        return [((b.double() - a).norm() / a.norm()).item() for a, b in zip(*results)]

    ours, theirs = errors(local), errors(sdpa)
    assert all(mine < 2 * sdpa_error for mine, sdpa_error in zip(ours, theirs)), (ours, theirs)
    exact = local_attention_chunk(*(x.double() for x in inputs), start=0, window=96)
    chunk = local_attention_chunk(*inputs, start=0, window=96).double()
    assert (chunk - exact).norm() / exact.norm() < 2 * theirs[0]
