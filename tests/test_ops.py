"""The blocked LAVO ops against the token-by-token references: outputs and gradients, float64."""
import pytest
import torch
from reference_checks import assert_padding_reaches_no_output, assert_same_outputs_and_grads, random_inputs

from lavo import LavoCache
from lavo.ops import (code_cross_attention, code_cross_attention_naive, lavo_attention, lavo_attention_cached,
                      lavo_attention_naive, local_attention, local_attention_chunk, local_attention_naive,
                      memory_read, orthogonal_basis, project)
from lavo.ops.abc import abc_attention
from lavo.ops.common import reciprocal
from lavo.ops.cosformer import cosformer_attention, cosformer_attention_causal, cosformer_cross_attention
from lavo.ops.longshort import longshort_attention
from lavo.ops.performer import performer_attention, performer_attention_causal
from lavo.ops.softmax import softmax_attention

# (T, window, D, rank): T = 1, T < w, T = w, awkward T with D = 60 and r < D.
SHAPES = [(1, 16, 8, 8), (5, 16, 8, 4), (16, 16, 12, 12), (63, 16, 60, 24)]


def _assert_same_outputs_and_grads(fast, naive, tensors):
    assert_same_outputs_and_grads(fast, naive, tensors, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dissection", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,window,D,rank", SHAPES)
def test_lavo_matches_naive(T, window, D, rank, causal, dissection, bias, padding):
    q, k, v, basis, pos_bias, mask = random_inputs(T, window, D, rank, causal, bias, padding)
    options = dict(window=window, causal=causal, pos_bias=pos_bias, dissection=dissection, padding_mask=mask)
    tensors = [t for t in (q, k, v, basis, pos_bias) if t is not None]
    _assert_same_outputs_and_grads(lavo_attention(q, k, v, basis, **options),
                                   lavo_attention_naive(q, k, v, basis, **options), tensors)


@pytest.mark.parametrize("causal", [True, False])
def test_a_sequence_shorter_than_its_window_is_computed_in_blocks_of_its_length(monkeypatch, causal):
    """Was: blocks of w, a w x 2w score table for any T (its float32 [H, w, 2w] bias 2 GiB at H = 4, w = 8192). The
    results, the cache (the layer's window) and its continuation are the references'."""
    from lavo.ops.local import blocked
    windows = []
    original = blocked.block_bias
    monkeypatch.setattr(blocked, "block_bias", lambda pos_bias, window, *args: windows.append(window) or original(
        pos_bias, window, *args))
    q, k, v, basis, pos_bias, mask = random_inputs(9, 4096, 6, 4, causal, True, True)
    first = dict(window=4096, causal=causal, pos_bias=pos_bias)
    for op, naive in ((local_attention, local_attention_naive), (lavo_attention, lavo_attention_naive)):
        args = (q, k, v) if op is local_attention else (q, k, v, basis)
        _assert_same_outputs_and_grads(op(*[x[:, :6] if x.dim() == 4 else x for x in args], padding_mask=mask[:, :6],
                                          **first),
                                       naive(*[x[:, :6] if x.dim() == 4 else x for x in args],
                                             padding_mask=mask[:, :6], **first), [q, k, v, pos_bias])
    assert windows == [6, 6]
    if causal:
        _, cache = lavo_attention(q[:, :6], k[:, :6], v[:, :6], basis, padding_mask=mask[:, :6], return_cache=True,
                                  **first)
        assert cache.window == 4096
        continued, _ = lavo_attention_cached(q[:, 6:], k[:, 6:], v[:, 6:], basis, cache, window=4096,
                                             pos_bias=pos_bias, padding_mask=mask[:, 6:])
        torch.testing.assert_close(continued, lavo_attention_naive(q, k, v, basis, padding_mask=mask, **first)[:, 6:])


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,window", [(1, 4), (7, 4), (33, 8), (63, 16)])
def test_local_matches_naive(T, window, causal, padding):
    q, k, v, _, pos_bias, mask = random_inputs(T, window, 6, 6, causal, True, padding)
    options = dict(window=window, causal=causal, pos_bias=pos_bias, padding_mask=mask)
    _assert_same_outputs_and_grads(local_attention(q, k, v, **options), local_attention_naive(q, k, v, **options),
                                   [q, k, v, pos_bias])


@pytest.mark.parametrize("padding", [False, True])
def test_cross_attention_matches_naive(padding):
    q, _, _, basis, _, _ = random_inputs(9, 4, 60, 20, True, False, False)
    _, x, _, _, _, mask = random_inputs(37, 4, 60, 20, True, False, padding, seed=1)
    _assert_same_outputs_and_grads(code_cross_attention(q, x, basis, padding_mask=mask),
                                   code_cross_attention_naive(q, x, basis, padding_mask=mask), [q, x, basis])


