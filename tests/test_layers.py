"""LAVO layers: decoding in any chunking equals one call, constant-size cache, learned basis, clear errors."""
import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from lavo import LavoAttention, LavoCache, LavoCrossAttention, available_attentions, build_attention
from lavo.layers.abc import ABCAttention
from lavo.layers.local import LocalAttention
from lavo.layers.longshort import LongShortAttention
from lavo.layers.orthonormal import register_orthonormal
from lavo.layers.softmax import SoftmaxAttention
from lavo.ops import code_cross_attention, lavo_attention, lavo_attention_naive, orthogonal_basis
from lavo.registry import CROSS_ATTENTIONS, build_cross_attention


def _layer(dim=32, heads=4, **options):
    torch.manual_seed(0)
    layer = LavoAttention(dim, heads, **options)
    if layer.pos_bias is not None:
        torch.nn.init.normal_(layer.pos_bias, 0, 0.5)
    return layer


def _decode(layer, x, sizes, padding_mask=None):
    cache, outputs, start = None, [], 0
    for size in sizes:
        mask = None if padding_mask is None else padding_mask[:, start:start + size]
        y, cache = layer(x[:, start:start + size], padding_mask=mask, cache=cache)
        outputs.append(y)
        start += size
    assert start == x.shape[1]
    return torch.cat(outputs, 1), cache


VARIANT_OPTIONS = [dict(write="decay"), dict(write="gated"), dict(memory="vector"),
                   dict(write="gated", memory="vector", read_temperature=True), dict(read_temperature=True)]


def _variant_layer(**options):
    layer = _layer(window=8, rank=5, **options)
    with torch.no_grad():  # away from their neutral initial values, so a wrong path shows
        for name in ("write_gate", "log_read_scale"):
            if getattr(layer, name) is not None:
                getattr(layer, name).normal_(0, 0.5)
    return layer


@pytest.mark.parametrize("options", [{}, dict(dissection=False)] + VARIANT_OPTIONS, ids=str)
def test_one_token_and_uneven_chunks_match_full_forward(options):
    layer = _variant_layer(**options)
    x = torch.randn(2, 75, 32)
    mask = torch.ones(2, 75, dtype=torch.bool)
    mask[0, :9] = False
    mask[1, 40:43] = False
    with torch.no_grad():
        full, full_cache = layer(x, padding_mask=mask)
        for sizes in ([1] * 75, [3, 5, 8, 1, 30, 28], [75], [20, 55]):
            chunked, cache = _decode(layer, x, sizes, mask)
            torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.memory_sum, full_cache.memory_sum, atol=1e-4, rtol=1e-5)
            assert cache.position == full_cache.position == 75
    # Continuing from the full forward's cache equals a longer full forward.
    more = torch.randn(2, 11, 32)
    with torch.no_grad():
        continued, _ = layer(more, cache=full_cache)
        longer, _ = layer(torch.cat([x, more], 1), padding_mask=torch.cat([mask, torch.ones(2, 11).bool()], 1))
    torch.testing.assert_close(continued, longer[:, 75:], atol=1e-5, rtol=1e-5)


def test_empty_cache_equals_no_cache():
    layer = _layer(window=4)
    x = torch.randn(3, 10, 32)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, cache=layer.empty_cache(3))[0], layer(x)[0], atol=1e-6, rtol=1e-6)


def test_twenty_thousand_tokens_chunked_decoding_matches_full_forward():
    layer = _layer(dim=16, heads=2, window=32)
    x = torch.randn(1, 20_000, 16)
    with torch.no_grad():
        full, _ = layer(x)
        chunked, cache = _decode(layer, x, [1, 999, 1, 5000, 77, 13_922])
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    assert cache.nbytes() <= LavoCache.max_nbytes(1, 2, 8, 8, 32)


