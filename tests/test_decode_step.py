"""One LAVO decoding step on the fixed-layout cache (lavo_decode_step: torch ops and the fused Triton kernel, the
latter in Triton's CPU interpreter without a GPU) against the cached op and the token-by-token reference; the
layer and model on that cache, and generation's CUDA-graph decoder (its fallback and its step without capture)."""
from dataclasses import replace

import pytest
import torch
from reference_checks import needs_triton, random_inputs, recording_launching_on, zeros_and_garbage_at_padding

from lavo import LavoAttention, build_attention
from lavo.cache import LavoCache, LavoStepCache
from lavo import generate as generation
from lavo.generate import StepDecoder, generate, graphed_decoder
from lavo.model import build_model
from lavo.ops import lavo_attention_cached, lavo_attention_naive, lavo_decode_step, orthogonal_basis
from lavo.ops.lavo import step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
FLOAT32 = dict(atol=2e-5, rtol=1e-4)

# (context, steps, window, D, rank): D = 60 (padded to 64 in the kernel) with r < D and w = 5 (a ring of 10, not a
# power of two), a context shorter than the window, and steps across several window boundaries.
SHAPES = [(7, 9, 5, 60, 20), (2, 7, 4, 32, 32), (0, 6, 3, 16, 8), (20, 12, 8, 64, 48)]


def _inputs(context, steps, window, D, rank, padding, dtype=torch.float32):
    q, k, v, basis, pos_bias, mask = random_inputs(context + steps, window, D, rank, True, True, padding, B=2, H=3)
    q, k, v, basis, pos_bias = (x.detach().to(DEVICE, dtype) for x in (q, k, v, basis, pos_bias))
    return q, k, v, basis, pos_bias, None if mask is None else mask.to(DEVICE)


def _piece(mask, begin, end):
    return None if mask is None else mask[:, begin:end]


def _decode(q, k, v, basis, cache, context, backend, mask, **options):
    """The outputs at positions ``context ..`` one lavo_decode_step each, and the final cache."""
    outputs = []
    for t in range(context, q.shape[1]):
        out, cache = lavo_decode_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], basis, cache,
                                      padding_mask=_piece(mask, t, t + 1), backend=backend, **options)
        outputs.append(out)
    return torch.cat(outputs, 1), cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dissection,padding,read_scale", [(True, False, False), (True, True, True),
                                                            (False, True, False)])
@pytest.mark.parametrize("context,steps,window,D,rank", SHAPES)
def test_step_matches_the_cached_op(context, steps, window, D, rank, dissection, padding, read_scale, backend):
    q, k, v, basis, pos_bias, mask = _inputs(context, steps, window, D, rank, padding)
    options = dict(pos_bias=pos_bias, dissection=dissection,
                   read_scale=torch.rand(3, device=DEVICE) + 0.5 if read_scale else None)
    cache = LavoCache.empty(2, 3, D, rank, device=DEVICE, dtype=q.dtype)
    if context:
        _, cache = lavo_attention_cached(q[:, :context], k[:, :context], v[:, :context], basis, cache, window=window,
                                         padding_mask=_piece(mask, 0, context), **options)
    fixed = LavoStepCache.from_cache(cache, window)
    expected, cache = lavo_attention_cached(q[:, context:], k[:, context:], v[:, context:], basis, cache,
                                            window=window, padding_mask=_piece(mask, context, None), **options)
    out, fixed = _decode(q, k, v, basis, fixed, context, backend, mask, **options)
    torch.testing.assert_close(out, expected, **FLOAT32)
    assert fixed.position == cache.position
    assert fixed.steps.eq(cache.position).all()
    for name in ("memory_sum", "window_sum"):
        torch.testing.assert_close(getattr(fixed, name), getattr(cache, name), **FLOAT32)
    for name in ("memory_count", "window_count"):
        torch.testing.assert_close(getattr(fixed, name), getattr(cache, name)[:, None].expand(-1, 3))