def test_cross_attention_takes_a_source_narrower_than_its_queries():
    """float64 queries reading a float32 source and basis, as a float32 source under float64 queries (was: the
    read's `expected scalar type Double but found Float`; a source wider than the queries was already read)."""
    q, _, _, basis, _, _ = random_inputs(9, 4, 8, 5, True, False, False)
    _, x, _, _, _, mask = random_inputs(11, 4, 8, 5, True, False, True, seed=1)
    narrow = [x.detach().float().requires_grad_(), basis.detach().float().requires_grad_()]
    wide = [t.detach().double().requires_grad_() for t in narrow]  # the same values
    out = code_cross_attention(q, *narrow, padding_mask=mask, backend="torch")
    reference = code_cross_attention_naive(q, *wide, padding_mask=mask)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-6)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), [q, *narrow])
    expected = torch.autograd.grad((reference * weights).sum(), [q, *wide])
    assert [g.dtype for g in grads] == [torch.float64, torch.float32, torch.float32]
    for got, wanted in zip(grads, expected):
        torch.testing.assert_close(got.double(), wanted, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", [dict(dissection=True), dict(dissection=False), dict(write="gated"),
                                     dict(write="decay", memory="vector")])
def test_a_sequence_continued_chunk_by_chunk_has_the_references_gradients(variant):
    """Differentiating through decoding: outputs and gradients of chunks of 5, 16 and 16 through the cache (window
    8, so chunks start inside windows and cross them) equal one reference call's."""
    q, k, v, basis, pos_bias, mask = random_inputs(37, 8, 60, 20, True, True, True)
    extra = {}
    if variant.get("write") == "gated":
        extra["gate"] = torch.randn(3, 20, 60, dtype=torch.float64, requires_grad=True)
    if variant.get("write") == "decay":
        extra["decay"] = torch.rand(3, dtype=torch.float64).add(0.05).requires_grad_()
    options = dict(window=8, pos_bias=pos_bias, **variant, **extra)
    if "write" in variant:
        cache = LavoCache.empty_variant(2, 3, 60, 20, memory=variant.get("memory", "scalar"), dtype=q.dtype)
    else:
        cache = LavoCache.empty(2, 3, 60, 20, dtype=q.dtype)
    outputs = []
    for piece in (slice(0, 5), slice(5, 21), slice(21, 37)):
        out, cache = lavo_attention_cached(q[:, piece], k[:, piece], v[:, piece], basis, cache,
                                           padding_mask=mask[:, piece], **options)
        outputs.append(out)
    _assert_same_outputs_and_grads(torch.cat(outputs, 1),
                                   lavo_attention_naive(q, k, v, basis, padding_mask=mask, **options),
                                   [q, k, v, basis, pos_bias, *extra.values()])


def test_causal_output_is_independent_of_the_future():
    q, k, v, basis, pos_bias, _ = random_inputs(40, 8, 8, 8, True, True, False)
    for dissection in (True, False):
        out = lavo_attention(q, k, v, basis, window=8, pos_bias=pos_bias, dissection=dissection)
        for t in (0, 8, 23):
            grads = torch.autograd.grad(out[:, t].sum(), (q, k, v), retain_graph=True)
            assert all(torch.all(g[:, t + 1:] == 0) for g in grads)
            assert grads[2][:, : t + 1].abs().sum() > 0  # and it does depend on the past


def test_all_padding_rows_give_zeros_not_nan():
    q, k, v, basis, pos_bias, _ = random_inputs(20, 8, 8, 8, True, True, False)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1] = False
    for causal in (True, False):
        bias = pos_bias if causal else None
        out = lavo_attention(q, k, v, basis, window=8, causal=causal, pos_bias=bias, padding_mask=mask)
        assert torch.all(out[1] == 0) and torch.isfinite(out).all()
        assert torch.isfinite(torch.autograd.grad(out.sum(), q)[0]).all()


# each op on (q, k, v, basis, padding_mask, causal pos_bias); the cross ops take k as their source
# the ops whose mask is over the keys only: their queries are all real
KEY_MASK_ONLY = {"local chunk", "cross", "cross naive"}
PADDED_OPS = {
    "lavo": lambda q, k, v, basis, mask, bias: lavo_attention(q, k, v, basis, window=4, pos_bias=bias,
                                                              padding_mask=mask),
    "lavo, no dissection, non-causal": lambda q, k, v, basis, mask, bias: lavo_attention(
        q, k, v, basis, window=4, causal=False, dissection=False, padding_mask=mask),
    "lavo naive": lambda q, k, v, basis, mask, bias: lavo_attention_naive(q, k, v, basis, window=4, pos_bias=bias,
                                                                          padding_mask=mask),
    "lavo cached": lambda q, k, v, basis, mask, bias: lavo_attention_cached(
        q, k, v, basis, LavoCache.empty(2, 3, 6, 4, dtype=q.dtype), window=4, pos_bias=bias, padding_mask=mask)[0],
    "lavo cached, gated": lambda q, k, v, basis, mask, bias: lavo_attention_cached(
        q, k, v, basis, LavoCache.empty_variant(2, 3, 6, 4, dtype=q.dtype), window=4, padding_mask=mask,
        write="gated", gate=basis)[0],
    "local": lambda q, k, v, basis, mask, bias: local_attention(q, k, v, window=4, pos_bias=bias, padding_mask=mask),
    "local naive": lambda q, k, v, basis, mask, bias: local_attention_naive(q, k, v, window=4, pos_bias=bias,
                                                                            padding_mask=mask),
    "local chunk": lambda q, k, v, basis, mask, bias: local_attention_chunk(q, k, v, start=0, window=4,
                                                                            pos_bias=bias, key_mask=mask),
    "cross": lambda q, k, v, basis, mask, bias: code_cross_attention(q, k, basis, padding_mask=mask),
    "cross naive": lambda q, k, v, basis, mask, bias: code_cross_attention_naive(q, k, basis, padding_mask=mask),
}