@pytest.mark.slow
def test_twenty_thousand_tokens_one_at_a_time_matches_full_forward():
    layer = _layer(dim=16, heads=2, window=32)
    x = torch.randn(1, 20_000, 16)
    with torch.no_grad():
        full, _ = layer(x)
        stepped, _ = _decode(layer, x, [1] * 20_000)
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=1e-5)


def test_cache_size_is_constant_in_context_length():
    layer = _layer(window=16)
    sizes = set()
    with torch.no_grad():
        # After one more token each context ends a window short of full: the most the cache ever holds.
        for length in (46, 494, 4846):
            _, cache = layer(torch.randn(2, length, 32))
            _, cache = layer(torch.randn(2, 1, 32), cache=cache)
            sizes.add(cache.nbytes())
    assert sizes == {LavoCache.max_nbytes(2, 4, 8, 8, 16)}


def _storage_bytes(cache):
    """Bytes of the distinct storages the cache's tensors keep alive (views included)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in cache.tensors()}.values())


@pytest.mark.parametrize("options", [{}, {"write": "decay"}, {"write": "gated"}, {"memory": "vector"}],
                         ids=["paper", "decay", "gated", "vector"])
def test_a_cache_keeps_alive_no_more_than_its_bound_whatever_the_context(options):
    """Views into a whole call's scan or a chunk's concatenation would pin storage that grows with the context
    while ``nbytes()`` stays constant."""
    layer, window = _layer(window=16, **options), 16
    empty = layer.empty_cache(2)
    assert _storage_bytes(empty) == empty.nbytes()
    with torch.no_grad():
        for length in (46, 494, 4846):
            _, cache = layer(torch.randn(2, length, 32))
            assert _storage_bytes(cache) <= layer.cache_nbytes(2, length), length
            for chunk in (window, 2 * window, 1):  # pieces that end on a window boundary, then one token
                _, cache = layer(torch.randn(2, chunk, 32), cache=cache)
                assert _storage_bytes(cache) <= layer.cache_nbytes(2, cache.position), (length, chunk)
        cache = empty
        for chunk in (window, window, 2 * window, 2 * window):  # from the start, in whole windows
            _, cache = layer(torch.randn(2, chunk, 32), cache=cache)
            assert _storage_bytes(cache) <= layer.cache_nbytes(2, cache.position), chunk


def test_learned_basis_stays_orthonormal_through_training():
    layer = _layer(rank=6, basis="learned", window=4)  # T = 20 spans 5 windows: the memory is used
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.05)
    before = layer.basis.detach().clone()
    for _ in range(5):
        y, _ = layer(torch.randn(2, 20, 32))
        y.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    basis = layer.basis.detach()
    assert not torch.allclose(basis, before), "the basis did not train"
    torch.testing.assert_close(basis @ basis.transpose(-1, -2), torch.eye(6).expand(4, -1, -1), atol=1e-5, rtol=0)


class _Holder(torch.nn.Module):
    def __init__(self, initial):
        super().__init__()
        self.basis = torch.nn.Parameter(initial.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rank", [16, 6])  # square (matrix exponential) and not (Householder)
def test_learned_basis_is_torchs_orthogonal_parametrization(rank, dtype):
    initial = orthogonal_basis(3, rank, 16, dtype=dtype)
    ours, torchs = _Holder(initial), _Holder(initial)
    torch.manual_seed(0)
    register_orthonormal(ours, "basis")
    after_ours = torch.randn(1)  # the registration draws what torch's does (a completion of a wide basis)
    torch.manual_seed(0)
    torch.nn.utils.parametrizations.orthogonal(torchs, "basis")
    assert torch.equal(torch.randn(1), after_ours)
    assert ours.state_dict().keys() == torchs.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), torchs.state_dict().values()))
    for holder in (ours, torchs):  # one step away from the base, so that the map itself is exercised
        with torch.no_grad():
            holder.parametrizations.basis.original.add_(0.1 * torch.randn(initial.shape,
                                                                         generator=torch.Generator().manual_seed(1)))
    assert torch.equal(ours.basis, torchs.basis)
    weights = torch.randn(initial.shape, dtype=dtype)
    gradients = [torch.autograd.grad((h.basis * weights).sum(), h.parametrizations.basis.original)[0]
                 for h in (ours, torchs)]
    assert torch.equal(*gradients)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [8, 6])
def test_learned_basis_stays_orthonormal_in_half_precision(rank, dtype):
    # torch's own map gave entries of 1e30 (bfloat16) or failed (Householder is not implemented in half on the CPU)
    layer = _layer(rank=rank, basis="learned", window=4).to(dtype)
    x = torch.randn(2, 20, 32, dtype=dtype, requires_grad=True)
    y, _ = layer(x)
    y.float().square().sum().backward()
    basis = layer.basis.float()
    assert layer.basis.dtype == dtype
    torch.testing.assert_close(basis @ basis.mT, torch.eye(rank).expand(4, -1, -1), atol=2e-2, rtol=0)
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.parametrizations.basis.original.grad).all()


@pytest.mark.parametrize("name, options", [("lavo", dict(basis="learned", rank=4)), ("lavo", dict(basis="learned")),
                                           ("performer", {})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_layer_built_under_a_half_precision_default_dtype_works(name, options, dtype):
    """As transformers' from_config(config, dtype=torch.bfloat16) builds a model: a learned basis of rank below the
    head dimension was NaN (torch's QR in half precision), and Performer's features failed to draw (no QR there)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = build_attention(name, 32, 4, **options)
        y, _ = layer(torch.randn(2, 9, 32))
    finally:
        torch.set_default_dtype(default)
    assert y.dtype == dtype and torch.isfinite(y).all()
    if name == "lavo":
        basis = layer.basis.float()
        torch.testing.assert_close(basis @ basis.mT, torch.eye(basis.shape[1]).expand(4, -1, -1), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kind, name", [("self", n) for n in available_attentions()]
                         + [("cross", n) for n in sorted(CROSS_ATTENTIONS)])
def test_a_layer_built_under_a_default_dtype_holds_every_tensor_in_it(kind, name, dtype):
    """As ``from_config(config, dtype=torch.float64)`` or ``from_pretrained(..., dtype=...)`` build a model: S4D's
    ``a_imag`` and ``c`` were drawn in float32 whatever the default, so a float64 model was not float64 end to end
    (and a bfloat16 one held two float32 tensors)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = build_attention(name, 16, 2) if kind == "self" else build_cross_attention(name, 16, 2)
    finally:
        torch.set_default_dtype(default)
    other = {key: t.dtype for key, t in layer.state_dict().items() if t.is_floating_point() and t.dtype != dtype}
    assert not other, f"{name}: {other}"


def test_fixed_basis_is_a_buffer():
    layer = _layer()
    assert "basis" in dict(layer.named_buffers()) and "basis" not in dict(layer.named_parameters())


def test_cross_attention_layer_ignores_padded_source():
    torch.manual_seed(0)
    layer = LavoCrossAttention(32, 4, rank=6)
    y, source = torch.randn(2, 7, 32), torch.randn(2, 13, 32)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, 9:] = False
    out = layer(y, source, mask)
    assert out.shape == (2, 7, 32)
    torch.testing.assert_close(layer(y[:1], source[:1, :9]), out[:1])


def test_cross_attention_with_an_empty_source_reads_an_empty_memory():
    torch.manual_seed(0)
    layer = LavoCrossAttention(32, 4, rank=6)
    y = torch.randn(2, 7, 32)
    empty = layer(y, torch.randn(2, 0, 32))
    assert torch.isfinite(empty).all()
    padded = layer(y, torch.randn(2, 5, 32), torch.zeros(2, 5, dtype=torch.bool))
    torch.testing.assert_close(empty, padded)  # an all-padding source is an empty one
    assert not torch.allclose(empty, layer(y, torch.randn(2, 5, 32)))


def test_non_causal_layer_sees_the_future():
    layer = _layer(causal=False, window=4)
    x = torch.randn(1, 12, 32, requires_grad=True)
    y, cache = layer(x)
    assert cache is None
    assert torch.autograd.grad(y[:, 0].sum(), x)[0][:, 1:].abs().sum() > 0


ERRORS = [
    (lambda: orthogonal_basis(2, 9, 8), r"rank \(9\) must be <= head_dim \(8\)"),
    (lambda: LavoAttention(32, 4, rank=9), r"rank \(9\) must be <= head_dim \(8\)"),
    (lambda: LavoAttention(30, 4), r"dim \(30\) must be divisible by heads \(4\)"),
    (lambda: LavoAttention(32, 4, window=0), r"window must be a positive integer, got 0"),
    (lambda: LavoAttention(32, 4, basis="random"), r"basis must be 'fixed' or 'learned', got 'random'"),
    (lambda: _layer(causal=False)(torch.randn(1, 4, 32), cache=_layer()(torch.randn(1, 4, 32))[1]),
     r"LavoAttention was built with causal=False; a cache is only for causal decoding"),
    (lambda: _layer()(torch.randn(2, 4, 32), cache=_layer()(torch.randn(1, 4, 32))[1]),
     r"cache was built for batch size 1, got input of batch size 2"),
    (lambda: _layer(window=8)(torch.randn(1, 4, 32), cache=_layer(window=4)(torch.randn(1, 4, 32))[1]),
     r"the cache was made by another LAVO layer: window 4 \(this layer: 8\)"),
    (lambda: _layer(window=8)(torch.randn(1, 4, 32), cache=_layer(window=4).empty_cache(1)),
     r"the cache was made by another LAVO layer: window 4 \(this layer: 8\)"),
    (lambda: LavoAttention(32, 4, rank=4)(torch.randn(1, 4, 32), cache=LavoAttention(32, 4)(torch.randn(1, 4, 32))[1]),
     r"the cache was made by another LAVO layer: rank 8 \(this layer: 4\)"),
    (lambda: _layer()(torch.randn(2, 4, 32), padding_mask=torch.ones(2, 5, dtype=torch.bool)),
     r"padding_mask must have shape \[B, T\] = \(2, 4\), got \(2, 5\)"),
    (lambda: _layer()(torch.randn(2, 4, 32), padding_mask=torch.ones(2, 4)),
     r"padding_mask must be a bool tensor \(True = real token\), got dtype torch.float32"),
    (lambda: _layer()(torch.randn(2, 4, 32), padding_mask=[[True] * 4] * 2),
     r"padding_mask must be a bool tensor \(True = real token\), got a list: convert it with torch.as_tensor"),
    (lambda: _layer()(torch.randn(2, 4, 32), padding_mask=np.ones((2, 4), dtype=bool)),
     r"padding_mask must be a bool tensor \(True = real token\), got a ndarray: convert it with torch.as_tensor"),
    (lambda: _layer()(torch.randn(2, 4, 31)), r"x must have shape \[B, T, 32\], got \(2, 4, 31\)"),
    (lambda: lavo_attention(*torch.randn(3, 1, 4, 2, 8), orthogonal_basis(2, 8, 8), window=2,
                            pos_bias=torch.zeros(2, 5)),
     r"pos_bias must have shape \[H, 2w\] = \(2, 4\) for causal=True, window=2; got \(2, 5\)"),
    (lambda: lavo_attention(*torch.randn(3, 1, 4, 2, 8), orthogonal_basis(2, 8, 8), window=2, causal=False,
                            pos_bias=torch.zeros(2, 4)),
     r"pos_bias must have shape \[H, 4w - 1\] = \(2, 7\) for causal=False, window=2; got \(2, 4\)"),
    (lambda: lavo_attention(torch.randn(1, 4, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 4, 2, 8),
                            orthogonal_basis(2, 8, 8), window=2),
     r"k has shape \(1, 5, 2, 8\) but q has \(1, 4, 2, 8\); they must match"),
    (lambda: lavo_attention(*torch.randn(3, 1, 4, 2, 8), orthogonal_basis(2, 8, 8), window=2, causal=False,
                            return_cache=True),
     r"a cache exists only for causal attention"),
    (lambda: LavoCrossAttention(32, 4)(torch.randn(2, 3, 32), torch.randn(2, 5, 32), torch.ones(2, 3).bool()),
     r"source_padding_mask must have shape \[B, S\] = \(2, 5\), got \(2, 3\)"),
    # a float head count (einops then caches its pattern with h=2.0, failing later layers too), a switch or a
    # window given as a string or a bool, and a basis of no slots
    (lambda: build_attention("softmax", 16, 2.0), r"^dim and heads must be positive integers, got dim=16, heads=2.0$"),
    (lambda: LavoCrossAttention(16.0, 2), r"^dim and heads must be positive integers, got dim=16.0, heads=2$"),
    (lambda: build_attention("lavo", 16, 2, causal="false"), r"^LavoAttention causal must be True or False, got "
                                                              r"'false'$"),
    (lambda: LavoAttention(32, 4, window=True), r"^window must be a positive integer, got True$"),
    # built directly, past the registry's check: "false" computed with the switch on, True as rank 1
    (lambda: LavoAttention(16, 2, dissection="false"),
     r"^LavoAttention dissection must be True or False, got 'false'$"),
    (lambda: LavoAttention(16, 2, read_temperature=1),
     r"^LavoAttention read_temperature must be True or False, got 1$"),
    (lambda: SoftmaxAttention(16, 2, rotary="no"), r"^SoftmaxAttention rotary must be True or False, got 'no'$"),
    (lambda: LocalAttention(16, 2, position_bias=None), r"^LocalAttention position_bias must be True or False, got "
                                                        r"None$"),
    (lambda: LongShortAttention(16, 2, dual_ln="yes"),
     r"^LongShortAttention dual_ln must be True or False, got 'yes'$"),
    (lambda: LavoAttention(16, 2, rank=True), r"^LavoAttention rank must be a positive integer, got True$"),
    (lambda: LavoCrossAttention(16, 2, rank=2.0), r"^LavoCrossAttention rank must be a positive integer, got 2.0$"),
    (lambda: ABCAttention(16, 2, slots=True), r"^ABCAttention slots must be a positive integer, got True$"),
    (lambda: lavo_attention(*torch.randn(3, 1, 4, 2, 8), orthogonal_basis(2, 4, 8)[:, :0], window=2),
     r"^basis has shape \(2, 0, 8\), rank 0: the memory needs at least one slot$"),
    (lambda: code_cross_attention(torch.randn(1, 4, 2, 8), torch.randn(1, 3, 2, 8), orthogonal_basis(2, 4, 8)[:, :0]),
     r"^basis has shape \(2, 0, 8\), rank 0: the memory needs at least one slot$"),
    # a head size computed as dim / heads, a float (was: torch.randn's `argument 'size' failed to unpack`)
    (lambda: orthogonal_basis(2, 4, 16 / 2), r"^orthogonal_basis head_dim must be a positive integer, got 8.0$"),
    (lambda: orthogonal_basis(0, 4, 8), r"^orthogonal_basis heads must be a positive integer, got 0$"),
]


@pytest.mark.parametrize("call,message", ERRORS, ids=[m[:40] for _, m in ERRORS])
def test_bad_input_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("options", VARIANT_OPTIONS[:3], ids=str)
def test_memory_variant_decodes_thousands_of_tokens_with_a_constant_cache(options):
    layer = _variant_layer(**options)
    x = torch.randn(1, 3000, 32)
    with torch.no_grad():
        full, _ = layer(x)
        chunked, cache = _decode(layer, x, [1, 999, 7, 1993])
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    # At a window boundary the cache holds one window of keys: w - 1 = 7 positions short of its bound.
    assert cache.nbytes() == layer.cache_nbytes(1, 3000) - layer.key_value_nbytes(1, 7, torch.float32)


def test_memory_variant_state_is_r_by_d_per_head():
    sizes = {}
    for memory in ("scalar", "vector"):
        layer = _layer(window=4, rank=5, write="gated", memory=memory)
        with torch.no_grad():
            _, cache = layer(torch.randn(2, 10, 32))
        sizes[memory] = cache.memory_sum.shape
    assert sizes == {"scalar": (2, 4, 5, 1), "vector": (2, 4, 5, 8)}


def test_gated_write_starts_as_the_papers_mean():
    torch.manual_seed(0)
    paper, gated = _layer(window=4, rank=6), _layer(window=4, rank=6, write="gated")
    gated.load_state_dict(paper.state_dict(), strict=False)
    x = torch.randn(2, 30, 32)
    with torch.no_grad():
        torch.testing.assert_close(gated(x)[0], paper(x)[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("options", [dict(read_temperature=True), dict(write="decay", read_temperature=True),
                                     dict(write="gated", memory="vector")])
def test_the_layer_hands_its_learned_memory_settings_to_the_op(options):
    """attend() on given q, k, v is the reference op with the layer's decay rates exp(log_decay), read factors
    exp(log_read_scale) and gates, drawn away from their initial values."""
    layer = _layer(window=4, rank=6, **options).double()
    torch.manual_seed(1)
    with torch.no_grad():
        for tensor in (layer.log_decay, layer.log_read_scale, layer.write_gate):
            if tensor is not None:
                tensor.normal_(-1 if tensor is layer.log_decay else 0, 0.5)
    q, k, v = torch.randn(3, 2, 21, 4, 8, dtype=torch.float64)
    out, _ = layer.attend(q, k, v, None, None)
    expected = lavo_attention_naive(
        q, k, v, layer.basis, window=4, pos_bias=layer.pos_bias, write=layer.write, memory=layer.memory,
        gate=layer.write_gate, decay=None if layer.log_decay is None else layer.log_decay.exp(),
        read_scale=None if layer.log_read_scale is None else layer.log_read_scale.exp())
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-9)


def test_decay_half_lives_start_geometric_from_the_window_to_64_windows():
    layer = _layer(heads=4, window=8, write="decay")
    half_lives = math.log(2) / layer.log_decay.exp()
    torch.testing.assert_close(half_lives, torch.tensor([8.0, 8 * 4, 8 * 16, 8 * 64]))


VARIANT_ERRORS = [
    (lambda: LavoAttention(32, 4, write="sum"), r"write must be one of \('mean', 'decay', 'gated'\), got 'sum'"),
    (lambda: LavoAttention(32, 4, memory="matrix"), r"memory must be one of \('scalar', 'vector'\), got 'matrix'"),
    (lambda: LavoAttention(32, 4, write="decay", causal=False), r"write='decay' .* has no non-causal form"),
    (lambda: LavoAttention(32, 4, memory="vector", dissection=False),
     r"write='mean', memory='vector' needs dissection=True"),
    # refused when built, not at the first forward pass (the Triton path computes the paper's memory only)
    *((lambda options=options: LavoAttention(32, 4, backend="triton", **options),
       r"^backend='triton' computes the paper's memory only .* use backend='torch' or 'auto' for the variants$")
      for options in (dict(write="gated"), dict(write="decay"), dict(memory="vector"), dict(read_temperature=True))),
    (lambda: lavo_attention(*torch.randn(3, 1, 4, 2, 8), orthogonal_basis(2, 8, 8), window=2, write="gated"),
     r"gate \[H, r, D\] goes with write='gated' and only with it \(write='gated'\)"),
    (lambda: lavo_attention(*torch.randn(3, 1, 4, 2, 8), orthogonal_basis(2, 8, 8), window=2, write="decay",
                            decay=torch.ones(3)), r"decay must have shape \[H\] = \(2,\), got \(3,\)"),
    (lambda: lavo_attention(*torch.randn(3, 1, 4, 2, 8), orthogonal_basis(2, 8, 8), window=2,
                            read_scale=torch.ones(2, 1)), r"read_scale must have shape \[H\] = \(2,\), got \(2, 1\)"),
    (lambda: _layer(write="gated")(torch.randn(1, 4, 32), cache=_layer()(torch.randn(1, 4, 32))[1]),
     r"the cache was made by another LAVO layer: write 'mean' \(this layer: 'gated'\)$"),
    (lambda: _layer()(torch.randn(1, 4, 32), cache=_layer(write="gated")(torch.randn(1, 4, 32))[1]),
     r"the cache was made by another LAVO layer: write 'gated' \(this layer: 'mean'\)$"),
    # Same shapes, another rule: only the settings the cache records tell these apart.
    (lambda: _layer(dissection=False)(torch.randn(1, 4, 32), cache=_layer()(torch.randn(1, 4, 32))[1]),
     r"the cache was made by another LAVO layer: dissection True \(this layer: False\)$"),
    (lambda: _layer(write="decay")(torch.randn(1, 4, 32), cache=_layer(write="gated")(torch.randn(1, 4, 32))[1]),
     r"the cache was made by another LAVO layer: write 'gated' \(this layer: 'decay'\)$"),
    (lambda: _layer(memory="vector")(torch.randn(1, 4, 32), cache=_layer(write="gated")(torch.randn(1, 4, 32))[1]),
     r"write 'gated' \(this layer: 'mean'\), memory 'scalar' \(this layer: 'vector'\)$"),
    (lambda: _layer(dissection=False)(torch.randn(1, 1, 32), cache=_layer().empty_cache(1)),
     r"the cache was made by another LAVO layer: dissection True \(this layer: False\)$"),
    # A cache that records no rule (built by hand) is still checked by its layout.
    (lambda: _layer(write="gated")(torch.randn(1, 4, 32), cache=replace(LavoCache.empty(1, 4, 8, 8), write=None)),
     r"this cache holds the paper's memory"),
    (lambda: _layer()(torch.randn(1, 4, 32), cache=LavoCache.empty_variant(1, 4, 8, 8)),
     r"this cache holds a memory variant's states"),
]


@pytest.mark.parametrize("call,message", VARIANT_ERRORS,
                         ids=[m.replace("the cache was made by another LAVO layer: ", "")[:40]
                              for _, m in VARIANT_ERRORS])
def test_bad_variant_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# LAVO's and local attention's PyTorch path are autograd Functions without setup_context, which torch.func refuses
# by name (docs/DESIGN.md, decision 22).
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", [n for n in available_attentions() if n not in ("lavo", "local")])
def test_per_sample_gradients_through_torch_func_are_each_samples_own(name, causal):
    """The causal softmax layer wrote a first call's keys into fresh buffers in place, which vmap refuses."""
    from torch.func import functional_call, grad, vmap
    torch.manual_seed(0)
    try:
        layer = build_attention(name, 16, 2, causal=causal)
    except ValueError as error:  # a mechanism without this form
        pytest.skip(str(error))
    params = {key: value.detach() for key, value in layer.named_parameters()}
    x = torch.randn(3, 9, 16)

    def loss(p, sample):
        return functional_call(layer, p, (sample[None],))[0].square().sum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note that SDPA has no batching rule yet
        batched = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for index in range(3):
        for key, value in grad(loss)(params, x[index]).items():
            torch.testing.assert_close(batched[key][index], value, atol=1e-5, rtol=1e-4, msg=key)
