"""Activation checkpointing: a checkpointed block is run again in backward, and the gradients are exactly those of
the model that keeps its activations, dropout included; calls without gradients or with a cache are not
checkpointed."""
import copy

import pytest
import torch
from reference_checks import count_checkpoints, forward_calls

from lavo import available_attentions
from lavo.model import build_model
from lavo.registry import attention_class

VOCAB, T = 53, 37
WINDOW = 8  # T spans five windows


def model_with(name, depth=3, dropout=0.1):
    torch.manual_seed(0)
    options = {"window": WINDOW} if "window" in attention_class(name).option_names() else {}
    return build_model(dict(vocab_size=VOCAB, dim=32, depth=depth, heads=2, attention=name,
                            attention_options=options, dropout=dropout))


def attention_calls(model) -> list[int]:
    return forward_calls([block.attention for block in model.blocks])


def gradients(model, ids, seed=1):
    torch.manual_seed(seed)  # the same dropout masks for both models
    model.zero_grad()
    model(ids)[0].square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", available_attentions())
def test_checkpointed_blocks_run_again_and_give_the_same_gradients(name):
    kept = model_with(name)
    checkpointed = copy.deepcopy(kept)
    checkpointed.set_activation_checkpointing(every=2)
    calls = attention_calls(checkpointed)
    ids = torch.randint(VOCAB, (2, T))
    expected = gradients(kept, ids)
    for got, want in zip(gradients(checkpointed, ids), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert calls == [2, 1, 2]  # blocks 0 and 2 recomputed in backward, block 1 kept its activations


def test_turning_it_off_keeps_the_activations_again():
    model = model_with("lavo")
    model.set_activation_checkpointing()
    model.set_activation_checkpointing(False)
    calls = attention_calls(model)
    gradients(model, torch.randint(VOCAB, (2, T)))
    assert calls == [1, 1, 1]


def test_calls_without_gradients_or_with_a_cache_are_not_checkpointed(monkeypatch):
    checkpoints = count_checkpoints(monkeypatch)
    model = model_with("lavo", dropout=0.0)
    reference = copy.deepcopy(model)
    model.set_activation_checkpointing()
    ids = torch.randint(VOCAB, (2, T))
    with torch.no_grad():
        model(ids)
    assert checkpoints == []
    logits, cache = model(ids[:, :20])
    assert len(checkpoints) == 3
    continued, _ = model(ids[:, 20:], cache=cache)
    assert len(checkpoints) == 3
    expected, _ = reference(ids)
    torch.testing.assert_close(torch.cat([logits, continued], 1), expected, rtol=1e-5, atol=1e-5)


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="^every must be at least 1, got 0$"):
        model_with("lavo").set_activation_checkpointing(every=0)
