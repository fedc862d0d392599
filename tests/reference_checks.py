"""The random inputs of the op tests, registered layers with no zero weights, comparing a fast form with its
reference on outputs and gradients, the mark of tests that need the Triton kernels, and recorders of launches,
checkpoints and forward calls."""
import contextlib

import pytest
import torch

from lavo import build_attention
from lavo.ops import orthogonal_basis
from lavo.registry import attention_class
from lavo.ops.common import TRITON_AVAILABLE

# Tests that launch, patch or collect the Triton kernels: they need a Triton the kernels build with.
needs_triton = pytest.mark.skipif(not TRITON_AVAILABLE, reason="needs triton 3.3 or later")


def assert_same_outputs_and_grads(fast, naive, inputs, mask=None, **tolerance):
    """``fast`` and ``naive`` are outputs ``[B, T, ...]`` of two forms of one function of ``inputs``; ``mask``
    ``[B, T]`` restricts the comparison to real positions (outputs at padded queries are unspecified).
    ``tolerance`` goes to ``torch.testing.assert_close``. An input one form never uses has a zero gradient."""
    if mask is not None:
        fast, naive = (x * mask.reshape(*mask.shape, *[1] * (x.dim() - 2)) for x in (fast, naive))
    torch.testing.assert_close(fast, naive, **tolerance)
    weights = torch.randn(fast.shape, generator=torch.Generator().manual_seed(2), dtype=fast.dtype)
    # retain_graph: both forms may share a prefix of the graph (e.g. parameters transformed once for both).
    grads_fast = torch.autograd.grad((fast * weights).sum(), inputs, retain_graph=True, materialize_grads=True)
    grads_naive = torch.autograd.grad((naive * weights).sum(), inputs, retain_graph=True, materialize_grads=True)
    for a, b in zip(grads_fast, grads_naive):
        torch.testing.assert_close(a, b, **tolerance)


def assert_matches_reference(fast, naive, inputs, *, device, dtype=torch.float32, relative: float | None = None,
                             **tolerance):
    """``fast(*inputs)`` on ``device`` in ``dtype`` against ``naive(*inputs)`` in float64 on the CPU, on outputs
    and on the gradients of every input (``inputs``: CPU tensors); ``tolerance`` as in ``assert_close``, or
    ``relative``: a bound on each difference's norm over the reference's (for 16-bit ``dtype``)."""
    fast_inputs = [x.detach().to(device, dtype).requires_grad_() for x in inputs]
    naive_inputs = [x.detach().double().requires_grad_() for x in inputs]
    out, reference = fast(*fast_inputs), naive(*naive_inputs)

    def check(got, wanted):
        got = got.detach().double().cpu()
        if relative is None:
            torch.testing.assert_close(got, wanted, **tolerance)
        else:
            assert ((got - wanted).norm() / wanted.norm()).item() < relative
    check(out, reference.detach())
    weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad((out * weights.to(device, out.dtype)).sum(), fast_inputs, materialize_grads=True)
    references = torch.autograd.grad((reference * weights).sum(), naive_inputs, materialize_grads=True)
    for grad, expected in zip(grads, references):
        check(grad, expected)


def assert_compiled_matches_eager(module, x, call, *, name, backend="inductor", **tolerance):
    """``call(torch.compile(module, fullgraph=True, backend=backend), x)`` against ``call(module, x)``: the output
    and the gradients of ``x`` and of every parameter (of a fixed weighting of the output). ``fullgraph``: a graph
    break raises."""
    def output_and_grads(runner):
        inputs = x.clone().requires_grad_()
        y = call(runner, inputs)
        weights = torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)
        return [y.detach(), *torch.autograd.grad((y * weights).sum(), [inputs, *module.parameters()])]
    torch._dynamo.reset()
    compiled = output_and_grads(torch.compile(module, fullgraph=True, backend=backend))
    names = ["output", "x"] + [n for n, _ in module.named_parameters()]
    for got, want, what in zip(compiled, output_and_grads(module), names):
        torch.testing.assert_close(got, want, **tolerance, msg=lambda m: f"{name} {what}: {m}")


