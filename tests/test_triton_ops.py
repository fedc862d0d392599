"""The Triton kernels (the GPU path of the LAVO, local and cross-attention ops) against the token-by-token
references: outputs and gradients of q, k, v, basis and pos_bias. On CUDA when a GPU is present, otherwise in
Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
import re

import pytest
import torch
from reference_checks import (assert_compiled_matches_eager, assert_matches_reference,
                              assert_padding_reaches_no_output, needs_triton, random_inputs, recording_launching_on)

from lavo import LavoAttention, LavoCrossAttention
from lavo.layers.local import LocalAttention
from lavo.ops import (code_cross_attention, code_cross_attention_naive, lavo_attention, lavo_attention_naive,
                      local_attention, local_attention_naive)
from lavo.ops.common import check_interpreter_numpy, triton_interpreting, uses_triton
from lavo.ops.lavo.gpu import _coefficients, window_sums

pytestmark = needs_triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOAT32 = dict(atol=2e-5, rtol=1e-4)

# (T, window, D, rank): T not a multiple of w with r < D, T < w, T = 1, D = 128, D not a power of two, D = r = 128
# (the memory read's large-tile configuration, rows of 40 queries in two blocks). Small: the token-by-token
# reference dominates the time.
SHAPES = [(63, 16, 32, 12), (5, 16, 64, 64), (1, 4, 32, 8), (21, 8, 128, 40), (24, 16, 48, 48), (40, 8, 128, 128)]


def _triton_inputs(T, window, D, rank, causal, padding, B=2, H=2, seed=0):
    return random_inputs(T, window, D, rank, causal, True, padding, B=B, H=H, seed=seed)


def _on(mask, device):
    return None if mask is None else mask.to(device)


@pytest.mark.parametrize("bias,padding", [(False, False), (True, True)])
@pytest.mark.parametrize("dissection", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,window,D,rank", SHAPES)
def test_lavo_kernels_match_naive(T, window, D, rank, causal, dissection, bias, padding):
    q, k, v, basis, pos_bias, mask = _triton_inputs(T, window, D, rank, causal, padding)
    options = dict(window=window, causal=causal, dissection=dissection)

    def fast(q, k, v, basis, *pos_bias):
        return lavo_attention(q, k, v, basis, pos_bias=pos_bias[0] if bias else None,
                              padding_mask=_on(mask, DEVICE), backend="triton", **options)

    def naive(q, k, v, basis, *pos_bias):
        return lavo_attention_naive(q, k, v, basis, pos_bias=pos_bias[0] if bias else None, padding_mask=mask,
                                    **options)
    assert_matches_reference(fast, naive, [q, k, v, basis] + ([pos_bias] if bias else []), device=DEVICE, **FLOAT32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,window,D,rank", [(50, 12, 40, 10), (61, 24, 24, 24)])
def test_kernels_match_naive_with_windows_that_are_not_powers_of_two(T, window, D, rank, causal):
    """The kernels cut key ranges into power-of-two blocks: windows of 12 and 24 end inside one."""
    q, k, v, basis, pos_bias, mask = _triton_inputs(T, window, D, rank, causal, True)
    options = dict(window=window, causal=causal)

    def fast(q, k, v, basis, pos_bias):
        mask_on = _on(mask, DEVICE)
        return (lavo_attention(q, k, v, basis, pos_bias=pos_bias, padding_mask=mask_on, backend="triton", **options)
                + local_attention(q, k, v, pos_bias=pos_bias, padding_mask=mask_on, backend="triton", **options))

    def naive(q, k, v, basis, pos_bias):
        return (lavo_attention_naive(q, k, v, basis, pos_bias=pos_bias, padding_mask=mask, **options)
                + local_attention_naive(q, k, v, pos_bias=pos_bias, padding_mask=mask, **options))
    assert_matches_reference(fast, naive, [q, k, v, basis, pos_bias], device=DEVICE, **FLOAT32)


KERNEL_OPS = {
    "lavo": lambda q, k, v, basis, mask, bias: lavo_attention(q, k, v, basis, window=8, pos_bias=bias,
                                                              padding_mask=mask, backend="triton"),
    "lavo, no dissection, non-causal": lambda q, k, v, basis, mask, bias: lavo_attention(
        q, k, v, basis, window=8, causal=False, dissection=False, padding_mask=mask, backend="triton"),
    "local": lambda q, k, v, basis, mask, bias: local_attention(q, k, v, window=8, pos_bias=bias, padding_mask=mask,
                                                                backend="triton"),
    "cross": lambda q, k, v, basis, mask, bias: code_cross_attention(q, k, basis, padding_mask=mask,
                                                                     backend="triton"),
}


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_whatever_stands_at_padded_positions_reaches_no_kernel_output(name):
    *tensors, mask = _triton_inputs(23, 8, 32, 8, True, True)
    q, k, v, basis, pos_bias = (t.detach().to(DEVICE, torch.float32) for t in tensors)
    mask = mask.to(DEVICE)
    assert_padding_reaches_no_output(lambda q, k, v: KERNEL_OPS[name](q, k, v, basis, mask, pos_bias),
                                     q.requires_grad_(), k, v, mask, queries_masked=name != "cross")


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_a_second_derivative_through_the_kernels_is_refused_by_name(name):
    """The backward kernels have no derivative: create_graph=True fails saying so, as on the PyTorch path, rather
    than with torch's custom-op error at the second backward, which asked to register an autograd formula."""
    *tensors, mask = _triton_inputs(13, 8, 16, 4, True, True)
    q, k, v, basis, pos_bias = (t.detach().to(DEVICE, torch.float32).requires_grad_() for t in tensors)
    out = KERNEL_OPS[name](q, k, v, basis, mask.to(DEVICE), pos_bias)
    with pytest.raises(RuntimeError, match=r"\(Triton path\) has no second derivative"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    (grad,) = torch.autograd.grad(KERNEL_OPS[name](q, k, v, basis, mask.to(DEVICE), pos_bias).square().sum(), q)
    assert torch.isfinite(grad).all()  # a first derivative alone runs as before


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,window,D", [(1, 4, 32), (7, 16, 64), (63, 16, 32), (70, 32, 64)])
def test_window_kernel_matches_naive(T, window, D, causal, padding):
    q, k, v, _, pos_bias, mask = _triton_inputs(T, window, D, 4, causal, padding)
    options = dict(window=window, causal=causal)
    assert_matches_reference(
        lambda *x: local_attention(*x[:3], pos_bias=x[3], padding_mask=_on(mask, DEVICE), backend="triton",
                                   **options),
        lambda *x: local_attention_naive(*x[:3], pos_bias=x[3], padding_mask=mask, **options),
        [q, k, v, pos_bias], device=DEVICE, **FLOAT32)


@pytest.mark.parametrize("causal", [True, False])
def test_window_kernel_of_one_token_windows_over_a_block_and_one_matches_naive(causal):
    """``w = 1`` at ``T = 65`` (a block of 64 and one): the last query of the first block sees the first key of the
    next one, the key a key range ending one short leaves out."""
    q, k, v, _, pos_bias, mask = _triton_inputs(65, 1, 16, 4, causal, True, H=1)
    options = dict(window=1, causal=causal)
    assert_matches_reference(
        lambda *x: local_attention(*x[:3], pos_bias=x[3], padding_mask=_on(mask, DEVICE), backend="triton",
                                   **options),
        lambda *x: local_attention_naive(*x[:3], pos_bias=x[3], padding_mask=mask, **options),
        [q, k, v, pos_bias], device=DEVICE, **FLOAT32)


def _heads_outermost(x):
    """``x [B, T, H, D]`` stored as ``[B, H, T, D]``: a stride along the heads of ``T D``, not ``D``."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("dissection", [True, False])
def test_kernels_read_inputs_stored_heads_outermost(dissection):
    """q, k, v as transposes of ``[B, H, T, D]`` tensors, which the kernels take as they are (one set of strides):
    outputs and gradients of every input as the naive reference's."""
    q, k, v, basis, pos_bias, mask = _triton_inputs(21, 8, 32, 12, True, True)
    assert _heads_outermost(q).stride(2) == 21 * 32
    options = dict(window=8, dissection=dissection)

    def fast(q, k, v, basis, pos_bias):
        q, k, v = (_heads_outermost(x) for x in (q, k, v))
        return lavo_attention(q, k, v, basis, pos_bias=pos_bias, padding_mask=_on(mask, DEVICE), backend="triton",
                              **options)
    assert_matches_reference(
        fast, lambda *x: lavo_attention_naive(*x[:4], pos_bias=x[4], padding_mask=mask, **options),
        [q, k, v, basis, pos_bias], device=DEVICE, **FLOAT32)


@pytest.mark.parametrize("name", ["local", "cross"])
def test_a_broadcast_output_gradient_reaches_the_kernels_as_values(name):
    """``out.sum().backward()`` hands the kernels' backward a gradient expanded from one number (strides of zero):
    it is laid out before the kernels read it as contiguous, giving the naive reference's gradients."""
    q, k, v, basis, _, _ = _triton_inputs(13, 4, 32, 8, True, False, H=1)
    ops = {"local": (lambda q, k: local_attention(q, k, k, window=4, backend="triton"),
                     lambda q, k: local_attention_naive(q, k, k, window=4)),
           "cross": (lambda q, k: code_cross_attention(q, k, basis.to(q), backend="triton"),
                     lambda q, k: code_cross_attention_naive(q, k, basis.detach()))}
    fast, naive = ops[name]
    inputs = [x.detach().float().to(DEVICE).requires_grad_() for x in (q, k)]
    grads = torch.autograd.grad(fast(*inputs).sum(), inputs)
    expected = torch.autograd.grad(naive(q, k).sum(), (q, k))
    for got, wanted in zip(grads, expected):
        torch.testing.assert_close(got.double().cpu(), wanted, **FLOAT32)


@pytest.mark.parametrize("padding", [False, True])
def test_cross_attention_kernel_matches_naive(padding):
    q, _, _, basis, _, _ = _triton_inputs(9, 4, 48, 20, True, False)
    _, x, _, _, _, mask = _triton_inputs(37, 4, 48, 20, True, padding, seed=1)
    assert_matches_reference(
        lambda q, x, basis: code_cross_attention(q, x, basis, padding_mask=_on(mask, DEVICE), backend="triton"),
        lambda q, x, basis: code_cross_attention_naive(q, x, basis, padding_mask=mask),
        [q, x, basis], device=DEVICE, **FLOAT32)


def test_cross_attention_reads_a_source_of_another_dtype_at_the_queries_precision():
    """A float64 source under float32 queries, which the torch path takes: the Triton path's outputs and
    gradients follow the float64 reference (its backward failed on a float64 operand)."""
    q, x, _, basis, _, mask = _triton_inputs(9, 4, 32, 8, True, True)
    fast = [q.detach().float().to(DEVICE).requires_grad_(), x.detach().to(DEVICE).requires_grad_()]
    out = code_cross_attention(*fast, basis.detach().float().to(DEVICE), padding_mask=_on(mask, DEVICE),
                               backend="triton")
    reference = code_cross_attention_naive(q, x, basis.detach(), padding_mask=mask)
    weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weights.to(DEVICE)).sum(), fast)
    expected = torch.autograd.grad((reference * weights).sum(), (q, x))
    for got, wanted in zip((out, *grads), (reference, *expected)):
        torch.testing.assert_close(got.detach().double().cpu(), wanted.detach(), **FLOAT32)