@pytest.mark.parametrize("name", PADDED_OPS)
def test_whatever_stands_at_padded_positions_reaches_no_output(name):
    q, k, v, basis, pos_bias, mask = random_inputs(23, 4, 6, 4, True, True, True)
    assert_padding_reaches_no_output(lambda q, k, v: PADDED_OPS[name](q, k, v, basis, mask, pos_bias), q, k, v,
                                     mask, queries_masked=name not in KEY_MASK_ONLY)


def test_exclusive_sums_keep_what_comes_before_a_large_entry():
    from lavo.ops.common import exclusive_cumsum
    x = torch.tensor([[1e-3, 1e8, 1.0], [float("inf"), 2.0, 3.0]], dtype=torch.float64)
    assert exclusive_cumsum(x, 1).tolist() == [[0.0, 1e-3, 1e8 + 1e-3], [0.0, float("inf"), float("inf")]]
    assert exclusive_cumsum(x, 0).tolist() == [[0.0, 0.0, 0.0], [1e-3, 1e8, 1.0]]


def test_orthogonal_basis_is_orthonormal():
    basis = orthogonal_basis(4, 24, 60, dtype=torch.float64)
    assert basis.shape == (4, 24, 60)
    torch.testing.assert_close(basis @ basis.transpose(-1, -2), torch.eye(24, dtype=torch.float64).expand(4, -1, -1))


