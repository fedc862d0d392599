"""Cross attention of every mechanism: the fast ops against their references on outputs and gradients, and the
layers' padding and permutation properties, checked again after training steps (trained weights, not only
initial ones)."""
import re

import pytest
import torch

from lavo.ops import code_cross_attention, code_cross_attention_naive, orthogonal_basis
from lavo.ops.abc import abc_cross_attention, abc_cross_attention_naive
from lavo.ops.cosformer import (cosformer_attention, cosformer_attention_naive, cosformer_cross_attention,
                                cosformer_cross_attention_naive)
from lavo.ops.performer import orthogonal_random_features, performer_attention, performer_attention_naive
from lavo.ops.softmax import softmax_attention
from lavo.registry import CROSS_ATTENTIONS, build_cross_attention
from reference_checks import assert_same_outputs_and_grads

# the mechanisms without source positions: their output is a function of the set of source tokens
PERMUTATION_INVARIANT = {"softmax", "lavo", "abc", "performer"}
OPTIONS = {"abc": {"slots": 5}, "performer": {"features": 16}, "lavo": {"rank": 3}}


def explicit_softmax(q, k, v, padding_mask):
    scores = torch.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
    if padding_mask is not None:
        scores = scores.masked_fill(~padding_mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.nan_to_num(scores.softmax(-1)), v)