@pytest.mark.parametrize("dissection", [True, False])
def test_bfloat16_kernels_are_close_to_the_float32_reference(dissection):
    q, k, v, basis, pos_bias, mask = _triton_inputs(100, 16, 64, 32, True, True)
    inputs = [q, k, v, basis, pos_bias]
    options = dict(window=16, dissection=dissection)
    fast = [x.to(DEVICE, torch.bfloat16).requires_grad_() for x in inputs]
    reference = [x.float().requires_grad_() for x in inputs]
    out = lavo_attention(*fast[:4], pos_bias=fast[4], padding_mask=_on(mask, DEVICE), backend="triton", **options)
    expected = lavo_attention(*reference[:4], pos_bias=reference[4], padding_mask=mask, backend="torch", **options)
    assert out.dtype == torch.bfloat16

    def relative_error(a, b):
        return ((a.float().cpu() - b).norm() / b.norm()).item()
    assert relative_error(out, expected) < 2e-2
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out.float() * weights.to(DEVICE)).sum(), fast)
    expected_grads = torch.autograd.grad((expected * weights).sum(), reference)
    for name, grad, wanted in zip(("q", "k", "v", "basis", "pos_bias"), grads, expected_grads):
        assert relative_error(grad, wanted) < 3e-2, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16_bit_query_and_key_gradients_do_not_take_the_rounded_output(dtype):
    """Values sharing a large offset, where the score gradients ``p (dO . v - dO . O)`` cancel: with ``dO . O``
    taken from the output rounded to 16 bits, the q and k gradients had many times the error of the kernels on
    float32 inputs (rounded back; docs/DESIGN.md gives the ratio); summed from the float32 weights and ``dO V^T``,
    at most about twice it, as on the PyTorch path (test_16_bit_numerics.py)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, D = 1, 96, 2, 32
    q, k = (4 * torch.randn(B, T, H, D, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g) + 1 + 3 * torch.randn(1, 1, H, D, generator=g)
    grad_out = torch.randn(B, T, H, D, generator=g)
    rounded = [x.to(dtype) for x in (q, k, v, grad_out)]
    exact = [x.double().requires_grad_() for x in rounded[:3]]
    expected = torch.autograd.grad(local_attention(*exact, window=32, backend="torch"), exact[:2],
                                   rounded[3].double())

    def errors(inside):
        inputs = [x.to(DEVICE).requires_grad_() for x in rounded[:3]]
        out = local_attention(*(x.to(inside) for x in inputs), window=32, backend="triton").to(dtype)
        grads = torch.autograd.grad(out, inputs[:2], rounded[3].to(DEVICE))
        return [((a.double().cpu() - b).norm() / b.norm()).item() for a, b in zip(grads, expected)]
    ours, yardstick = errors(dtype), errors(torch.float32)
    assert all(mine < 3 * best for mine, best in zip(ours, yardstick)), (ours, yardstick)


# (dtype, T, window, D, rank, causal, dissection): the 16-bit cases the test above leaves out. bfloat16 non-causal
# (one coefficient row), at D = 128 with r < D, at D = r = 128 per token (the large read tile in the configuration
# a GPU of an A100's shared memory or more takes: the 99 KB test forces the other), T < w; and float16, which the
# Triton path takes too. The slow one runs in the GPU check (benchmarks/gpu_check.py: -m "slow or not slow").
SIXTEEN_BIT_CASES = [(torch.bfloat16, 21, 8, 128, 40, False, True), (torch.bfloat16, 5, 16, 32, 8, False, False),
                     (torch.float16, 21, 8, 64, 24, True, True),
                     pytest.param(torch.bfloat16, 45, 8, 128, 128, True, False, marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype,T,window,D,rank,causal,dissection", SIXTEEN_BIT_CASES)
def test_16_bit_kernels_over_awkward_shapes_are_close_to_the_reference(dtype, T, window, D, rank, causal, dissection):
    """Outputs and the gradients of q, k, v, basis and pos_bias within 16-bit rounding of the float64 torch path
    (itself checked against the token-by-token reference in test_ops.py)."""
    q, k, v, basis, pos_bias, mask = _triton_inputs(T, window, D, rank, causal, True, H=1)
    options = dict(window=window, causal=causal, dissection=dissection)
    assert_matches_reference(
        lambda *x: lavo_attention(*x[:4], pos_bias=x[4], padding_mask=_on(mask, DEVICE), backend="triton", **options),
        lambda *x: lavo_attention(*x[:4], pos_bias=x[4], padding_mask=mask, backend="torch", **options),
        [q, k, v, basis, pos_bias], device=DEVICE, dtype=dtype, relative=3e-2)


@pytest.mark.parametrize("causal,dissection,bias", [(True, False, False), (False, True, True)])
def test_kernels_with_a_scale_of_their_own_match_naive(causal, dissection, bias):
    """``scale`` other than ``D ** -0.5`` reaches both kernels' logits; and padding without a position bias."""
    q, k, v, basis, pos_bias, mask = _triton_inputs(13, 4, 32, 12, causal, True, H=1)
    options = dict(window=4, causal=causal, dissection=dissection, scale=0.3)
    tensors = [q, k, v, basis] + ([pos_bias] if bias else [])
    assert_matches_reference(
        lambda *x: lavo_attention(*x[:4], pos_bias=x[4] if bias else None, padding_mask=_on(mask, DEVICE),
                                  backend="triton", **options),
        lambda *x: lavo_attention_naive(*x[:4], pos_bias=x[4] if bias else None, padding_mask=mask, **options),
        tensors, device=DEVICE, **FLOAT32)
    _, x, _, _, _, source_mask = _triton_inputs(7, 4, 32, 12, True, True, H=1, seed=1)
    assert_matches_reference(
        lambda q, x, basis: code_cross_attention(q, x, basis, padding_mask=_on(source_mask, DEVICE), scale=0.3,
                                                 backend="triton"),
        lambda q, x, basis: code_cross_attention_naive(q, x, basis, padding_mask=source_mask, scale=0.3),
        [q, x, basis], device=DEVICE, **FLOAT32)