def test_orthogonal_bases_are_drawn_uniformly():
    """Haar-distributed: every entry averages to zero over many draws. QR alone fixes the signs of R's diagonal,
    which biases the diagonal entries (without the sign fix, all 4000 draws have a negative basis[0, 0])."""
    bases = orthogonal_basis(4000, 3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert bases.mean(0).abs().max() < 0.05  # each entry's mean: standard error about 0.009


def test_local_matches_naive_with_sharp_scores():
    """Scores 10 times larger: weights far below the row's largest still count (down to exp(-80))."""
    q, k, v, _, pos_bias, mask = random_inputs(33, 8, 6, 6, True, True, True)
    sharp = (10 * q).detach().requires_grad_()
    options = dict(window=8, pos_bias=pos_bias, padding_mask=mask)
    _assert_same_outputs_and_grads(local_attention(sharp, k, v, **options),
                                   local_attention_naive(sharp, k, v, **options), [sharp, k, v, pos_bias])


def test_bfloat16_forward_is_close_to_float32():
    q, k, v, basis, pos_bias, mask = random_inputs(100, 16, 32, 32, True, True, True)
    q, k, v, basis, pos_bias = (t.detach().float() for t in (q, k, v, basis, pos_bias))
    reference = lavo_attention(q, k, v, basis, window=16, pos_bias=pos_bias, padding_mask=mask)
    low = lavo_attention(*(t.bfloat16() for t in (q, k, v, basis)), window=16, pos_bias=pos_bias.bfloat16(),
                         padding_mask=mask)
    assert low.dtype == torch.bfloat16
    error = (low.float() - reference).norm() / reference.norm()
    assert error < 2e-2, f"relative error {error:.4f}"


@pytest.mark.parametrize("dissection", [True, False])
def test_the_memory_of_bfloat16_inputs_sums_float32_coordinates(dissection):
    """DESIGN, decision 5: a bfloat16 token's coordinates on the basis are summed in float32, not first rounded to
    bfloat16 (which the Triton path does not do either), in one call and continued chunk by chunk (there only
    without dissection: a chunk's local outputs round differently in bfloat16 from the whole call's)."""
    torch.manual_seed(0)
    B, T, H, D, w, r = 2, 44, 2, 16, 8, 8
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.bfloat16) for _ in range(3))
    basis, pos_bias = orthogonal_basis(H, r, D), torch.randn(H, 2 * w, dtype=torch.bfloat16)
    options = dict(window=w, pos_bias=pos_bias, dissection=dissection)
    features = local_attention(q, k, v, window=w, pos_bias=pos_bias) if dissection else v
    coordinates = torch.einsum("bthd,hrd->bhtr", features.double(), basis.double())
    done = T // w * w
    _, whole = lavo_attention(q, k, v, basis, return_cache=True, backend="torch", **options)
    streamed = LavoCache.empty(B, H, D, r, dtype=torch.bfloat16)
    for piece in (slice(0, 5), slice(5, 18), slice(18, T)):
        _, streamed = lavo_attention_cached(q[:, piece], k[:, piece], v[:, piece], basis, streamed, **options)
    for cache in (whole,) if dissection else (whole, streamed):
        torch.testing.assert_close(cache.memory_sum, coordinates[:, :, :done].sum(2).float(), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(cache.window_sum, coordinates[:, :, done:].sum(2).float(), atol=1e-4, rtol=1e-5)


def _autocast_inputs():
    torch.manual_seed(0)
    return [torch.randn(2, 21, 2, 8, requires_grad=True) for _ in range(3)]


BASIS = orthogonal_basis(2, 6, 8)
# Each public op that takes q, k, v of one [B, T, H, D] shape, on the PyTorch path.
OPS = {
    "lavo": lambda q, k, v: lavo_attention(q, k, v, BASIS, window=4, pos_bias=torch.ones(2, 8), backend="torch"),
    "lavo non-causal": lambda q, k, v: lavo_attention(q, k, v, BASIS, window=4, causal=False, backend="torch"),
    "lavo gated": lambda q, k, v: lavo_attention(q, k, v, BASIS, window=4, write="gated", gate=torch.ones(2, 6, 8)),
    "lavo cached": lambda q, k, v: lavo_attention_cached(q, k, v, BASIS, LavoCache.empty(2, 2, 8, 6), window=4)[0],
    "local": lambda q, k, v: local_attention(q, k, v, window=4, pos_bias=torch.ones(2, 8), backend="torch"),
    "local chunk": lambda q, k, v: local_attention_chunk(q, k, v, start=3, window=4, pos_bias=torch.ones(2, 8)),
    "longshort": lambda q, k, v: longshort_attention(q, k, v, torch.ones(2, 8, 3), window=4),
    "abc": lambda q, k, v: abc_attention(q, k, v, torch.ones(2, 5, 8))[0],
}


@pytest.mark.parametrize("name", OPS)
def test_float32_inputs_under_bfloat16_autocast_are_computed_as_given(name):
    """What a model with normalised queries and keys hands an op under autocast (layer norm stays float32 there):
    the op runs, and its backward too. LAVO's and local attention's ops compute in float32 exactly as without
    autocast (their one call and their cached continuation alike); long-short's and ABC's, made of torch
    operations, take autocast's 16-bit matmuls."""
    q, k, v = _autocast_inputs()
    expected = OPS[name](q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = OPS[name](q, k, v)
    if name in ("longshort", "abc"):
        assert (out.float() - expected).abs().max() <= 0.03 * expected.abs().max()
    else:
        assert torch.equal(out, expected)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", OPS)
def test_inputs_of_two_dtypes_are_refused_by_name(name):
    q, k, v = (t.detach() for t in _autocast_inputs())
    with pytest.raises(ValueError, match=r"^v has dtype torch.bfloat16 but q has torch.float32; they must match$"):
        OPS[name](q, k, v.bfloat16())


def test_the_cached_ops_take_their_tensors_by_keyword():
    q, k, v = _autocast_inputs()
    out, _ = lavo_attention_cached(q=q, k=k, v=v, basis=BASIS, cache=LavoCache.empty(2, 2, 8, 6), window=4)
    assert torch.equal(out, OPS["lavo cached"](q, k, v))
    assert torch.equal(local_attention_chunk(q=q, k=k, v=v, start=3, window=4, pos_bias=torch.ones(2, 8)),
                       OPS["local chunk"](q, k, v))


def test_chunked_causal_ops_return_contiguous_outputs():
    """Their chunks are computed head-major: the output is laid out [B, T, H, D] again, as callers may view it."""
    from lavo.ops.cosformer import cosformer_attention_causal
    from lavo.ops.performer import performer_attention_causal
    q, k, v = (t.detach() for t in _autocast_inputs())
    for out in (abc_attention(q, k, v, torch.ones(2, 5, 8))[0],
                cosformer_attention_causal(q.relu(), k.relu(), v, max_length=32)[0],
                performer_attention_causal(q, k, v, torch.randn(6, 8))[0]):
        assert out.shape == q.shape and out.is_contiguous()


PROJECTION = torch.randn(6, 4)
# The ops of softmax and the feature maps, whose values may have a head size of their own, with a padding mask.
VALUE_SIZED_OPS = {
    "softmax": lambda q, k, v, mask: softmax_attention(q, k, v, key_mask=mask),
    "cosformer": lambda q, k, v, mask: cosformer_attention(q, k, v, padding_mask=mask),
    "cosformer causal": lambda q, k, v, mask: cosformer_attention_causal(q, k, v, 32, padding_mask=mask)[0],
    "cosformer cross": lambda q, k, v, mask: cosformer_cross_attention(q, k, v, padding_mask=mask),
    "performer": lambda q, k, v, mask: performer_attention(q, k, v, PROJECTION, padding_mask=mask),
    "performer causal": lambda q, k, v, mask: performer_attention_causal(q, k, v, PROJECTION, padding_mask=mask)[0],
}


@pytest.mark.parametrize("name", VALUE_SIZED_OPS)
def test_softmax_and_feature_map_ops_name_inputs_that_do_not_fit(name):
    """Were torch's errors from inside, e.g. "einsum(): subscript h has size 2 for operand 1 which does not
    broadcast with previously seen size 3", or a float mask taken as weights."""
    op = VALUE_SIZED_OPS[name]
    q, k, v = (torch.randn(2, 6, 2, 4) for _ in range(3))
    in_b_h_and_d = " in B, H and D" if name in ("softmax", "cosformer cross", "performer") else ""
    mask_axes = {"softmax": "B, Tk", "cosformer cross": "B, S"}.get(name, "B, T")  # as each op's docstring names it
    assert op(q, k, torch.randn(2, 6, 2, 3), None).shape == (2, 6, 2, 3)  # values of their own head size
    for (q_, k_, v_, mask), message in [
            ((q[:, :, 0], k, v, None), r"q must have shape \[B, T, H, D\], got \(2, 6, 4\)"),
            ((q, torch.randn(2, 6, 3, 4), v, None),
             rf"k has shape \(2, 6, 3, 4\) but q has \(2, 6, 2, 4\); they must match{in_b_h_and_d}"),
            ((q, k, torch.randn(2, 6, 3, 4), None),
             r"v has shape \(2, 6, 3, 4\) but k has \(2, 6, 2, 4\); they must match in B, T and H"),
            ((q, k.double(), v, None), r"k has dtype torch.float64 but q has torch.float32; they must match"),
            ((q, k, v.double(), None), r"v has dtype torch.float64 but q has torch.float32; they must match"),
            ((q, k, v, torch.ones(2, 5, dtype=torch.bool)),
             rf"{'key_mask' if name == 'softmax' else 'padding_mask'} must have shape \[{mask_axes}\] = \(2, 6\), "
             r"got \(2, 5\)"),
            ((q, k, v, torch.ones(2, 6)), r".* must be a bool tensor \(True = real token\), got dtype torch.float32")]:
        with pytest.raises(ValueError, match=f"^{message}$"):
            op(q_, k_, v_, mask)
    if name.startswith("performer"):
        with pytest.raises(ValueError, match=r"^projection must have shape \[F, D\] with D=4, got \(6, 5\)$"):
            (performer_attention if name == "performer" else performer_attention_causal)(q, k, v, torch.randn(6, 5))


def test_local_attention_chunk_names_inputs_that_do_not_fit():
    q = torch.randn(1, 3, 2, 4)
    for (k, v, key_mask), message in [
            ((torch.randn(1, 2, 2, 4),) * 2 + (None,), "k and v hold 2 positions, fewer than the 3 queries"),
            ((torch.randn(1, 5, 2, 8),) * 2 + (None,), r"k has shape \(1, 5, 2, 8\) but q has \(1, 3, 2, 4\); "
                                                      "they must match in B, H and D"),
            ((q, torch.randn(1, 4, 2, 4), None), r"v has shape \(1, 4, 2, 4\) but k has \(1, 3, 2, 4\)"),
            ((q, q, torch.ones(1, 2, dtype=torch.bool)), r"key_mask must have shape \[B, Tk\] = \(1, 3\), got "
                                                        r"\(1, 2\)")]:
        with pytest.raises(ValueError, match=f"^{message}"):
            local_attention_chunk(q, k, v, start=0, window=4, key_mask=key_mask)
    # was: a ZeroDivisionError, an IndexError, and a non-causal table taken silently
    for window, pos_bias, message in [
            (0, None, r"window must be a positive integer, got 0"),
            (3, torch.randn(2, 3), r"pos_bias must have shape \[H, 2w\] = \(2, 6\) for causal=True, window=3; got "
                                   r"\(2, 3\)"),
            (3, torch.randn(2, 11), r"pos_bias must have shape \[H, 2w\] = \(2, 6\) for causal=True, window=3; "
                                    r"got \(2, 11\)")]:
        with pytest.raises(ValueError, match=f"^{message}$"):
            local_attention_chunk(q, q, q, start=0, window=window, pos_bias=pos_bias)
    # the start of the keys given for the queries' (was: accepted, keys at negative positions, wrong outputs)
    keys = torch.randn(1, 5, 2, 4)
    for start, message in [(0, r"start=0 puts the first of the 5 keys at position -2: they end at the last query's "
                               r"position, start \+ 3 - 1, so start must be at least 5 - 3 = 2"),
                           (2.0, r"start must be an integer, the position of the first query; got 2.0")]:
        with pytest.raises(ValueError, match=f"^{message}$"):
            local_attention_chunk(q, keys, keys, start=start, window=4)
    local_attention_chunk(q, keys, keys, start=2, window=4)


@pytest.mark.parametrize("name", ["lavo", "lavo non-causal", "local", "longshort"])
def test_an_empty_batch_is_refused_by_the_windowed_ops_as_by_the_layers(name):
    """Was: `cannot reshape tensor of 0 elements into shape [0, -1, 3]`."""
    q = torch.randn(0, 21, 2, 8)
    with pytest.raises(ValueError, match=r"^q has an empty batch, shape \(0, 21, 2, 8\); a call needs at least one "
                                         r"sequence$"):
        OPS[name](q, q, q)


def test_cross_attention_refuses_an_empty_batch_or_query_axis():
    """Was: an IndexError from the memory read, and a ZeroDivisionError."""
    for q in (torch.randn(0, 3, 2, 8), torch.randn(1, 0, 2, 8)):
        with pytest.raises(ValueError, match=r"^q has an empty batch or query axis, shape"):
            code_cross_attention(q, torch.randn(q.shape[0], 5, 2, 8), BASIS)


def test_inputs_laid_out_as_sdpa_takes_them_are_named_rather_than_the_basis():
    """Was: `basis must have shape [H, r, D] with H=16, D=8, got (2, 6, 8)` alone, for q [B, H, T, D]."""
    q = torch.randn(1, 2, 16, 8)  # [B, H, T, D]: 2 heads of 16 positions
    message = (r"^basis must have shape \[H, r, D\] with H=16, D=8, got \(2, 6, 8\); the inputs' axis 1 has the "
               r"basis's 2 heads: lay them out \[B, T, H, D\] \(tensors in SDPA's \[B, H, T, D\] layout need "
               r"\.transpose\(1, 2\)\)$")
    with pytest.raises(ValueError, match=message):
        lavo_attention(q, q, q, BASIS, window=4)
    with pytest.raises(ValueError, match=message):
        code_cross_attention(q, q, BASIS)
    lavo_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), BASIS, window=4)
    with pytest.raises(ValueError, match=r"^basis must have shape \[H, r, D\] with H=2, D=8, got \(3, 4, 8\)$"):
        lavo_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), torch.randn(3, 4, 8), window=4)


