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
