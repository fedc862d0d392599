"""The cache protocol on every mechanism with a decoding form: empty_cache, nbytes, to, select, position."""
from dataclasses import dataclass, fields

import pytest
import torch
from reference_checks import assert_same_outputs_and_grads

from lavo import available_attentions, build_attention
from lavo.cache import Cache, KVCache

DIM, HEADS = 16, 2
# Small windows, so that a few tokens cross window boundaries and LAVO's memory is used.
OPTIONS = {"lavo": dict(window=4, rank=4), "local": dict(window=4)}


def _build(name):
    torch.manual_seed(0)
    layer = build_attention(name, DIM, HEADS, causal=True, **OPTIONS.get(name, {})).double()
    with torch.no_grad():  # zero-initialised position biases would hide position errors
        for p in layer.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.5)
    return layer


DECODING = [name for name in available_attentions() if _build(name).supports_decoding]
NOT_DECODING = [name for name in available_attentions() if name not in DECODING]


def _prefix(layer, length=11):
    """A batch of two different rows, row 0 with left padding: (x, mask, output, cache)."""
    x = torch.randn(2, length, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[0, :3] = False
    y, cache = layer(x, padding_mask=mask)
    return x, mask, y, cache


def _decode(layer, x, cache, sizes=(1, 1, 3)):
    outputs, start = [], 0
    for size in sizes:
        y, cache = layer(x[:, start:start + size], cache=cache)
        outputs.append(y)
        start += size
    return torch.cat(outputs, 1), cache


def test_every_mechanism_is_classified():
    assert set(DECODING) >= {"lavo", "local", "softmax", "abc", "performer", "cosformer", "s4d"}
    assert NOT_DECODING == ["longshort"]


@pytest.mark.parametrize("name", DECODING)
def test_empty_cache_equals_no_cache(name):
    layer = _build(name)
    empty = layer.empty_cache(2)
    assert isinstance(empty, Cache) and empty.position == 0 and empty.batch_size == 2
    # The layer's dtype by default: float64 sums and keys (complex128 for a complex state), never float32.
    assert all(t.dtype in (torch.float64, torch.complex128, torch.bool) for t in empty.tensors())
    x, mask, y, cache = _prefix(layer)
    y_empty, cache_empty = layer(x, padding_mask=mask, cache=empty)
    torch.testing.assert_close(y_empty, y)
    assert type(cache_empty) is type(cache) and cache_empty.position == cache.position
    for a, b in zip(cache_empty.tensors(), cache.tensors(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", DECODING)
def test_under_autocast_an_empty_cache_is_the_one_a_first_call_makes(name):
    """Made for the weights' dtype, it held float32 keys and values where a call under float16 autocast keeps
    float16 ones: twice the bytes, past the cache_nbytes bound for float16."""
    layer = _build(name).float()
    x = torch.randn(2, 11, DIM)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        _, first = layer(x)
        _, continued = layer(x, cache=layer.empty_cache(2))
    assert [t.dtype for t in continued.tensors()] == [t.dtype for t in first.tensors()]
    assert continued.nbytes() == first.nbytes() <= layer.cache_nbytes(2, 11, torch.float16)
    # autocast leaves a float64 layer in float64, and its empty cache with it
    double = _build(name)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, first = double(x.double())
        _, continued = double(x.double(), cache=double.empty_cache(2))
    assert [t.dtype for t in continued.tensors()] == [t.dtype for t in first.tensors()]
    assert all(t.is_meta for t in double.empty_cache(2, device="meta").tensors())


@pytest.mark.parametrize("name", DECODING)
def test_a_cache_made_outside_autocast_continues_under_it(name):
    """As a user's float32 prompt, then bfloat16 generation: LAVO refused the cache, telling to call under
    autocast, and local attention met float32 keys with bfloat16 queries."""
    layer = _build(name).float()
    x = torch.randn(2, 11, DIM, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        empty = layer.empty_cache(2)
        _, prompt = layer(x[:, :7])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            whole, _ = layer(x)
            from_empty, _ = layer(x, cache=empty)
            rest, _ = _decode(layer, x[:, 7:], prompt, sizes=(1, 3))
    torch.testing.assert_close(from_empty, whole, atol=1e-2, rtol=1e-2)
    # the prompt's float32 keys, rounded to bfloat16 once they meet the chunk's
    torch.testing.assert_close(rest, whole[:, 7:], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", DECODING)
def test_a_cache_made_under_inference_mode_continues_outside_it(name):
    """A prompt read under torch.inference_mode(), then tokens decoded under torch.no_grad() (was: softmax's and
    local attention's caches, written in place, met torch's `Inplace update to inference tensor outside
    InferenceMode is not allowed`). LAVO's step cache, which a step updates in place by design, is refused by
    name when it was made under inference mode; one made outside it from such a cache continues."""
    layer = _build(name)
    x, mask, whole, _ = _prefix(layer)
    with torch.inference_mode():
        _, prompt = layer(x[:, :5], padding_mask=mask[:, :5])
        _, prompt = layer(x[:, 5:6], cache=prompt)  # a key-value cache now has buffers to write in place
        stepped = layer.step_cache(prompt)
    with torch.no_grad():
        rest, _ = _decode(layer, x[:, 6:], prompt, sizes=(1, 1, 3))
        torch.testing.assert_close(rest, whole[:, 6:])
        rest, _ = _decode(layer, x[:, 6:], layer.step_cache(prompt), sizes=(1, 1, 3))
        torch.testing.assert_close(rest, whole[:, 6:])
        if layer.has_step_layout:
            with pytest.raises(ValueError, match=r"^this LavoStepCache was made under torch.inference_mode\(\), "
                                                 r"whose tensors torch lets only inference mode update in place"):
                layer(x[:, 6:7], cache=stepped)
    with torch.inference_mode():
        rest, _ = _decode(layer, x[:, 6:], stepped, sizes=(1, 1, 1))
    torch.testing.assert_close(rest, whole[:, 6:9])


@pytest.mark.parametrize("name", DECODING)
def test_a_float32_cache_continues_in_a_float64_layer(name):
    """Widened, as the key-value caches are; S4D's state met float64 inputs with torch's "expected scalar type
    Float but found Double". LAVO refuses it by name (its cached sums keep their precision)."""
    layer = _build(name)
    x = torch.randn(2, 11, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, prompt = layer.float()(x[:, :7].float())
        layer.double()
        if name == "lavo":
            with pytest.raises(ValueError, match=r"^the cache holds torch.float32 keys and values and the inputs are "
                                                 r"torch.float64"):
                layer(x[:, 7:], cache=prompt)
            return
        rest, _ = layer(x[:, 7:], cache=prompt)
        whole, _ = layer(x)
    torch.testing.assert_close(rest, whole[:, 7:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", DECODING)
def test_nbytes_is_the_bytes_of_every_tensor_field(name):
    _, _, _, cache = _prefix(_build(name))
    tensors = [value for f in fields(cache) if isinstance(value := getattr(cache, f.name), torch.Tensor)]
    assert tensors and cache.nbytes() == sum(t.numel() * t.element_size() for t in tensors) > 0


@pytest.mark.parametrize("name", DECODING)
def test_to_keeps_the_type_position_and_values(name):
    _, _, _, cache = _prefix(_build(name))
    moved = cache.to("cpu")
    assert type(moved) is type(cache) and moved.position == cache.position
    for a, b in zip(moved.tensors(), cache.tensors(), strict=True):
        assert torch.equal(a, b)
    meta = cache.to("meta")  # a real move on any machine
    assert type(meta) is type(cache) and meta.position == cache.position
    for a, b in zip(meta.tensors(), cache.tensors(), strict=True):
        assert a.device.type == "meta" and (a.shape, a.dtype) == (b.shape, b.dtype)


@pytest.mark.parametrize("name", DECODING)
def test_selected_rows_continue_like_the_rows_they_came_from(name):
    layer = _build(name)
    _, _, _, cache = _prefix(layer)
    more = torch.randn(2, 5, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expected, expected_cache = _decode(layer, more, cache)

    swapped = cache.select(torch.tensor([1, 0]))
    assert type(swapped) is type(cache) and swapped.batch_size == 2 and swapped.position == cache.position
    got, got_cache = _decode(layer, more.flip(0), swapped)
    torch.testing.assert_close(got, expected.flip(0))

    row = cache.select(torch.tensor([1]))
    assert row.batch_size == 1
    got_row, got_row_cache = _decode(layer, more[1:], row)
    torch.testing.assert_close(got_row, expected[1:])
    for a, b, c in zip(got_row_cache.tensors(), got_cache.select(torch.tensor([0])).tensors(),
                       expected_cache.select(torch.tensor([1])).tensors(), strict=True):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)


@pytest.mark.parametrize("name", DECODING)
def test_position_counts_tokens_padding_included(name):
    layer = _build(name)
    _, _, _, cache = _prefix(layer, length=11)
    assert cache.position == 11
    more = torch.randn(2, 5, DIM, dtype=torch.float64)
    _, cache = layer(more[:, :1], cache=cache)
    assert cache.position == 12
    _, cache = layer(more[:, 1:], padding_mask=torch.tensor([[True, False, True, True]] * 2), cache=cache)
    assert cache.position == 16


@pytest.mark.parametrize("name", NOT_DECODING)
def test_a_layer_without_decoding_refuses_an_empty_cache(name):
    with pytest.raises(ValueError, match="has no decoding form"):
        _build(name).empty_cache(2)


@dataclass(frozen=True)
class _Pair(Cache):
    """A cache of caches, as a model's cache holds one per layer."""

    layers: tuple
    position: int


def test_a_cache_of_caches_applies_the_protocol_to_every_part():
    parts = []
    for heads in (1, 3):
        cache = KVCache.empty(2, heads, 4, dtype=torch.float64)
        parts.append(cache.append(torch.randn(2, 3, heads, 4, dtype=torch.float64),
                                  torch.randn(2, 3, heads, 4, dtype=torch.float64), None))
    pair = _Pair(tuple(parts), 3)
    assert pair.batch_size == 2 and pair.nbytes() == sum(part.nbytes() for part in parts)
    picked = pair.select(torch.tensor([1]))
    assert type(picked) is _Pair and type(picked.layers) is tuple and picked.position == 3
    for got, part in zip(picked.layers, parts, strict=True):
        assert type(got) is KVCache and got.position == part.position
        assert torch.equal(got.keys, part.keys[1:]) and torch.equal(got.key_mask, part.key_mask[1:])
    assert all(t.device.type == "meta" for t in pair.to("meta").tensors())


def _token(batch=2, heads=3, head_dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, heads, head_dim, generator=g), torch.randn(batch, 1, heads, head_dim, generator=g)


def test_key_value_cache_appends_in_place_and_copies_only_when_it_doubles():
    cache, keys, copies = KVCache.empty(2, 3, 4), [], 0
    with torch.no_grad():
        for t in range(300):
            k, v = _token(seed=t)
            keys.append(k)
            appended = cache.append(k, v, None)
            copies += appended.keys.untyped_storage().data_ptr() != cache.keys.untyped_storage().data_ptr()
            cache = appended
    assert copies <= 10  # capacities 1, 2, 4, ..., 512: a copy of the whole cache per token would be 300
    assert torch.equal(cache.keys, torch.cat(keys, 1)) and cache.position == 300 and cache.key_mask.all()


def test_a_key_value_cache_appended_to_twice_keeps_both_continuations():
    with torch.no_grad():
        base = KVCache.empty(2, 3, 4)
        for seed in range(3):
            base = base.append(*_token(seed=seed), None)
        assert base.buffers.end == 3 < base.buffers.keys.shape[2]  # room for more: the first append writes in place
        before = base.keys.clone()
        (k_a, v_a), (k_b, v_b) = _token(seed=3), _token(seed=4)
        first = base.append(k_a, v_a, None)
        second = base.append(k_b, v_b, None)
        moved = first.to("cpu").append(k_b, v_b, None)
    assert first.keys.untyped_storage().data_ptr() == base.keys.untyped_storage().data_ptr()
    assert second.keys.untyped_storage().data_ptr() != base.keys.untyped_storage().data_ptr()
    assert torch.equal(base.keys, before) and base.keys.shape[1] == 3
    assert torch.equal(first.keys, torch.cat([before, k_a], 1)) and torch.equal(first.values[:, -1:], v_a)
    assert torch.equal(second.keys, torch.cat([before, k_b], 1)) and torch.equal(second.values[:, -1:], v_b)
    assert torch.equal(moved.keys, torch.cat([before, k_a, k_b], 1))


def test_backward_through_a_cache_filled_token_by_token_gives_one_calls_gradients():
    """Keys and values that need gradients are never written in place: autograd saved them."""
    for name in ("softmax", "local"):
        layer = build_attention(name, DIM, HEADS, causal=True).double()
        x = torch.randn(2, 9, DIM, dtype=torch.float64, requires_grad=True)
        whole = layer(x)[0]
        cache, outputs = None, []
        for t in range(9):
            out, cache = layer(x[:, t:t + 1], cache=cache)
            outputs.append(out)
        assert_same_outputs_and_grads(torch.cat(outputs, 1), whole, [x, *layer.parameters()], atol=1e-10, rtol=1e-9)


def test_a_sliding_window_cache_stays_bounded_and_is_rarely_copied():
    window = 4
    layer = build_attention("local", DIM, HEADS, window=window).eval()
    with torch.no_grad():
        _, cache = layer(torch.randn(1, 9, DIM))
        copies = 0
        for _ in range(200):
            _, later = layer(torch.randn(1, 1, DIM), cache=cache)
            copies += later.keys.untyped_storage().data_ptr() != cache.keys.untyped_storage().data_ptr()
            assert later.keys.shape[1] <= 2 * window - 1
            cache = later
    assert copies <= 200 // window  # a copy of the window per token would be 200