def test_the_memory_functions_name_inputs_laid_out_by_position():
    """project and memory_read take heads before positions (was: `Expected size for first two dimensions of batch2
    tensor to be: [9, 8] but got: [2, 8]`)."""
    q = torch.randn(1, 9, 2, 8)  # [B, T, H, D]
    message = (r"^{} must have shape \[\.\.\., H, L, D\] with the basis's H=2, D=8 \(heads before positions: a "
               r"\[B, T, H, D\] tensor needs \.transpose\(1, 2\)\), got \(1, 9, 2, 8\)$")
    with pytest.raises(ValueError, match=message.format("x")):
        project(q, BASIS)
    with pytest.raises(ValueError, match=message.format("q")):
        memory_read(q, torch.randn(1, 2, 1, 6), BASIS, 0.5)
    with pytest.raises(ValueError, match=r"^coefficients must have one per slot, \[\.\.\., r\] with the basis's "
                                         r"r=6, got \(1, 2, 1, 5\)$"):
        memory_read(q.transpose(1, 2), torch.randn(1, 2, 1, 5), BASIS, 0.5)
    assert project(q.transpose(1, 2), BASIS).shape == (1, 2, 9, 6)


@pytest.mark.parametrize("op", [
    lambda q, scale: lavo_attention(q, q, q, BASIS, window=4, scale=scale, backend="torch"),
    lambda q, scale: local_attention(q, q, q, window=4, scale=scale, backend="torch"),
    lambda q, scale: code_cross_attention(q, q, BASIS, scale=scale, backend="torch"),
])
def test_a_scale_that_requires_a_gradient_is_refused_since_the_op_gives_it_none(op):
    """Was: accepted, and the scale's gradient silently None (a learned temperature that never trains)."""
    q = torch.randn(1, 9, 2, 8)
    with pytest.raises(TypeError, match=r"^scale is a constant of the op, which gives it no gradient: a learned "
                                        r"scale would never train; scale q instead"):
        op(q, torch.tensor(0.7, requires_grad=True))
    torch.testing.assert_close(op(q, torch.tensor(0.7)), op(q, 0.7))  # a constant tensor is a number