def _inputs(T, S, H=3, D=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, T, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, S, H, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.ones(2, S, dtype=torch.bool)
    mask[0, : S // 3] = False  # a gap at the start of one source, and at its end in the other
    mask[1, S - S // 2:] = False
    return q, k, v, mask


def _control(H=3, r=4, D=5):
    return torch.randn(H, r, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                       requires_grad=True)


# each case: (fast, reference) as functions of (q, k, v, mask, parameter) and the parameter's factory
OPS = {
    "softmax": (lambda q, k, v, m, p: softmax_attention(q, k, v, causal=False, key_mask=m),
                lambda q, k, v, m, p: explicit_softmax(q, k, v, m), lambda: None),
    "abc": (lambda q, k, v, m, p: abc_cross_attention(q, k, v, p, padding_mask=m),
            lambda q, k, v, m, p: abc_cross_attention_naive(q, k, v, p, padding_mask=m), _control),
    "performer": (lambda q, k, v, m, p: performer_attention(q, k, v, p, padding_mask=m),
                  lambda q, k, v, m, p: performer_attention_naive(q, k, v, p, causal=False, padding_mask=m),
                  lambda: orthogonal_random_features(7, 5, torch.Generator().manual_seed(1)).double()),
    "cosformer": (lambda q, k, v, m, p: cosformer_cross_attention(q, k, v, padding_mask=m),
                  lambda q, k, v, m, p: cosformer_cross_attention_naive(q, k, v, padding_mask=m), lambda: None),
    "lavo": (lambda q, k, v, m, p: code_cross_attention(q, k, p, padding_mask=m),
             lambda q, k, v, m, p: code_cross_attention_naive(q, k, p, padding_mask=m),
             lambda: orthogonal_basis(3, 4, 5).double()),
}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("T, S", [(7, 11), (1, 5), (9, 1), (4, 4)])
@pytest.mark.parametrize("padded", [False, True])
def test_cross_op_matches_reference(name, T, S, padded):
    fast, reference, parameter = OPS[name]
    q, k, v, mask = _inputs(T, S)
    mask = mask if padded and S > 2 else None
    p = parameter()
    inputs = [q, k, v] + ([p] if p is not None and p.requires_grad else [])
    assert_same_outputs_and_grads(fast(q, k, v, mask, p), reference(q, k, v, mask, p), inputs)


@pytest.mark.parametrize("T, S", [(7, 11), (3, 1), (1, 4)])
def test_cosformer_cross_op_with_padded_queries_matches_reference(T, S):
    q, k, v, mask = _inputs(T, S)
    queries = torch.ones(2, T, dtype=torch.bool)
    queries[0, : T // 2] = False  # left padding in one row, right padding in the other
    queries[1, T - T // 3:] = False
    assert_same_outputs_and_grads(
        cosformer_cross_attention(q, k, v, padding_mask=mask, query_padding_mask=queries),
        cosformer_cross_attention_naive(q, k, v, padding_mask=mask, query_padding_mask=queries), [q, k, v])


def test_cosformer_cross_with_equal_lengths_is_the_self_attention_form():
    q, k, v, _ = _inputs(6, 6)
    torch.testing.assert_close(cosformer_cross_attention(q, k, v), cosformer_attention(q, k, v))
    torch.testing.assert_close(cosformer_cross_attention(q, k, v),
                               cosformer_attention_naive(q, k, v, causal=False))


def _trained(name, steps=3, dim=24, heads=3):
    """A layer after ``steps`` Adam steps on a random regression (its weights moved from the initial ones)."""
    torch.manual_seed(0)
    layer = build_cross_attention(name, dim, heads, **OPTIONS.get(name, {})).double()
    optimiser = torch.optim.Adam(layer.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    y, source, target = (torch.randn(2, n, dim, generator=g, dtype=torch.float64) for n in (5, 9, 5))
    before = [p.detach().clone() for p in layer.parameters()]
    for _ in range(steps):
        loss = (layer(y, source) - target).square().mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    return layer


def _queries_and_source(g):
    """``y [2, 6, 24]`` and ``source [2, 8, 24]``, float64."""
    return (torch.randn(2, n, 24, generator=g, dtype=torch.float64) for n in (6, 8))


@pytest.mark.parametrize("name", sorted(CROSS_ATTENTIONS))
def test_padded_source_positions_change_nothing(name):
    layer = _trained(name)
    g = torch.Generator().manual_seed(4)
    y, source = _queries_and_source(g)
    expected = layer(y, source)
    # padding with arbitrary content before, between and after the real tokens
    padded = torch.randn(2, 13, 24, generator=g, dtype=torch.float64) * 100
    mask = torch.zeros(2, 13, dtype=torch.bool)
    real = torch.tensor([1, 2, 4, 5, 7, 9, 10, 11])
    padded[:, real], mask[:, real] = source, True
    torch.testing.assert_close(layer(y, padded, mask), expected)
    padded[:, 0] = torch.nan  # a missing value beside its mask
    torch.testing.assert_close(layer(y, padded, mask), expected)


@pytest.mark.parametrize("name", sorted(CROSS_ATTENTIONS))
def test_padded_queries_change_nothing_and_read_zeros(name):
    """cosFormer places a query by its fraction of the queries, which once counted the padded ones."""
    layer = _trained(name)
    g = torch.Generator().manual_seed(6)
    y, source = _queries_and_source(g)
    y.requires_grad_(True)
    expected = layer(y, source)
    padded = torch.randn(2, 10, 24, generator=g, dtype=torch.float64) * 100
    mask = torch.zeros(2, 10, dtype=torch.bool)
    real = torch.tensor([2, 3, 5, 6, 7, 9])
    padded[:, real], mask[:, real] = y.detach(), True
    padded[:, 0] = torch.nan  # a missing value beside its mask
    padded.requires_grad_(True)
    out = layer(padded, source, query_padding_mask=mask)
    torch.testing.assert_close(out[:, real], expected)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    weights = torch.randn(2, 6, 24, generator=g, dtype=torch.float64)
    out[:, real].mul(weights).sum().backward()
    expected.mul(weights).sum().backward()
    torch.testing.assert_close(padded.grad[:, real], y.grad)
    assert torch.equal(padded.grad[~mask], torch.zeros_like(padded.grad[~mask]))


@pytest.mark.parametrize("name", sorted(CROSS_ATTENTIONS))
def test_permuting_the_source(name):
    layer = _trained(name)
    g = torch.Generator().manual_seed(5)
    y, source = _queries_and_source(g)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 6:] = False
    order = torch.randperm(8, generator=g)
    same = torch.allclose(layer(y, source, mask), layer(y, source[:, order], mask[:, order]))
    assert same == (name in PERMUTATION_INVARIANT)


@pytest.mark.parametrize("name", sorted(CROSS_ATTENTIONS))
def test_cross_layers_share_the_call(name):
    layer = build_cross_attention(name, 16, 2)
    assert layer(torch.randn(3, 4, 16), torch.randn(3, 7, 16), torch.ones(3, 7, dtype=torch.bool)).shape == (3, 4, 16)
    with pytest.raises(ValueError, match=r"source must have shape \[B, S, 16\], got \(3, 7, 8\)"):
        layer(torch.randn(3, 4, 16), torch.randn(3, 7, 8))
    with pytest.raises(ValueError, match=re.escape("source_padding_mask must have shape [B, S] = (3, 7), got (3, 4)")):
        layer(torch.randn(3, 4, 16), torch.randn(3, 7, 16), torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=re.escape("query_padding_mask must have shape [B, T] = (3, 4), got (3, 7)")):
        layer(torch.randn(3, 4, 16), torch.randn(3, 7, 16), query_padding_mask=torch.ones(3, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="y and source must have the same batch size, got 3 and 2"):
        layer(torch.randn(3, 4, 16), torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match=r"^y has an empty time axis, shape \(3, 0, 16\); a call needs at least one "
                                         r"query$"):
        layer(torch.randn(3, 0, 16), torch.randn(3, 7, 16))
    # an empty source is an empty memory, read as zeros (ABC refused it, naming its op's k); an empty batch is
    # refused as self-attention refuses it (LAVO refused it, naming its op's q, and the others passed it)
    assert torch.equal(layer(torch.randn(3, 4, 16), torch.randn(3, 0, 16)), torch.zeros(3, 4, 16))
    with pytest.raises(ValueError, match=r"^y has an empty batch, shape \(0, 4, 16\); a call needs at least one "
                                         r"sequence$"):
        layer(torch.randn(0, 4, 16), torch.randn(0, 7, 16))
    for y, source, name in ((torch.randn(3, 4, 16).double(), torch.randn(3, 7, 16), "y"),
                            (torch.randn(3, 4, 16), torch.randn(3, 7, 16).half(), "source")):
        other = y if name == "y" else source
        with pytest.raises(ValueError, match=re.escape(
                f"{name} has dtype {other.dtype} and the layer's weights torch.float32: convert one "
                f"({name}.to(torch.float32) or layer.to({other.dtype})), or call the layer under torch.autocast")):
            layer(y, source)


@pytest.mark.parametrize("name", sorted(CROSS_ATTENTIONS))
def test_an_all_padding_source_reads_zeros(name):
    torch.manual_seed(0)
    layer = build_cross_attention(name, 16, 2).double()
    y, source = (torch.randn(2, n, 16, dtype=torch.float64, requires_grad=True) for n in (32, 5))
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 2:] = True  # the second row has a source: the backward is not trivially zero
    out = layer(y, source, mask)
    torch.testing.assert_close(out[0], torch.zeros_like(out[0]))
    out.mul(torch.randn_like(out)).sum().backward()
    # nothing flows from an empty source (Performer's gradient was once inf and NaN there)
    for grad in (y.grad[0], source.grad[0], *(p.grad for p in layer.parameters() if p.grad is not None)):
        assert torch.isfinite(grad).all()
    assert torch.all(y.grad[0] == 0) and torch.all(source.grad[0] == 0)


@pytest.mark.parametrize("name,options,message", [
    ("lavo", dict(windw=8), "cross attention 'lavo' has no option 'windw'; its options: rank, basis, backend"),
    ("softmax", dict(causal=True), "cross attention 'softmax' has no option 'causal'; its options: none"),
])
def test_cross_attention_options_are_checked_like_self_attention_options(name, options, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_cross_attention(name, 32, 4, **options)