def test_bfloat16_cross_attention_kernel_is_close_to_the_reference():
    """At D = r = 128 (the read's large tile), queries and a padded source in bfloat16."""
    q, _, _, basis, _, _ = _triton_inputs(9, 4, 128, 128, True, False, H=1)
    _, x, _, _, _, mask = _triton_inputs(20, 4, 128, 128, True, True, H=1, seed=1)
    assert_matches_reference(
        lambda q, x, basis: code_cross_attention(q, x, basis, padding_mask=_on(mask, DEVICE), backend="triton"),
        lambda q, x, basis: code_cross_attention_naive(q, x, basis, padding_mask=mask),
        [q, x, basis], device=DEVICE, dtype=torch.bfloat16, relative=3e-2)


@pytest.mark.parametrize("variant", [dict(write="decay", decay=torch.full((2,), 0.1)), dict(memory="vector"),
                                     dict(write="gated", gate="gate"), dict(read_scale=torch.ones(2))])
def test_the_memory_variants_are_refused_by_triton_and_run_on_torch_under_auto(variant):
    """The Triton path computes the paper's memory only: a variant or a read temperature is refused by name with
    ``backend="triton"``; ``"auto"`` gives the torch path's outputs."""
    q, k, v, basis = (x.detach().float().to(DEVICE) for x in _triton_inputs(13, 4, 32, 8, True, False)[:4])
    if variant.get("gate") == "gate":
        variant = dict(variant, gate=torch.randn(2, 8, 32))
    variant = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in variant.items()}
    with pytest.raises(ValueError, match=r"^backend='triton' computes the paper's memory only"):
        lavo_attention(q, k, v, basis, window=4, backend="triton", **variant)
    torch.testing.assert_close(lavo_attention(q, k, v, basis, window=4, backend="auto", **variant),
                               lavo_attention(q, k, v, basis, window=4, backend="torch", **variant), atol=0, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_a_padding_mask_laid_out_by_columns_gives_the_same_outputs(causal):
    """The kernels read the mask along T with a step of one: a mask with other strides (the transpose of a
    contiguous [T, B] tensor, say) is laid out again first, not read at the wrong places."""
    q, k, v, basis, pos_bias, mask = _triton_inputs(13, 4, 32, 8, causal, True)
    q, k, v, basis, pos_bias = (x.detach().float().to(DEVICE) for x in (q, k, v, basis, pos_bias))
    mask = mask.to(DEVICE)
    by_columns = mask.T.contiguous().T
    assert torch.equal(by_columns, mask) and by_columns.stride() == (1, mask.shape[0])
    options = dict(window=4, causal=causal, pos_bias=pos_bias, backend="triton")
    for op in (local_attention, lambda q, k, v, **o: lavo_attention(q, k, v, basis, **o)):
        torch.testing.assert_close(op(q, k, v, padding_mask=by_columns, **options),
                                   op(q, k, v, padding_mask=mask, **options), atol=0, rtol=0)


@pytest.mark.parametrize("padding", [False, True])
def test_without_dissection_bfloat16_queries_read_float32_running_means(padding):
    """DESIGN, decision 5, on the Triton path: without dissection each query reads the running mean of the
    tokens' coordinates on the basis, taken in float32 from the bfloat16 values, never rounded to bfloat16."""
    T, window = 37, 8
    q, _, v, basis, _, mask = _triton_inputs(T, window, 32, 16, True, padding)
    q, v = q.bfloat16(), v.bfloat16()
    sums, counts = window_sums(v, mask, window)
    window_proj = sums @ basis.float().transpose(-1, -2)
    coefficients, group = _coefficients(q, v, basis, window_proj, counts, mask, window, True, False)
    real = torch.ones(v.shape[:2], dtype=torch.float64) if mask is None else mask.double()
    coordinates = torch.einsum("bthd,hrd->bhtr", v.double() * real[..., None, None], basis.double())
    running_mean = coordinates.cumsum(2) / real.cumsum(1).clamp(min=1)[:, None, :, None]
    assert group == 1 and coefficients.dtype == torch.float32
    torch.testing.assert_close(coefficients.double(), running_mean, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_layers_give_the_same_outputs_grads_and_cache_on_both_backends(causal):
    x = torch.randn(2, 45, 64, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 45, dtype=torch.bool)
    mask[1, :6] = False
    for make in (lambda backend: LavoAttention(64, 2, rank=24, window=8, causal=causal, backend=backend),
                 lambda backend: LocalAttention(64, 2, window=8, causal=causal, backend=backend)):
        torch.manual_seed(0)
        reference = make("torch")
        torch.nn.init.normal_(reference.pos_bias, 0, 0.5)
        layer = make("triton").to(DEVICE)
        layer.load_state_dict(reference.state_dict())
        y, cache = layer(x.to(DEVICE), padding_mask=mask.to(DEVICE))
        expected, expected_cache = reference(x, padding_mask=mask)
        torch.testing.assert_close(y.cpu(), expected, **FLOAT32)
        y.sum().backward()
        expected.sum().backward()
        for name, parameter in reference.named_parameters():
            torch.testing.assert_close(dict(layer.named_parameters())[name].grad.cpu(), parameter.grad, **FLOAT32)
        assert (cache is None) == (expected_cache is None)
        if cache is not None:
            for name, value in vars(expected_cache).items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(getattr(cache, name).cpu(), value, **FLOAT32)


def test_cross_attention_layer_on_both_backends():
    torch.manual_seed(0)
    reference = LavoCrossAttention(64, 2, rank=16, backend="torch")
    layer = LavoCrossAttention(64, 2, rank=16, backend="triton").to(DEVICE)
    layer.load_state_dict(reference.state_dict())
    y, source = torch.randn(2, 7, 64), torch.randn(2, 19, 64)
    torch.testing.assert_close(layer(y.to(DEVICE), source.to(DEVICE)).cpu(), reference(y, source), **FLOAT32)


def test_kernel_launches_are_sound_custom_ops():
    """torch.library.opcheck: schema, fake (meta) shapes and strides against the real launch, and the autograd
    registration, for each of the kernels' custom ops."""
    from lavo.cache import LavoCache, LavoStepCache
    from lavo.ops.lavo.kernels import _read_backward, _read_forward
    from lavo.ops.lavo.step_kernel import _step_launch
    from lavo.ops.local.kernels import _window_backward, _window_forward

    torch.manual_seed(0)
    B, T, H, D, window, rank = 2, 21, 2, 32, 8, 12

    def tensor(*shape, grad=True):
        return torch.randn(*shape, device=DEVICE, requires_grad=grad)
    q, k, v = (tensor(B, T, H, D) for _ in range(3))
    pos_bias, keep = tensor(H, 2 * window), (torch.rand(B, T, device=DEVICE) > 0.2).to(torch.uint8)
    cases = []
    for bias, mask, causal, scale in ((pos_bias, keep, True, D ** -0.5), (None, None, False, 0.3)):
        out, lse = _window_forward(q, k, v, bias, mask, causal, window, scale)
        cases += [(_window_forward, (q, k, v, bias, mask, causal, window, scale)),
                  (_window_backward, (torch.randn_like(out), q, k, v, bias, mask, lse, causal, window, scale,
                                      bias is not None))]
    basis = tensor(H, rank, D)
    for group in (1, window, T):
        coefficients = tensor(B, H, -(-T // group), rank)
        cases += [(_read_forward, (q, coefficients, basis, 0.5, group)),
                  (_read_backward, (torch.randn_like(q), q, coefficients, basis, 0.5, group, group == window))]
    steps = LavoStepCache.from_cache(LavoCache.empty(B, H, D, rank, device=DEVICE, window=window), window)
    real = torch.tensor([True, False], device=DEVICE)
    cases.append((_step_launch, (q[:, :1], k[:, :1], v[:, :1], real, basis, pos_bias, None, *steps.tensors(), window,
                                 D ** -0.5, True)))  # the step updates the cache's tensors, which it declares
    for op, args in cases:  # the backward ops have no gradient of their own (no double backward)
        grad = op in (_window_forward, _read_forward)
        args = tuple(a.detach().requires_grad_(grad and a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                     for a in args)
        torch.library.opcheck(op, args)


def test_every_launch_spreads_its_programs_along_the_grids_first_axis(monkeypatch):
    """CUDA allows 2^31 - 1 programs along a grid's first axis and 65,535 along the others: batch x heads on the
    second axis failed to launch from 65,536 rows (e.g. 4,096 sequences of 16 heads). The interpreter has no such
    limit, so the launches' grids are checked: one axis each."""
    from lavo.ops.local import kernels
    kernel_class = type(kernels._forward)  # JITFunction, or the interpreter's InterpretedFunction
    grids = []
    launch = kernel_class.run

    def recording(self, *args, grid, **kwargs):
        grids.append((self.fn.__name__, grid))
        return launch(self, *args, grid=grid, **kwargs)

    monkeypatch.setattr(kernel_class, "run", recording)
    q, k, v, basis, pos_bias, mask = _triton_inputs(21, 8, 32, 12, True, True, B=3, H=2)
    inputs = [x.detach().to(DEVICE, torch.float32).requires_grad_() for x in (q, k, v, basis, pos_bias)]
    for causal in (True, False):  # dissection: window rows; without it, a row per token
        table = inputs[4] if causal else None
        lavo_attention(*inputs[:4], window=8, causal=causal, dissection=causal, pos_bias=table,
                       padding_mask=_on(mask, DEVICE), backend="triton").sum().backward()
    kernels = {name for name, _ in grids}
    assert kernels == {"_forward", "_backward_keys", "_backward_queries", "_backward"}
    assert all(len(grid) == 1 for _, grid in grids), grids


@pytest.mark.parametrize("layer_class", [LavoAttention, LocalAttention])
def test_compiled_layers_on_the_triton_path_match_eager(layer_class):
    """torch.compile keeps the kernels as opaque ops of one graph (fullgraph) with eager's outputs and gradients."""
    torch.manual_seed(0)
    options = dict(basis="learned") if layer_class is LavoAttention else {}
    layer = layer_class(64, 2, window=8, backend="triton", **options).to(DEVICE)
    with torch.no_grad():
        layer.pos_bias.normal_()
    x = torch.randn(2, 29, 64, device=DEVICE)
    mask = torch.ones(2, 29, dtype=torch.bool, device=DEVICE)
    mask[0, :4] = False
    assert_compiled_matches_eager(layer, x, lambda module, x: module(x, padding_mask=mask)[0],
                                  name=layer_class.__name__, **FLOAT32)


def test_backend_choice_and_its_errors(monkeypatch):
    cpu = torch.zeros(1, 4, 1, 8)
    assert not uses_triton("auto", cpu) and not uses_triton("torch", cpu)
    if torch.cuda.is_available():
        assert uses_triton("auto", cpu.cuda()) and not uses_triton("auto", cpu.cuda().double())
    if triton_interpreting():
        assert uses_triton("triton", cpu)
    with pytest.raises(ValueError, match=r"backend='triton' takes float16, bfloat16 or float32 inputs, got "
                                         r"torch.float64"):
        uses_triton("triton", cpu.to(DEVICE, torch.float64))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend='triton' runs on CUDA tensors, got a tensor on cpu; set "
                                         r"TRITON_INTERPRET=1"):
        lavo_attention(cpu, cpu, cpu, torch.eye(8)[None], window=4, backend="triton")


def test_an_older_gpu_keeps_auto_on_torch_and_is_named_when_triton_is_asked_for(monkeypatch):
    from types import SimpleNamespace

    from lavo.ops import common
    monkeypatch.setattr(common, "TRITON_AVAILABLE", True)
    cuda_like = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(1, 4, 1, 128))  # all the choice reads
    monkeypatch.setattr(common, "capability", lambda q: (8, 0))
    assert uses_triton("auto", cuda_like)
    monkeypatch.setattr(common, "capability", lambda q: (7, 5))
    assert not uses_triton("auto", cuda_like)
    with pytest.raises(ValueError, match=r"^backend='triton' needs a GPU of compute capability 8\.0 or later "
                                         r"\(NVIDIA Ampere\), this one has 7\.5; backend='torch' runs on it$"):
        uses_triton("triton", cuda_like)


def test_heads_wider_than_the_kernels_tiles_keep_auto_on_torch_and_are_refused_by_triton(monkeypatch):
    from types import SimpleNamespace

    from lavo.ops import common
    monkeypatch.setattr(common, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(common, "capability", lambda q: (9, 0))
    wide = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(1, 4, 1, 129), requires_grad=False)
    assert not uses_triton("auto", wide)
    with pytest.raises(ValueError, match=r"^backend='triton' takes heads of at most 128 features \(the kernels' "
                                         r"tiles\), got 129; backend='torch' \(or 'auto', which takes it then\) "
                                         r"runs any$"):
        uses_triton("triton", wide)


def test_a_gpu_with_less_shared_memory_than_an_a100_is_told_apart(monkeypatch):
    from types import SimpleNamespace

    from lavo.ops import common
    asked = []
    for reported, small in [(101376, True), (166912, False), (232448, False)]:
        monkeypatch.setattr(common, "_shared_memory_per_block", lambda index, n=reported: asked.append(index) or n)
        assert common.small_shared_memory(SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))) is small
    assert asked == [1, 1, 1]
    assert not common.small_shared_memory(torch.empty(0))


def test_a_named_gpu_is_made_current_and_plain_cuda_is_the_current_one(monkeypatch):
    from lavo.ops import common
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    for name in ("cuda", "cpu", "cuda:1"):
        common.make_current(name)
    assert made_current == [torch.device("cuda", 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dissection", [True, False])
def test_the_configurations_for_99_kb_of_shared_memory_match_naive(monkeypatch, dissection, dtype):
    """What a GPU with less shared memory than an A100 runs (tests/compile_kernels.py checks that it fits), at
    ``D = r = 128``: no pipelining, and a 16-bit read per token (without dissection) in blocks of 16 queries with
    float32 products."""
    import lavo.ops.lavo.kernels as read_kernels
    import lavo.ops.local.kernels as window_kernels
    configs = {}
    for module in (window_kernels, read_kernels):
        monkeypatch.setattr(module, "small_shared_memory", lambda q: True)
        monkeypatch.setattr(module, "_config", lambda *args, made=module._config, name=module.__name__:
                            configs.setdefault(name, made(*args)))
    q, k, v, basis, pos_bias, mask = _triton_inputs(40, 32, 128, 128, True, True)
    options = dict(window=32, causal=True, dissection=dissection)

    def fast(*x):
        return lavo_attention(*x[:4], pos_bias=x[4], padding_mask=_on(mask, DEVICE), backend="triton", **options)

    def naive(*x):
        return lavo_attention_naive(*x[:4], pos_bias=x[4], padding_mask=mask, **options)
    # bfloat16: within its rounding of the float64 reference, outputs and gradients
    tolerance = FLOAT32 if dtype == torch.float32 else dict(relative=3e-2)
    assert_matches_reference(fast, naive, [q, k, v, basis, pos_bias], device=DEVICE, dtype=dtype, **tolerance)
    assert configs[window_kernels.__name__]["num_stages"] == 1
    read = configs[read_kernels.__name__]
    assert read["num_stages"] == 1
    assert (read["BLOCK"], read["PRECISION"]) == ((16, "ieee") if not dissection and dtype != torch.float32 else
                                                  (32, "ieee" if dtype == torch.float32 else "tf32"))


def test_every_kernel_launches_on_its_inputs_gpu(monkeypatch):
    """Triton launches on CUDA's current device and stream, so a model on ``cuda:1`` must make that device
    current: every launch happens within ``launching_on`` of its input."""
    import contextlib
    from types import SimpleNamespace

    import lavo.ops.lavo.kernels as read_kernels
    import lavo.ops.lavo.step_kernel as step_kernel
    import lavo.ops.local.kernels as window_kernels
    from lavo.ops import common
    assert isinstance(common.launching_on(torch.empty(0)), contextlib.nullcontext)
    assert common.launching_on(SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))).idx == 1
    inside, launches = [], []
    for module in (window_kernels, read_kernels, step_kernel):
        monkeypatch.setattr(module, "launching_on", recording_launching_on(inside))
    kernel_type = type(window_kernels._forward)  # JITFunction, or the interpreter's stand-in
    run = kernel_type.run
    monkeypatch.setattr(kernel_type, "run", lambda self, *args, **kwargs: (
        launches.append((self.fn.__name__, list(inside))), run(self, *args, **kwargs))[1])
    layer = LavoAttention(32, 2, window=4, backend="triton").to(DEVICE)
    x = torch.randn(1, 9, 32, device=DEVICE)
    y, cache = layer(x)
    y.sum().backward()
    with torch.no_grad():
        layer(x[:, :1], cache=layer.step_cache(cache))
    assert {name for name, _ in launches} == {"_forward", "_backward_keys", "_backward_queries", "_backward",
                                              "_step"}
    assert all(devices == [x.device] for _, devices in launches)


def test_an_interpreter_that_cannot_run_with_this_numpy_is_named():
    for triton_version, numpy_version in [("3.6.0", "2.3.5"), ("3.7.0", "2.4.6"), ("3.9.0", "2.4.0"),
                                          ("3.5.1", "1.26.4")]:
        check_interpreter_numpy(triton_version, numpy_version)
    for triton_version, numpy_version in [("3.6.0", "2.4.0"), ("3.3.1+git1a2b", "2.5.1")]:
        with pytest.raises(ValueError, match=rf"^Triton {re.escape(triton_version)}'s CPU interpreter does not run "
                                             rf"with numpy {numpy_version}; install numpy<2.4 or triton>=3.7$"):
            check_interpreter_numpy(triton_version, numpy_version)


@pytest.mark.slow
@pytest.mark.parametrize("dissection", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_lavo_kernels_match_naive_over_many_windows(causal, dissection):
    q, k, v, basis, pos_bias, mask = _triton_inputs(300, 64, 64, 64, causal, True, B=2, H=1)
    options = dict(window=64, causal=causal, dissection=dissection)
    assert_matches_reference(
        lambda *x: lavo_attention(*x[:4], pos_bias=x[4], padding_mask=_on(mask, DEVICE), backend="triton", **options),
        lambda *x: lavo_attention_naive(*x[:4], pos_bias=x[4], padding_mask=mask, **options),
        [q, k, v, basis, pos_bias], device=DEVICE, **FLOAT32)


@pytest.mark.parametrize("dissection", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_the_int64_offsets_form_matches_naive(monkeypatch, causal, dissection):
    """The kernels' form for tensors past 2^31 elements (a million tokens at width 2048), forced at a small size."""
    import lavo.ops.local.kernels as window_kernels
    monkeypatch.setattr(window_kernels, "INT32_OFFSETS", 0)
    q, k, v, basis, pos_bias, mask = _triton_inputs(40, 8, 32, 12, causal, True)
    assert window_kernels.wide_offsets(q)
    options = dict(window=8, causal=causal, dissection=dissection)
    assert_matches_reference(
        lambda *x: lavo_attention(*x[:4], pos_bias=x[4], padding_mask=_on(mask, DEVICE), backend="triton", **options),
        lambda *x: lavo_attention_naive(*x[:4], pos_bias=x[4], padding_mask=mask, **options),
        [q, k, v, basis, pos_bias], device=DEVICE, **FLOAT32)


def test_deterministic_algorithms_keep_auto_on_torch_and_triton_says_why(monkeypatch):
    """The kernels' backward adds the position-bias and basis gradients with atomic adds, in no set order."""
    from types import SimpleNamespace

    from lavo.ops import common
    monkeypatch.setattr(common, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(common, "capability", lambda q: (9, 0))
    cuda_like = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(1, 4, 1, 8), requires_grad=True)
    message = (r"^backend='triton' adds the position-bias and basis gradients with atomic adds, whose order is not "
               r"deterministic, and torch\.use_deterministic_algorithms\(True\) is set: backend='torch' \(or 'auto', "
               r"which takes it then\) is deterministic$")
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert not uses_triton("auto", cuda_like)
        with pytest.raises(RuntimeError, match=message):
            uses_triton("triton", cuda_like)
        with torch.no_grad():  # the forward kernels are deterministic
            assert uses_triton("auto", cuda_like) and uses_triton("triton", cuda_like)
        # a tensor with no backward: its forward kernels are deterministic too
        frozen = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(1, 4, 1, 8), requires_grad=False)
        assert uses_triton("auto", frozen) and uses_triton("triton", frozen)
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match=message):
            assert uses_triton("triton", cuda_like)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    assert uses_triton("auto", cuda_like)