@pytest.mark.parametrize("op", [
    lambda q, scale: abc_attention(q, q, q, torch.ones(2, 5, 8, dtype=q.dtype), scale=scale)[0],
    lambda q, scale: longshort_attention(q, q, q, torch.ones(2, 8, 3, dtype=q.dtype), window=4, scale=scale),
    lambda q, scale: local_attention_chunk(q, q, q, start=0, window=4, scale=scale),
])
def test_ops_made_of_differentiable_operations_still_learn_a_scale(op):
    """Only the ops with autograd Functions of their own refuse a scale that needs a gradient."""
    q = torch.randn(1, 9, 2, 8, dtype=torch.float64)
    scale = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda s: op(q, s), (scale,))


@pytest.mark.parametrize("keep_weights", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_and_recomputed_local_kernel_matches_naive(monkeypatch, causal, keep_weights):
    """One window per chunk, weights recomputed in backward: the path long sequences take."""
    import lavo.ops.lavo.memory as memory_ops
    import lavo.ops.local.blocked as local_ops

    monkeypatch.setattr(local_ops, "SCORES_PER_CHUNK", 1)
    monkeypatch.setattr(memory_ops, "READ_ELEMENTS_PER_CHUNK", 1)
    if not keep_weights:
        monkeypatch.setattr(local_ops, "SAVED_WEIGHTS_LIMIT", 0)
    q, k, v, basis, pos_bias, mask = random_inputs(63, 8, 10, 6, causal, True, True)
    options = dict(window=8, causal=causal, pos_bias=pos_bias, padding_mask=mask)
    _assert_same_outputs_and_grads(lavo_attention(q, k, v, basis, **options),
                                   lavo_attention_naive(q, k, v, basis, **options), [q, k, v, basis, pos_bias])


@pytest.mark.parametrize("causal", [True, False])
def test_recomputed_float16_weights_give_the_saved_weights_gradients(monkeypatch, causal):
    """Long sequences recompute the local softmax in backward; in float16 it must repeat the forward's rounding
    (a log-sum-exp subtracted from float16 scores of about 30 did not), so every gradient is the same bit for bit."""
    import lavo.ops.local.blocked as local_ops

    monkeypatch.setattr(local_ops, "SCORES_PER_CHUNK", 1)
    q, k, v, _, pos_bias, mask = random_inputs(40, 8, 16, 4, causal, True, True)
    inputs = [(t * 3).half().detach().requires_grad_() for t in (q, k, v, pos_bias)]  # scores up to about 30

    def gradients():
        out = local_attention(*inputs[:3], window=8, causal=causal, pos_bias=inputs[3], padding_mask=mask)
        return torch.autograd.grad(out.float().square().sum(), inputs)

    saved = gradients()
    monkeypatch.setattr(local_ops, "SAVED_WEIGHTS_LIMIT", 0)
    for recomputed, kept in zip(gradients(), saved):
        assert torch.equal(recomputed, kept)


@pytest.mark.parametrize("shared", [True, False])
def test_memory_read_backward_matches_autograd(monkeypatch, shared):
    import lavo.ops.lavo.memory as memory_ops
    from lavo.ops.lavo.naive import memory_read_naive

    monkeypatch.setattr(memory_ops, "READ_ELEMENTS_PER_CHUNK", 1)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 2, 3, 7, 12, generator=g, dtype=torch.float64, requires_grad=True)
    coefficients = torch.randn(1 if shared else 5, 2, 3, 1 if shared else 7, 9, generator=g, dtype=torch.float64,
                               requires_grad=True)
    basis = orthogonal_basis(3, 9, 12, generator=g, dtype=torch.float64).requires_grad_()
    _assert_same_outputs_and_grads(memory_ops.memory_read(q, coefficients, basis, 0.3),
                                   memory_read_naive(q, coefficients, basis, 0.3),
                                   [q, coefficients, basis])