def zeros_and_garbage_at_padding(mask, q, k, v):
    """Two copies of ``q, k, v [B, T, H, D]`` (detached): with zeros at the positions ``mask [B, T]`` pads, and
    with inf, NaN and -inf there."""
    keep = mask[:, :, None, None]
    zeros = [torch.where(keep, t, 0).detach() for t in (q, k, v)]
    garbage = [torch.where(keep, t, bad).detach()
               for t, bad in zip((q, k, v), (float("inf"), float("nan"), -float("inf")))]
    return zeros, garbage


def assert_padding_reaches_no_output(op, q, k, v, mask, *, queries_masked=True):
    """``op(q, k, v)`` with inf, NaN and -inf at the positions ``mask [B, T]`` pads (in ``q`` only when
    ``queries_masked``: ops whose mask is over the keys take every query as real) gives the outputs and gradients
    of the same inputs with zeros there, bit for bit, and no gradient at padded positions."""
    zeros, garbage = ([t.requires_grad_() for t in copies] for copies in zeros_and_garbage_at_padding(mask, q, k, v))
    if not queries_masked:
        zeros[0] = garbage[0] = q
    results = []
    for inputs in (zeros, garbage):
        out = op(*inputs)
        results.append((out, torch.autograd.grad(out.square().sum(), inputs, allow_unused=True)))
    (clean, clean_grads), (out, grads) = results
    assert torch.isfinite(clean).all() and torch.equal(clean, out)
    for clean_grad, grad in zip(clean_grads, grads):
        assert (clean_grad is None) == (grad is None)
        assert grad is None or torch.equal(clean_grad, grad)
    for grad in grads[0 if queries_masked else 1:]:
        assert grad is None or not grad[~mask].any()


def random_inputs(T, window, D, rank, causal, bias, padding, B=2, H=3, seed=0):
    """float64 ``q, k, v [B, T, H, D]`` (requiring grad), an orthonormal basis ``[H, rank, D]``, a position-bias
    table (or None) and a padding mask with gaps at the left end, in the middle and at the right end (or None)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    basis = orthogonal_basis(H, rank, D, generator=g, dtype=torch.float64).requires_grad_()
    pos_bias = None
    if bias:
        pos_bias = torch.randn(H, 2 * window if causal else 4 * window - 1, generator=g, dtype=torch.float64,
                               requires_grad=True)
    mask = None
    if padding:
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[0, : T // 4] = False  # left end
        mask[0, T // 2: T // 2 + 3] = False  # middle
        mask[1, T - T // 5:] = False  # right end
        mask[1, 0] = T == 1 or bool(mask[1, 0])  # keep at least one real token in T = 1
    return q, k, v, basis, pos_bias, mask


def without_zero_weights(layer):
    """``layer`` with its all-zero parameters drawn at random: zeros (initial biases) would hide a leak or a wrong
    gradient through them."""
    with torch.no_grad():
        for p in layer.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.5)
    return layer


def registered_layer(name, dim, heads, *, causal, window):
    """The registered attention ``name`` (seed 0, ``window`` where it takes one) without zero weights; a test of a
    mechanism that has no such form (``"... has no ..."``) is skipped."""
    torch.manual_seed(0)
    options = {"window": window} if "window" in attention_class(name).option_names() else {}
    try:
        layer = build_attention(name, dim, heads, causal=causal, **options)
    except ValueError as error:
        if "has no" in str(error):
            pytest.skip(str(error))
        raise
    return without_zero_weights(layer)


def recording_launching_on(devices: list):
    """A stand-in for :func:`lavo.ops.common.launching_on`: while it is entered, ``devices`` ends with the device
    of the tensor it was given."""
    @contextlib.contextmanager
    def launching_on(x):
        devices.append(x.device)
        try:
            yield
        finally:
            devices.pop()
    return launching_on


def count_checkpoints(monkeypatch) -> list:
    """A list that grows by one at each call of the model's default checkpoint function (made from now on); under
    torch.compile, by the first traced call only: Dynamo guards on the length of a list it sees grow, so a list
    that grew at every step recompiled the model at every step."""
    import lavo.model
    calls = []

    def counting(*args, **kwargs):
        if not (calls and torch.compiler.is_compiling()):
            calls.append(1)
        return torch.utils.checkpoint.checkpoint(*args, **kwargs)
    monkeypatch.setattr(lavo.model, "checkpoint", counting)
    return calls


def forward_calls(modules) -> list[int]:
    """How many times each of ``modules`` has run forward, kept up to date by hooks."""
    counts = [0] * len(modules)
    for i, module in enumerate(modules):
        module.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts
