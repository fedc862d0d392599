"""Comparing a fast form with its reference, outputs and gradients, as every op test here does."""
import torch


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


def assert_matches_reference(fast, naive, inputs, *, device, dtype=torch.float32, **tolerance):
    """``fast(*inputs)`` on ``device`` in ``dtype`` against ``naive(*inputs)`` in float64 on the CPU, on outputs
    and on the gradients of every input (``inputs``: CPU tensors); ``tolerance`` as in ``assert_close``."""
    fast_inputs = [x.detach().to(device, dtype).requires_grad_() for x in inputs]
    naive_inputs = [x.detach().double().requires_grad_() for x in inputs]
    out, reference = fast(*fast_inputs), naive(*naive_inputs)
    torch.testing.assert_close(out.detach().double().cpu(), reference.detach(), **tolerance)
    weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad((out * weights.to(device, out.dtype)).sum(), fast_inputs, materialize_grads=True)
    references = torch.autograd.grad((reference * weights).sum(), naive_inputs, materialize_grads=True)
    for grad, expected in zip(grads, references):
        torch.testing.assert_close(grad.double().cpu(), expected, **tolerance)