def test_unknown_backend_names_the_valid_ones():
    from lavo import LavoAttention

    q = torch.zeros(1, 4, 1, 8)
    message = r"backend must be one of 'auto', 'triton', 'torch', got 'cuda'"
    with pytest.raises(ValueError, match=message):
        lavo_attention(q, q, q, torch.eye(8)[None], window=4, backend="cuda")
    with pytest.raises(ValueError, match=message):
        LavoAttention(16, 2, backend="cuda")


def test_triton_releases_before_3_3_are_not_used():
    from lavo.ops.common import triton_supported

    assert [triton_supported(v) for v in ("3.0.0", "3.2.0", "3.3.0", "3.3.1+git9a2b", "3.6.0", "4.0.0")] == \
        [False, False, True, True, True, True]
    assert triton_supported("unknown") and not triton_supported(None)


def test_an_old_triton_leaves_auto_on_torch_and_is_named_when_triton_is_asked_for(monkeypatch):
    from types import SimpleNamespace

    from lavo.ops import common

    monkeypatch.setattr(common, "TRITON_VERSION", "3.0.0")
    monkeypatch.setattr(common, "TRITON_AVAILABLE", False)
    cuda_like = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)  # all that the choice reads of a tensor
    assert not common.uses_triton("auto", cuda_like)
    with pytest.raises(ValueError, match=r"^backend='triton' needs triton 3\.3 or later \(the kernels use "
                                         r"tl\.gather\), found 3\.0\.0; torch 2\.7 and later bring a recent "
                                         r"enough one, and backend='torch' runs without it$"):
        common.uses_triton("triton", cuda_like)
    monkeypatch.setattr(common, "TRITON_VERSION", None)
    with pytest.raises(ValueError, match=r"^backend='triton' needs the triton package \(pip install -e '\.\[gpu\]'\)$"):
        common.uses_triton("triton", cuda_like)


# Every write rule and memory kind but the paper's (tested above), with a learned read temperature.
VARIANTS = [("mean", "vector"), ("decay", "scalar"), ("decay", "vector"), ("gated", "scalar"), ("gated", "vector")]


