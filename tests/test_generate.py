"""Sampling: seeded, cached decoding equals recomputing, top-k / top-p filtering."""
import numpy as np
import pytest
import torch
from reference_checks import forward_calls

from lavo.generate import filter_logits, generate, sample_next
from lavo.model import build_model


def model():
    torch.manual_seed(0)
    return build_model(dict(vocab_size=61, dim=32, depth=2, heads=2, attention="lavo",
                            attention_options={"window": 4})).eval()


class NoCache(torch.nn.Module):
    """The same model without a decoding form: generation must recompute the whole sequence."""

    supports_decoding = False

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids, padding_mask=None, cache=None):
        assert cache is None
        logits, _ = self.inner(ids)
        return logits, None


def test_same_seed_same_text_and_other_seed_differs():
    m = model()
    a = generate(m, [1, 2, 3], 30, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    b = generate(m, [1, 2, 3], 30, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    c = generate(m, [1, 2, 3], 30, temperature=1.0, top_k=20, top_p=0.9, seed=8)
    assert a == b and len(a[0]) == 30
    assert a != c


def test_cached_generation_equals_recomputation():
    m = model()
    cached = generate(m, [5, 6, 7, 8, 9], 25, temperature=0.9, seed=3, num_samples=2)
    recomputed = generate(NoCache(m), [5, 6, 7, 8, 9], 25, temperature=0.9, seed=3, num_samples=2)
    assert cached == recomputed


def test_greedy_and_top_k_one_agree():
    m = model()
    assert generate(m, [1], 12, temperature=0) == generate(m, [1], 12, temperature=1.0, top_k=1, seed=5)


def test_a_vanishing_temperature_samples_the_most_likely_token():
    """At 1e-45 the logits over the temperature reach +inf unless they are shifted below 0 first."""
    m = model()
    assert generate(m, [1], 12, temperature=1e-45, top_k=0, top_p=None) == generate(m, [1], 12, temperature=0)


def test_stop_token_ends_a_sample():
    m = model()
    free = generate(m, [1], 20, temperature=0)[0]
    stopped = generate(m, [1], 20, temperature=0, stop_id=free[3])[0]
    assert stopped == free[:free.index(free[3]) + 1]


def test_stop_token_ends_each_sample_where_it_draws_it():
    """Every sample of a batch stops at its own first stop token; the others go on drawing as they would."""
    m = model()
    free = generate(m, [1], 20, temperature=1.0, seed=3, num_samples=3)
    stop = free[1][2]
    stopped = generate(m, [1], 20, temperature=1.0, seed=3, num_samples=3, stop_id=stop)
    assert stopped == [row[:row.index(stop) + 1] if stop in row else row for row in free]
    assert [len(row) for row in stopped] == [20, 3, 20]  # this seed: only the second sample draws it


def test_each_token_is_reported_as_it_is_sampled():
    """on_token(sample, token) comes for every token of every sample, in order, before the next forward call."""
    m = model()
    stop = generate(m, [1], 20, seed=3, num_samples=3)[1][2]
    calls, reported = forward_calls([m]), []
    samples = generate(m, [1], 20, seed=3, num_samples=3, stop_id=stop,
                       on_token=lambda i, token: reported.append((i, token, calls[0])))
    for i, row in enumerate(samples):
        assert [(token, forwards) for j, token, forwards in reported if j == i] == [
            (token, 1 + k) for k, token in enumerate(row)]  # the prompt's pass, then one step per token before
    assert [len(row) for row in samples] == [20, 3, 20]


def test_filter_logits():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.5)).tolist() == [[False, True, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.81)).tolist() == [[False, False, False, True]]


