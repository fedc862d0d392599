"""The contract every registered attention keeps: no causal leak, chunked decoding, padding invariance, zeros at
padded positions, one error for an empty chunk, and half precision (a bfloat16 or float16 layer, or autocast)."""
import contextlib
import re

import pytest
import torch
from reference_checks import registered_layer

from lavo import available_attentions, build_attention
from lavo.cache import KVCache
from lavo.registry import attention_class

DIM, HEADS, T = 32, 4, 40
WINDOW = 8  # T spans five windows: the windowed mechanisms cross boundaries, LAVO writes and reads its memory


def _build(name, causal):
    return registered_layer(name, DIM, HEADS, causal=causal, window=WINDOW).double()


@pytest.mark.parametrize("name", available_attentions())
def test_no_causal_leak(name):
    layer = _build(name, causal=True)
    x = torch.randn(2, T, DIM, dtype=torch.float64, requires_grad=True)
    y, _ = layer(x)
    for t in (0, 7, 19, T - 2):
        (grad,) = torch.autograd.grad(y[:, t].sum(), x, retain_graph=True)
        assert torch.all(grad[:, t + 1:] == 0), f"{name}: output {t} depends on later inputs"
        assert grad[:, : t + 1].abs().sum() > 0


@pytest.mark.parametrize("name", available_attentions())
def test_chunked_decoding_matches_full_forward(name):
    layer = _build(name, causal=True).float()
    if not layer.supports_decoding:
        pytest.skip(f"{name} has no decoding form")
    x = torch.randn(2, T, DIM)
    full, _ = layer(x)
    cache, outputs, start = None, [], 0
    for size in (1, 1, 5, 13, 1, T - 21):
        y, cache = layer(x[:, start:start + size], cache=cache)
        outputs.append(y)
        start += size
    torch.testing.assert_close(torch.cat(outputs, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", available_attentions())
def test_padding_never_changes_real_positions(name, causal):
    layer = _build(name, causal)
    x = torch.randn(2, T, DIM, dtype=torch.float64)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, :6] = False  # left padding
    mask[1, 15:18] = False  # a hole in the middle
    mask[1, -4:] = False  # right padding
    y, _ = layer(x, padding_mask=mask)
    x_changed = torch.where(mask[..., None], x, 100 * torch.randn_like(x))
    y_changed, _ = layer(x_changed, padding_mask=mask)
    torch.testing.assert_close(y_changed[mask], y[mask])
    assert torch.all(y[~mask] == 0), f"{name}: a padded position's output is not zero"


def test_a_switch_takes_only_a_bool():
    with pytest.raises(ValueError, match="attention 'softmax' option rotary must be true or false, got 'yes'"):
        build_attention("softmax", DIM, HEADS, rotary="yes")
    with pytest.raises(ValueError, match="attention 'lavo' option dissection must be true or false, got 0"):
        build_attention("lavo", DIM, HEADS, dissection=0)
    assert build_attention("lavo", DIM, HEADS, dissection=False).dissection is False


def test_unknown_attention_names_the_alternatives():
    with pytest.raises(ValueError, match=r"unknown attention 'nope'; available: .*lavo"):
        build_attention("nope", DIM, HEADS)


@pytest.mark.parametrize("name", available_attentions())
def test_an_empty_chunk_is_refused_alike(name):
    layer = _build(name, causal=True)
    _, cache = layer(torch.randn(1, 5, DIM, dtype=torch.float64))
    for given in (None, cache):
        with pytest.raises(ValueError, match=r"x has an empty time axis, shape \(1, 0, 32\); a call needs at least "
                                             r"one position"):
            layer(torch.randn(1, 0, DIM, dtype=torch.float64), cache=given)


@pytest.mark.parametrize("name", available_attentions())
def test_an_empty_batch_is_refused_alike(name):
    layer = _build(name, causal=True)
    with pytest.raises(ValueError, match=r"x has an empty batch, shape \(0, 5, 32\); a call needs at least one "
                                         r"sequence"):
        layer(torch.randn(0, 5, DIM, dtype=torch.float64))


@pytest.mark.parametrize("name", available_attentions())
def test_an_input_of_another_dtype_than_the_weights_is_refused_alike_but_not_under_autocast(name):
    layer = _build(name, causal=True)  # float64 weights
    with pytest.raises(ValueError, match=r"^x has dtype torch.float32 and the layer's weights torch.float64: convert "
                                         r"one \(x.to\(torch.float64\) or layer.to\(torch.float32\)\), or call the "
                                         r"layer under torch.autocast$"):
        layer(torch.randn(1, 5, DIM))
    with pytest.raises(ValueError, match=r"^x must be a floating-point tensor \(features, not token ids\), got "
                                         r"torch.int64$"):
        layer(torch.randint(0, 9, (1, 5, DIM)))
    layer.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = layer(torch.randn(1, 5, DIM, dtype=torch.bfloat16))
    assert out.shape == (1, 5, DIM)


@pytest.mark.parametrize("made, continued", [(torch.float64, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("name", [name for name in available_attentions() if attention_class(name).supports_decoding])
def test_a_cache_continued_in_another_dtype_is_refused_by_name_or_continues_the_sequence(name, made, continued):
    """A cache made before ``layer.to(dtype)`` to a narrower dtype, continued outside autocast: was a softmax, ABC or
    Performer op's ``expected scalar type Double but found Float``, SDPA's ``Expected query, key, and value to have
    the same dtype``, or local attention's error about its op's ``k`` and ``q`` (a narrower cache is widened:
    ``test_cache.py::test_a_float32_cache_continues_in_a_float64_layer``)."""
    layer = _build(name, causal=True).to(made)
    x = torch.randn(2, 12, DIM, dtype=torch.float64)
    with torch.no_grad():
        _, cache = layer(x[:, :5].to(made))
        layer.to(continued)
        expected, _ = layer(x.to(continued))
        try:
            y, _ = layer(x[:, 5:].to(continued), cache=cache)
        except ValueError as error:
            assert re.match(rf"the cache holds {made} (keys and values|sums) and the inputs are {continued}",
                            str(error)), error
            return
    error = (y.double() - expected[:, 5:].double()).abs().max() / expected.double().abs().max()
    assert error <= (0.03 if torch.bfloat16 in (made, continued) else 1e-5), f"{name}: {error}"


def test_a_cache_of_another_kind_is_refused_by_name():
    caches = {name: _build(name, causal=True)(torch.randn(1, 5, DIM, dtype=torch.float64))[1]
              for name in available_attentions()}
    for name in available_attentions():
        layer = _build(name, causal=True)
        if not layer.supports_decoding:
            continue
        for other, cache in caches.items():
            if cache is None or isinstance(cache, layer.cache_types):
                continue
            with pytest.raises(ValueError, match=rf"{type(layer).__name__} continues an? .*, got an? "
                                                 rf"{type(cache).__name__}: pass the cache this layer's previous "
                                                 r"call returned"):
                layer(torch.randn(1, 1, DIM, dtype=torch.float64), cache=cache)
    with pytest.raises(ValueError, match=r"^ABCAttention continues an ABCCache, got an S4DCache: "):
        _build("abc", causal=True)(torch.randn(1, 1, DIM, dtype=torch.float64), cache=caches["s4d"])
    with pytest.raises(ValueError, match=r"^S4DLayer continues an S4DCache, got a KVCache: "):
        _build("s4d", causal=True)(torch.randn(1, 1, DIM, dtype=torch.float64), cache=caches["softmax"])
    local = build_attention("local", DIM, HEADS, window=4).double()
    _, trimmed = local(torch.randn(1, 20, DIM, dtype=torch.float64))  # the last 4 to 7 positions only
    with pytest.raises(ValueError, match=r"the cache holds the last \d+ of 20 positions \(a sliding-window "
                                         r"layer's\)"):
        _build("softmax", causal=True)(torch.randn(1, 1, DIM, dtype=torch.float64), cache=trimmed)


@pytest.mark.parametrize("name", [name for name in available_attentions()
                                  if attention_class(name).supports_decoding and name != "s4d"])  # S4D: no heads
def test_a_cache_of_a_layer_with_another_head_split_is_refused_by_name(name):
    """Was, for softmax and local attention: torch's "The expanded size of the tensor (4) must match ..."."""
    _, cache = _build(name, causal=True)(torch.randn(2, 5, DIM, dtype=torch.float64))
    layer = registered_layer(name, DIM, 2 * HEADS, causal=True, window=WINDOW).double()
    message = r"^(the )?cache "
    if isinstance(cache, KVCache):
        message = (r"^the cache holds keys and values \[B, L, H, D\] = \(2, \d, 4, 8\), this call \[B, T, H, D\] = "
                   r"\(2, 1, 8, 4\): pass the cache the previous call returned$")
    with pytest.raises(ValueError, match=message):
        layer(torch.randn(2, 1, DIM, dtype=torch.float64), cache=cache)


@pytest.mark.parametrize("name", [name for name in available_attentions() if attention_class(name).supports_decoding])
def test_every_cache_names_the_batch_size_it_was_built_for(name):
    """Was, for cosFormer, Performer and S4D: a message about the shapes of their sums or state."""
    layer = _build(name, causal=True)
    _, cache = layer(torch.randn(2, 5, DIM, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^cache was built for batch size 2, got input of batch size 1$"):
        layer(torch.randn(1, 1, DIM, dtype=torch.float64), cache=cache)


@pytest.mark.parametrize("name", available_attentions())
def test_a_padding_mask_on_another_device_is_refused_by_name(name):
    """Was a message from deep inside torch (on the meta device: "Tensor on device cpu is not on the expected
    device meta!")."""
    layer = _build(name, causal=False).to("meta")
    with pytest.raises(ValueError, match=r"^padding_mask is on cpu but the inputs are on meta; they must be on one "
                                         r"device$"):
        layer(torch.randn(2, 5, DIM, dtype=torch.float64, device="meta"), padding_mask=torch.ones(2, 5).bool())


def test_a_cache_moves_between_devices_but_keeps_its_dtypes():
    _, cache = _build("lavo", causal=True)(torch.randn(1, 5, DIM, dtype=torch.float64))
    assert [t.dtype for t in cache.to("cpu").tensors()] == [t.dtype for t in cache.tensors()]
    with pytest.raises(TypeError, match="Cache.to moves a cache to a device, not to torch.bfloat16"):
        cache.to(torch.bfloat16)


def test_softmax_caches_what_autocast_computes_and_needs_no_parameters_to_start_one():
    layer = build_attention("softmax", DIM, HEADS)
    x = torch.randn(2, 9, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, cache = layer(x)
    assert cache.keys.dtype == torch.bfloat16 and cache.nbytes() <= layer.cache_nbytes(2, 9, torch.bfloat16)
    layer.parameters = lambda recurse=True: iter(())  # as in a replica nn.DataParallel makes
    assert layer.empty_cache(2).keys.dtype == torch.get_default_dtype()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("how", ["module", "autocast"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", available_attentions())
def test_half_precision_follows_float64(name, causal, how, dtype):
    reference = _build(name, causal)
    layer = _build(name, causal).float()
    x = torch.randn(2, 70, DIM)  # two chunks of the chunked mechanisms
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[0, :9] = False  # left padding: positions with no real key before them
    if how == "module":
        layer, x = layer.to(dtype), x.to(dtype)
        reference.load_state_dict(layer.state_dict())  # the rounded weights: what is compared is the computation
        context = contextlib.nullcontext()
    else:
        context = torch.autocast("cpu", dtype=dtype)
    x.requires_grad_()
    with context:
        y, _ = layer(x, padding_mask=mask)
    assert y.dtype == dtype
    y.float().square().sum().backward()
    expected, _ = reference(x.detach().double(), padding_mask=mask)
    assert (y.double() - expected).abs().max() <= 0.03 * expected.abs().max()
    # S4D once failed as a bfloat16 or float16 module; ABC's gradients under float16 autocast were NaN
    for grad in (x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)):
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("name", [name for name in available_attentions() if attention_class(name).supports_decoding])
def test_a_thousand_bfloat16_tokens_decoded_one_at_a_time_follow_float64(name):
    """Under bfloat16 autocast a cache's running sums must not drift, as Performer's and cosFormer's did when
    they were summed in bfloat16."""
    reference = _build(name, causal=True)
    layer = _build(name, causal=True).float()
    x = torch.randn(1, 1000, DIM)
    with torch.no_grad():
        expected, _ = reference(x.double())
        cache, steps = None, []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for t in range(x.shape[1]):
                y, cache = layer(x[:, t:t + 1], cache=cache)
                steps.append(y)
    last = torch.cat(steps, 1)[:, -100:].double() - expected[:, -100:]
    assert last.norm() <= 0.02 * expected[:, -100:].norm()


@pytest.mark.parametrize("name", ["lavo", "local"])
def test_a_second_derivative_is_refused_by_name_where_the_backward_is_not_differentiable(name):
    """The CPU path's autograd Functions write their gradients in place; a gradient penalty or a Hessian-vector
    product through them must fail saying why. Taken with respect to chosen inputs, torch never reached
    @once_differentiable's error node, and the op's curvature was silently taken as zero."""
    layer = _build(name, causal=True)
    x = torch.randn(1, 9, DIM, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"\(PyTorch path\) has no second derivative \(its backward writes its "
                                           r"gradients in place\), and create_graph=True asks for one"):
        torch.autograd.grad(layer(x)[0].square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="has no second derivative"):
        torch.autograd.functional.hvp(lambda x: layer(x)[0].square().sum(), x, torch.ones_like(x))
    (grad,) = torch.autograd.grad(layer(x)[0].square().sum(), x)  # a first derivative alone runs as before
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("name", available_attentions())
def test_a_non_causal_rows_outputs_do_not_depend_on_the_padding_around_it(name):
    """An encoder's batch is padded to its longest row, on either side: a row's real outputs must be those of
    the row alone, however much padding leads or follows it."""
    layer = _build(name, causal=False)
    x = torch.randn(1, 13, DIM, dtype=torch.float64)
    alone, _ = layer(x)
    for before, after in ((1, 0), (3, 0), (6, 2), (0, 5)):
        padded = torch.cat([torch.randn(1, before, DIM, dtype=torch.float64), x,
                            torch.randn(1, after, DIM, dtype=torch.float64)], 1)
        mask = torch.zeros(1, padded.shape[1], dtype=torch.bool)
        mask[:, before:before + 13] = True
        y, _ = layer(padded, padding_mask=mask)
        torch.testing.assert_close(y[:, before:before + 13], alone, msg=f"{name}: {before} before, {after} after")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", available_attentions())
def test_a_nan_at_a_padded_position_reaches_no_real_one(name, causal):
    """Missing values are often NaN beside a mask: masked weights times NaN would still be NaN."""
    layer = _build(name, causal)
    x = torch.randn(2, T, DIM, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, :4], mask[1, 10:12], mask[1, -3:] = False, False, False
    y, _ = layer(torch.where(mask[..., None], x, torch.nan), padding_mask=mask)
    assert torch.isfinite(y).all()
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[~mask] == 0)