def _variant_parameters(write, heads, rank, D, seed=5):
    g = torch.Generator().manual_seed(seed)
    decay = (0.5 * torch.rand(heads, generator=g, dtype=torch.float64)).requires_grad_() if write == "decay" else None
    gate = None
    if write == "gated":
        gate = (0.5 * torch.randn(heads, rank, D, generator=g, dtype=torch.float64)).requires_grad_()
    read_scale = (0.5 + torch.rand(heads, generator=g, dtype=torch.float64)).requires_grad_()
    return dict(write=write, decay=decay, gate=gate, read_scale=read_scale)


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("write,memory,causal", [(w, m, c) for w, m in VARIANTS for c in (True, False)
                                                 if c or w != "decay"])  # decay has no non-causal form
@pytest.mark.parametrize("T,window,D,rank", SHAPES + [(41, 4, 6, 5)])
def test_memory_variants_match_naive(T, window, D, rank, write, memory, causal, padding):
    q, k, v, basis, pos_bias, mask = random_inputs(T, window, D, rank, causal, True, padding)
    variant = _variant_parameters(write, 3, rank, D)
    options = dict(window=window, causal=causal, pos_bias=pos_bias, padding_mask=mask, memory=memory, **variant)
    tensors = [t for t in (q, k, v, basis, pos_bias, variant["decay"], variant["gate"], variant["read_scale"])
               if t is not None]
    _assert_same_outputs_and_grads(lavo_attention(q, k, v, basis, **options),
                                   lavo_attention_naive(q, k, v, basis, **options), tensors)


def test_read_scale_with_the_papers_memory_matches_naive():
    q, k, v, basis, pos_bias, mask = random_inputs(37, 8, 10, 6, True, True, True)
    read_scale = torch.tensor([0.5, 1.0, 2.5], dtype=torch.float64, requires_grad=True)
    options = dict(window=8, pos_bias=pos_bias, padding_mask=mask, read_scale=read_scale)
    _assert_same_outputs_and_grads(lavo_attention(q, k, v, basis, **options),
                                   lavo_attention_naive(q, k, v, basis, **options), [q, k, v, basis, read_scale])


def test_slot_states_merge_huge_logits_without_overflow():
    """Write logits of +-1000 overflow exp(); states kept relative to their largest logit merge, piece by piece,
    into the softmax-weighted mean that torch computes in one go."""
    from lavo.ops.lavo.variants import empty_state, merge, summarise

    g = torch.Generator().manual_seed(4)
    logits = 1000 * torch.randn(2, 3, 13, 5, generator=g, dtype=torch.float64)  # [B, H, L, r]
    values = torch.randn(2, 3, 13, 7, generator=g, dtype=torch.float64)  # vector values, D = 7
    real = torch.ones(2, 1, 13, 1, dtype=torch.float64)
    real[1, :, 4:6] = 0
    expected = logits.masked_fill(real == 0, float("-inf")).softmax(2).transpose(2, 3) @ values  # [B, H, r, D]
    state = empty_state(torch.zeros(2, 3, 5, 1, dtype=torch.float64), 7)
    for piece in (slice(0, 3), slice(3, 4), slice(4, 6), slice(6, 13)):
        state = merge(state, summarise(logits[:, :, piece], values[:, :, piece], real[:, :, piece], "vector"), 0.0)
    torch.testing.assert_close(state.mean(), expected)


@pytest.mark.parametrize("write,memory", VARIANTS)
def test_memory_variants_are_causal(write, memory):
    q, k, v, basis, pos_bias, _ = random_inputs(40, 8, 8, 8, True, True, False)
    variant = _variant_parameters(write, 3, 8, 8)
    out = lavo_attention(q, k, v, basis, window=8, pos_bias=pos_bias, memory=memory, **variant)
    for t in (0, 8, 23, 39):
        grads = torch.autograd.grad(out[:, t].sum(), (q, k, v), retain_graph=True)
        assert all(torch.all(g[:, t + 1:] == 0) for g in grads)
    # the memory branch is used: an early value changes a late output through it
    (grad_v,) = torch.autograd.grad(out[:, 39].sum(), v, retain_graph=True)
    assert grad_v[:, :16].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reciprocal_is_one_over_x_with_gradients_where_torchs_overflow(dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.cat([torch.logspace(-37, 37, 10001, dtype=dtype), torch.tensor([tiny], dtype=dtype)])
    assert torch.equal(reciprocal(x), 1 / x)  # the same value, bit for bit
    # d/dx (1/x) times a gradient as small as x: torch's backward forms 1/x^2 (inf in float32 below ~1e-19) first
    x = torch.tensor([1e-30, 1e-3, 2.0, 1e20], dtype=dtype, requires_grad=True)
    upstream = x.detach().clone()
    (grad,) = torch.autograd.grad(reciprocal(x), x, upstream)
    torch.testing.assert_close(grad, -1 / x.detach())
    (second,) = torch.autograd.grad(torch.autograd.grad(reciprocal(x).sum(), x, create_graph=True)[0].sum(), x)
    torch.testing.assert_close(second[1:], 2 / x.detach()[1:] ** 3)