@needs_triton
@pytest.mark.parametrize("dissection,padding,read_scale,dtype", [
    (True, True, True, torch.float32),
    pytest.param(False, True, False, torch.float32, marks=pytest.mark.slow),
    pytest.param(True, True, True, torch.bfloat16, marks=pytest.mark.slow)])
def test_kernel_step_at_128_features_and_a_long_window_matches_the_cached_op(dissection, padding, read_scale, dtype):
    """D = 128 with r < D and a window of 36 (a ring of 72 in a tile of 128): past 8,192 elements of ring per head
    the kernel launches 8 warps, not 4; steps across a window boundary. bfloat16 within its rounding."""
    context, steps, window, D, rank = 69, 5, 36, 128, 40
    q, k, v, basis, pos_bias, mask = _inputs(context, steps, window, D, rank, padding, dtype)
    options = dict(pos_bias=pos_bias, dissection=dissection,
                   read_scale=torch.rand(3, device=DEVICE, dtype=dtype) + 0.5 if read_scale else None)
    cache = LavoCache.empty(2, 3, D, rank, device=DEVICE, dtype=dtype)
    _, cache = lavo_attention_cached(q[:, :context], k[:, :context], v[:, :context], basis, cache, window=window,
                                     padding_mask=_piece(mask, 0, context), **options)
    fixed = LavoStepCache.from_cache(cache, window)
    expected, cache = lavo_attention_cached(q[:, context:], k[:, context:], v[:, context:], basis, cache,
                                            window=window, padding_mask=_piece(mask, context, None), **options)
    out, fixed = _decode(q, k, v, basis, fixed, context, "triton", mask, **options)
    tolerance = FLOAT32 if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, expected, **tolerance)
    assert fixed.position == cache.position == context + steps
    for name in ("memory_sum", "window_sum"):
        torch.testing.assert_close(getattr(fixed, name), getattr(cache, name), **tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
def test_whatever_stands_at_padded_steps_reaches_no_output(backend):
    q, k, v, basis, pos_bias, mask = _inputs(0, 13, 4, 60, 12, True)
    zeros, garbage = zeros_and_garbage_at_padding(mask, q, k, v)
    results = [_decode(*inputs, basis, LavoStepCache.from_cache(LavoCache.empty(2, 3, 60, 12, device=DEVICE), 4),
                       0, backend, mask, pos_bias=pos_bias) for inputs in (zeros, garbage)]
    (clean, clean_cache), (out, cache) = results
    assert torch.isfinite(clean).all() and torch.equal(clean, out)
    for name in ("keys", "values", "memory_sum", "window_sum"):
        assert torch.equal(getattr(clean_cache, name), getattr(cache, name))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dissection", [True, False])
def test_steps_from_the_empty_cache_match_the_reference(dissection, backend):
    q, k, v, basis, pos_bias, mask = _inputs(0, 13, 4, 60, 12, True)
    fixed = LavoStepCache.from_cache(LavoCache.empty(2, 3, 60, 12, device=DEVICE), 4)
    out, _ = _decode(q, k, v, basis, fixed, 0, backend, mask, pos_bias=pos_bias, dissection=dissection)
    expected = lavo_attention_naive(*(x.double() for x in (q, k, v, basis)), window=4, pos_bias=pos_bias.double(),
                                    dissection=dissection, padding_mask=mask)
    real = mask[:, :, None, None]
    torch.testing.assert_close((out * real).double(), expected * real, **FLOAT32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_step_is_close_to_the_float32_one(backend):
    q, k, v, basis, pos_bias, mask = _inputs(9, 11, 5, 64, 32, True)
    outputs = []
    for dtype in (torch.bfloat16, torch.float32):
        cast = [x.to(dtype) for x in (q, k, v, basis, pos_bias)]
        _, cache = lavo_attention_cached(*(x[:, :9] for x in cast[:3]), cast[3], LavoCache.empty(
            2, 3, 64, 32, device=DEVICE, dtype=dtype), window=5, pos_bias=cast[4], padding_mask=mask[:, :9])
        fixed = LavoStepCache.from_cache(cache, 5)
        outputs.append(_decode(*cast[:4], fixed, 9, backend if dtype == torch.bfloat16 else "torch", mask,
                               pos_bias=cast[4])[0].float())
    torch.testing.assert_close(outputs[0], outputs[1], atol=3e-2, rtol=3e-2)


@needs_triton
def test_backend_auto_takes_the_kernel_only_on_cuda(monkeypatch):
    q, k, v, basis, _, _ = _inputs(3, 1, 4, 16, 8, False)
    fixed = LavoStepCache.from_cache(LavoCache.empty(2, 3, 16, 8, device=DEVICE), 4)
    called = []
    monkeypatch.setattr(step, "_decode_step_torch", lambda *a, **o: called.append("torch") or q[:, :1])
    import lavo.ops.lavo.step_kernel as kernel
    monkeypatch.setattr(kernel, "decode_step_triton", lambda *a, **o: called.append("triton") or q[:, :1])
    for backend in ("auto", "torch", "triton"):
        lavo_decode_step(q[:, :1], k[:, :1], v[:, :1], basis, fixed, backend=backend)
    assert called == ["triton" if DEVICE == "cuda" else "torch", "torch", "triton"]


def test_from_cache_copies_and_the_step_updates_in_place():
    q, k, v, basis, _, _ = _inputs(6, 1, 4, 16, 8, False)
    _, cache = lavo_attention_cached(q[:, :6], k[:, :6], v[:, :6], basis, LavoCache.empty(2, 3, 16, 8, device=DEVICE),
                                     window=4)
    before = [t.clone() for t in cache.tensors()]
    fixed = LavoStepCache.from_cache(cache, 4)
    _, after = lavo_decode_step(q[:, 6:], k[:, 6:], v[:, 6:], basis, fixed, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(cache.tensors(), before))
    assert all(a is b for a, b in zip(after.tensors(), fixed.tensors())) and after.position == 7
    assert torch.equal(fixed.keys[:, :, 6], k[:, 6])  # position 6 in slot 6 mod 8
    assert fixed.nbytes() == after.nbytes()


def test_step_errors():
    q, k, v, basis, _, _ = _inputs(2, 0, 4, 16, 8, False)
    fixed = LavoStepCache.from_cache(LavoCache.empty(2, 3, 16, 8, device=DEVICE), 4)
    with pytest.raises(ValueError, match=r"a decoding step takes one position, got q of shape \(2, 2, 3, 16\)"):
        lavo_decode_step(q, k, v, basis, fixed)
    with pytest.raises(ValueError, match="run it under torch.no_grad"):
        lavo_decode_step(q[:, :1].requires_grad_(), k[:, :1], v[:, :1], basis, fixed)
    # a layer whose projections are frozen but whose position bias trains: the step ran, and its backward met the
    # overwritten cache with torch's in-place error
    layer = LavoAttention(48, 3, window=4, rank=8).to(DEVICE)
    layer.to_qkv.requires_grad_(False)
    with torch.no_grad():
        _, prompt = layer(torch.randn(2, 5, 48, device=DEVICE))
    with pytest.raises(ValueError, match="^a decoding step updates its cache in place and has no backward; run it "
                                         r"under torch.no_grad\(\) \(or decode through LavoCache to differentiate\)$"):
        layer(torch.randn(2, 1, 48, device=DEVICE), cache=layer.step_cache(prompt))
    with pytest.raises(ValueError, match=r"the cache holds \(batch, heads, head_dim, rank\) = \(2, 3, 16, 8\), the "
                                         r"inputs \(1, 3, 16, 8\)"):
        lavo_decode_step(q[:1, :1], k[:1, :1], v[:1, :1], basis, fixed)
    with pytest.raises(ValueError, match="a memory variant decodes through LavoCache"):
        LavoStepCache.from_cache(LavoCache.empty_variant(2, 3, 16, 8), 4)
    with pytest.raises(ValueError, match=r"the cache was made by another LAVO layer: window 5 \(this layer: 4\)"):
        LavoStepCache.from_cache(LavoCache.empty(2, 3, 16, 8, window=5), 4)


def test_each_op_names_the_lavo_cache_it_continues():
    """Was: `'NoneType' object has no attribute 'window'` (or `'check_fits'`), and, for a LavoCache given to the step,
    a count of heads that was its number of cached positions."""
    q, k, v, basis, _, _ = _inputs(2, 0, 4, 16, 8, False)
    q, k, v = q[:, :1], k[:, :1], v[:, :1]
    cache = LavoCache.empty(2, 3, 16, 8, device=DEVICE, window=4)
    for wrong in (None, cache):
        with pytest.raises(ValueError, match=rf"^lavo_decode_step continues a LavoStepCache, got a "
                                             rf"{type(wrong).__name__}: make one from a LavoCache with "
                                             r"LavoStepCache.from_cache\(cache, window\), or "
                                             r"layer.step_cache\(cache\)$"):
            lavo_decode_step(q, k, v, basis, wrong)
    for wrong in (None, LavoStepCache.from_cache(cache, 4)):
        with pytest.raises(ValueError, match=rf"^lavo_attention_cached continues a LavoCache, got a "
                                             rf"{type(wrong).__name__}: start a sequence from LavoCache.empty\(...\) "
                                             r"\(a LavoStepCache continues through lavo_decode_step\)$"):
            lavo_attention_cached(q, k, v, basis, wrong, window=4)


@needs_triton
def test_the_kernel_refuses_a_step_cache_it_would_misaddress():
    q, k, v, basis, _, _ = _inputs(0, 1, 4, 16, 8, False)
    fixed = LavoStepCache.from_cache(LavoCache.empty(2, 3, 16, 8, device=DEVICE), 4)
    strided = replace(fixed, keys=fixed.keys.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match=r"^the step kernel updates a LavoStepCache in place and addresses its "
                                         r"tensors as contiguous; this one has a strided tensor: make it with "
                                         r"LavoStepCache.from_cache \(layer.step_cache\)$"):
        lavo_decode_step(q, k, v, basis, strided, backend="triton")
    torch_out, _ = lavo_decode_step(q, k, v, basis, replace(strided, keys=strided.keys.clone()), backend="torch")
    out, _ = lavo_decode_step(q, k, v, basis, fixed, backend="triton")  # the same cache, contiguous
    torch.testing.assert_close(out, torch_out, **FLOAT32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_continues_a_step_cache_like_its_own_cache(backend):
    torch.manual_seed(0)
    layer = LavoAttention(48, 3, rank=10, window=4, backend=backend).to(DEVICE)
    torch.nn.init.normal_(layer.pos_bias)
    x = torch.randn(2, 15, 48, device=DEVICE)
    with torch.no_grad():
        _, cache = layer(x[:, :6])
        fixed = layer.step_cache(cache)
        expected, _ = layer(x[:, 6:], cache=cache)
        out, fixed = layer(x[:, 6:], cache=fixed)
    torch.testing.assert_close(out, expected, **FLOAT32)
    assert isinstance(fixed, LavoStepCache) and fixed.position == 15


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_layer_continues_a_step_cache_in_one_graph(backend):
    """The kernel's launch, which updates the cache in place, is a custom op: Dynamo had to trace Triton's launcher,
    which it cannot in the interpreter (a graph break, under fullgraph an error)."""
    torch.manual_seed(0)
    layer = LavoAttention(32, 2, rank=8, window=4, backend=backend).to(DEVICE)
    torch.nn.init.normal_(layer.pos_bias)
    x = torch.randn(2, 9, 32, device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        expected, _ = layer(x)
        _, cache = layer(x[:, :6])
        fixed, outputs = layer.step_cache(cache), []
        for t in range(6, 9):
            out, fixed = compiled(x[:, t:t + 1], cache=fixed)
            outputs.append(out)
    torch.testing.assert_close(torch.cat(outputs, 1), expected[:, 6:], **FLOAT32)
    assert fixed.steps.eq(9).all()


@pytest.mark.parametrize("attention,options", [("lavo", dict(window=4, write="decay")),
                                               ("lavo", dict(window=4, memory="vector")), ("softmax", {})])
def test_a_layer_without_a_step_layout_continues_the_cache_step_cache_returns(attention, options):
    """The decoding recipe (``fixed = layer.step_cache(cache)``, then one-token calls) gives the layer's outputs
    for every layer: one without a fixed layout returns its cache as it is (not None, which would start again)."""
    torch.manual_seed(0)
    layer = build_attention(attention, 32, 2, **options)
    x = torch.randn(1, 11, 32)
    with torch.no_grad():
        expected, _ = layer(x)
        _, cache = layer(x[:, :6])
        assert not layer.has_step_layout and layer.step_cache(cache) is cache
        steps = []
        for t in range(6, 11):
            out, cache = layer(x[:, t:t + 1], cache=layer.step_cache(cache))
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), expected[:, 6:], **FLOAT32)
    with pytest.raises(TypeError, match="^step_cache takes a cache that a call of this layer returned, got NoneType$"):
        layer.step_cache(None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_of_another_dtype_is_refused_by_name_outside_autocast(backend):
    B, H, D, r, w = 1, 2, 16, 8, 4
    q, k, v = (torch.randn(B, 1, H, D, dtype=torch.bfloat16, device=DEVICE) for _ in range(3))
    basis = orthogonal_basis(H, r, D).to(DEVICE)
    cache = LavoCache.empty(B, H, D, r, window=w, device=DEVICE)  # float32
    message = (r"^the cache holds torch.float32 keys and values and the inputs are torch.bfloat16: make the cache in "
               r"the inputs' dtype \(LavoCache.empty\(..., dtype=torch.bfloat16\)\) or call under torch.autocast$")
    with torch.no_grad():
        for call in (lambda: lavo_attention_cached(q, k, v, basis, cache, window=w),
                     lambda: lavo_decode_step(q, k, v, basis, LavoStepCache.from_cache(cache, w), backend=backend)):
            with pytest.raises(ValueError, match=message):
                call()


def test_step_cache_of_a_step_cache_is_itself_and_a_window_mismatch_is_refused():
    layer = LavoAttention(16, 2, window=4, backend="torch")
    with torch.no_grad():
        _, cache = layer(torch.randn(1, 6, 16))
        fixed = layer.step_cache(cache)
        assert layer.step_cache(fixed) is fixed  # generic code may convert twice
        for other, differ in [(LavoAttention(16, 2, window=3, position_bias=False, backend="torch"),
                               r"window 4 \(this layer: 3\)"),
                              (LavoAttention(16, 2, window=4, dissection=False, backend="torch"),
                               r"dissection True \(this layer: False\)")]:
            for call in (lambda: other.step_cache(fixed), lambda: other(torch.randn(1, 1, 16), cache=fixed),
                         lambda: other.step_cache(cache)):
                with pytest.raises(ValueError, match=f"^the cache was made by another LAVO layer: {differ}$"):
                    call()


def _model(attention="lavo", **options):
    torch.manual_seed(0)
    options = dict(window=4, **options) if attention == "lavo" else options
    return build_model(dict(vocab_size=50, dim=32, depth=2, heads=2, attention=attention, position="sinusoidal",
                            attention_options=options)).to(DEVICE).eval()


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_decoder_without_capture_gives_the_model_logits(backend):
    model = _model(backend=backend)
    ids = torch.randint(0, 50, (2, 14), device=DEVICE)
    with torch.no_grad():
        _, cache = model(ids[:, :5])
        decoder = StepDecoder(model, model.step_cache(cache), capture=False)
        for t in range(5, 14):
            expected, cache = model(ids[:, t:t + 1], cache=cache)
            torch.testing.assert_close(decoder.step(ids[:, t:t + 1]), expected, **FLOAT32)
    assert decoder.graph is None and decoder.position.item() == 14


def test_the_graph_is_recorded_and_replayed_on_the_caches_gpu(monkeypatch):
    """Recording and replaying run on the current device's streams, so the decoder makes its cache's GPU current
    (a model on ``cuda:1`` would otherwise record nothing of its work)."""
    inside, events = [], []

    class Graph:
        def replay(self):
            events.append(("replay", list(inside)))

    def capture_graph(fn, state):
        events.append(("record", list(inside)))
        return Graph(), fn()
    monkeypatch.setattr(generation, "launching_on", recording_launching_on(inside))
    monkeypatch.setattr(generation, "capture_graph", capture_graph)
    model = _model()
    with torch.no_grad():
        _, cache = model(torch.zeros(1, 3, dtype=torch.long, device=DEVICE))
        decoder = StepDecoder(model, model.step_cache(cache), capture=True)
        decoder.step(torch.zeros(1, 1, dtype=torch.long, device=DEVICE))
    device = torch.zeros(0, device=DEVICE).device
    assert events == [("record", [device]), ("replay", [device])]


def test_graphed_decoder_engages_only_on_cuda_with_fixed_layout_caches():
    with torch.no_grad():
        for model, fixed in ((_model(), True), (_model(write="decay"), False), (_model("softmax"), False)):
            _, cache = model(torch.zeros(1, 3, dtype=torch.long, device=DEVICE))
            assert (model.step_cache(cache) is not None) == fixed
            decoder = graphed_decoder(model, cache)
            assert (decoder is not None) == (fixed and DEVICE == "cuda")
            assert decoder is None or decoder.graph is not None


def test_generation_through_the_step_decoder_is_generation_through_the_cache(monkeypatch):
    model = _model()
    through_cache = generate(model, [1, 2, 3], 12, temperature=0, num_samples=2, device=DEVICE)
    monkeypatch.setattr(generation, "graphed_decoder",
                        lambda model, cache: StepDecoder(model, model.step_cache(cache), capture=DEVICE == "cuda"))
    assert generate(model, [1, 2, 3], 12, temperature=0, num_samples=2, device=DEVICE) == through_cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_one_step_may_continue_from_different_positions(backend):
    """``steps`` is per row: a batch of two sequences at positions 3 and 10 steps as each does alone."""
    q, k, v, basis, pos_bias, _ = _inputs(10, 1, 4, 32, 16, False)
    alone, rows = [], []
    for row, context in ((0, 3), (1, 10)):
        part = [x[row:row + 1, :context + 1] for x in (q, k, v)]
        _, cache = lavo_attention_cached(*(x[:, :context] for x in part), basis, LavoCache.empty(
            1, 3, 32, 16, device=DEVICE), window=4, pos_bias=pos_bias)
        rows.append(LavoStepCache.from_cache(cache, 4))
        alone.append(lavo_decode_step(*(x[:, context:] for x in part), basis, rows[-1].select(
            torch.tensor([0])), pos_bias=pos_bias, backend=backend)[0])
    both = LavoStepCache(*(torch.cat(pair) for pair in zip(*(r.tensors() for r in rows))), position=-1, window=4)
    new = [torch.cat([x[0:1, 3:4], x[1:2, 10:11]]) for x in (q, k, v)]
    out, _ = lavo_decode_step(*new, basis, both, pos_bias=pos_bias, backend=backend)
    torch.testing.assert_close(out, torch.cat(alone), **FLOAT32)