def test_top_p_keeps_the_nucleus_of_the_tempered_distribution():
    """Temperature first, then top-k and top-p (docs/DESIGN.md): at temperature 0.5 the probabilities 0.5, 0.3,
    0.15, 0.05 become 0.68, 0.25, 0.06, 0.01 (squared, renormalised), whose nucleus of 0.9 is the first two; the
    untempered nucleus would keep the third."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, -1)
    drawn = sample_next(logits, torch.Generator().manual_seed(0), temperature=0.5, top_p=0.9)
    assert set(drawn.tolist()) == {0, 1}


def test_the_prompt_is_fed_once_and_each_new_token_but_the_last():
    """Nothing reads the logits after the last token, so it is not fed (with a cache or recomputing)."""
    for m in (model(), NoCache(model())):
        calls = forward_calls([m])
        assert len(generate(m, [1, 2, 3], 5, temperature=0)[0]) == 5
        assert calls == [1 + 4]


def test_the_prompt_is_read_once_for_all_samples_which_then_continue_as_separate_rows():
    """Each of num_samples rows read the whole prompt again: four samples of a long prompt cost four prefills."""
    for m, continued in ((model(), [(3, 1)] * 3), (NoCache(model()), [(3, 4), (3, 5), (3, 6)])):
        shapes = []  # of the ids of each forward call
        m.register_forward_hook(lambda _, args, output: shapes.append(tuple(args[0].shape)))
        samples = generate(m, [1, 2, 3], 4, temperature=1.0, seed=3, num_samples=3)
        assert shapes == [(1, 3), *continued]
        assert len({tuple(row) for row in samples}) > 1  # the rows sample on their own


def test_the_model_is_left_in_the_mode_it_was_in_and_a_tensor_prompt_is_a_list():
    m = model().train()
    with_list = generate(m, [1, 2, 3], 6, temperature=0)
    assert m.training
    assert generate(m.eval(), torch.tensor([1, 2, 3]), 6, temperature=0) == with_list and not m.training
    prepared = np.array([1, 2, 3], dtype=np.uint16)  # ids as a prepared split holds them
    assert generate(m, list(prepared), 6, temperature=0) == with_list


def test_prompts_the_model_cannot_read_are_refused_by_name():
    m = model()
    with pytest.raises(ValueError, match=r"the prompt holds token ids outside the model's vocabulary of 61: "
                                         r"\[-1, 61\]"):
        generate(m, [3, 61, -1], 5)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(m, torch.tensor([], dtype=torch.long), 5)
    # was: `the prompt must be a flat list (or 1-D tensor) of token ids`, with no word of the shape given
    with pytest.raises(ValueError, match=r"^the prompt must be a flat list \(or 1-D tensor\) of token ids, got a "
                                         r"tensor of shape \(1, 3\): give one prompt, e.g. prompt\[0\] \(num_samples "
                                         r"samples it several times\)$"):
        generate(m, torch.tensor([[3, 4, 5]]), 5)
    with pytest.raises(ValueError, match=r"^the prompt must be a flat list \(or 1-D tensor\) of token ids$"):
        generate(m, [[3, 4, 5]], 5)


def test_a_model_that_reads_a_bounded_number_of_positions_is_told_how_many_tokens_fit():
    """cosFormer's causal form reads at most max_length positions: refused before anything is generated, where
    it used to fail at that position and lose the tokens sampled so far."""
    torch.manual_seed(0)
    m = build_model(dict(vocab_size=61, dim=32, depth=2, heads=2, attention="cosformer",
                         attention_options={"max_length": 12}))
    assert len(generate(m, [1, 2, 3], 10, temperature=0)[0]) == 10  # positions 0 .. 11: the last fits
    with pytest.raises(ValueError, match=r"this model reads at most 12 positions \(its CosformerAttention with "
                                         r"max_positions=12\): after a 3-token prompt it can generate at most 10 "
                                         r"tokens, not 11"):
        generate(m, [1, 2, 3], 11)
    # was: "it can generate at most 0 tokens, not 1", when no number of new tokens (at least 1) could fit
    with pytest.raises(ValueError, match=r"^this model reads at most 12 positions \(its CosformerAttention with "
                                         r"max_positions=12\): a 13-token prompt is longer than that, so nothing "
                                         r"can follow it; give at most 12 tokens of prompt$"):
        generate(m, list(range(13)), 1)


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_model_whose_logits_are_not_finite_is_refused_by_name(temperature):
    """A run that diverged in training, its weights nan (was: greedy printed token 0 again and again; sampling
    raised `probability tensor contains either inf, nan or element < 0`)."""
    m = model()
    with torch.no_grad():
        m.embed.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"^the model's logits are not finite \(nan or inf\): its weights may have "
                                         r"diverged in training, or overflowed in a lower precision$"):
        generate(m, [1, 2], 3, temperature=temperature)
