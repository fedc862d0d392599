"""The GPT model: cached decoding equals the full forward, causality, positions, config."""
import math

import pytest
import torch

from lavo.model import (ModelConfig, add_positions, build_model, count_parameters, model_config,
                        sinusoidal_positions)

CASES = [("lavo", "none", {"window": 8}), ("lavo", "sinusoidal", {"window": 8, "basis": "learned"}),
         ("softmax", "rope", {}), ("softmax", "sinusoidal", {})]


def small(attention, position, options, **extra):
    torch.manual_seed(0)
    return build_model(dict(vocab_size=97, dim=32, depth=2, heads=2, attention=attention, position=position,
                            attention_options=options, **extra)).eval()


@pytest.mark.parametrize("attention,position,options", CASES)
def test_cached_decoding_matches_full_forward(attention, position, options):
    model = small(attention, position, options)
    with torch.no_grad():
        for p in model.parameters():  # non-zero position biases and the like
            p.add_(0.02 * torch.randn_like(p))
    ids = torch.randint(0, 97, (2, 45))
    with torch.no_grad():
        full, _ = model(ids)
        cache, outputs, start = None, [], 0
        for size in (1, 1, 7, 8, 1, 16, 11):
            logits, cache = model(ids[:, start:start + size], cache=cache)
            outputs.append(logits)
            start += size
    assert cache.position == 45
    torch.testing.assert_close(torch.cat(outputs, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention,position,options", CASES)
def test_no_information_from_the_future(attention, position, options):
    model = small(attention, position, options)
    ids = torch.randint(0, 97, (1, 30))
    changed = ids.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 97
    with torch.no_grad():
        a, _ = model(ids)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_sinusoidal_positions_continue_in_the_cache():
    table = sinusoidal_positions(0, 10, 8)
    torch.testing.assert_close(sinusoidal_positions(4, 6, 8), table[4:])
    assert table[0, 1] == 1.0 and table[0, 0] == 0.0  # sin/cos interleaved


@pytest.mark.parametrize("dim", [8, 7])
def test_sinusoidal_positions_are_vaswanis(dim):
    """Vaswani et al. (2017), 3.5: entry 2i of position p is sin(p / 10000^(2i / dim)), entry 2i + 1 its cosine;
    an odd dim ends on a sine."""
    positions = [0, 1, 5, 37, 500]
    expected = [[math.sin(p / 10000 ** (j / dim)) if j % 2 == 0 else math.cos(p / 10000 ** ((j - 1) / dim))
                 for j in range(dim)] for p in positions]
    table = sinusoidal_positions(0, 501, dim)[positions]
    torch.testing.assert_close(table, torch.tensor(expected), atol=1e-4, rtol=0)


def test_sinusoidal_positions_are_as_large_as_the_initial_token_embeddings():
    """Amplitude 1 made them about 35 times the tokens (a small model stayed at the unigram loss)."""
    model = small("softmax", "sinusoidal", {})
    config = model.config
    positions = add_positions(torch.zeros(1, 4096, config.dim), config)
    tokens = model.embed.weight
    assert positions.square().mean().sqrt().item() == pytest.approx(config.init_std, rel=0.01)
    assert tokens.square().mean().sqrt().item() == pytest.approx(config.init_std, rel=0.05)


def test_tied_embeddings_and_parameter_count():
    model = small("lavo", "none", {"window": 8})
    names = [n for n, _ in model.named_parameters()]
    assert not any("head" in n for n in names)
    expected = sum(p.numel() for p in model.parameters())
    assert count_parameters(model) == expected
    assert count_parameters(model, exclude_embedding=True) == expected - 97 * 32


def test_presets_and_overrides():
    tiny = model_config("tiny")
    assert (tiny.dim, tiny.depth) == (192, 4)
    custom = model_config("tiny", dim=64, attention="lavo", attention_options={"window": 16})
    assert custom.dim == 64 and custom.depth == 4 and custom.attention_options == {"window": 16}
    assert 1e6 < count_parameters(build_model(model_config("tiny", attention="lavo"))) < 5e6
    with pytest.raises(ValueError, match="unknown model settings"):
        model_config("tiny", width=3)
    with pytest.raises(ValueError, match="unknown preset"):
        model_config("huge")
    with pytest.raises(ValueError, match="model.position must be one of"):
        ModelConfig(position="learned")
    with pytest.raises(ValueError, match="unknown attention"):
        build_model(dict(attention="nonexistent"))


def test_padding_mask_is_passed_to_attention():
    model = small("lavo", "none", {"window": 8})
    ids = torch.randint(0, 97, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :8] = False  # left padding of one whole window: LAVO's windows stay aligned
    with torch.no_grad():
        padded, _ = model(ids, padding_mask=mask)
        unmasked, _ = model(ids)
        alone, _ = model(ids[1:, 8:])
    torch.testing.assert_close(padded[1, 8:], alone[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked[1, 8:], alone[0], atol=1e-3)


def test_a_cache_that_is_not_this_models_is_refused_by_name():
    """Was: a deeper model's cache continued with its extra layers dropped, silently; a shallower one's an
    IndexError; a layer's cache an AttributeError."""
    model = small("lavo", "none", {"window": 8})
    ids = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        _, cache = model(ids)
        torch.manual_seed(0)
        deeper = build_model(dict(model.config.to_dict(), depth=3)).eval()(ids)[1]
        for other, message in ((deeper, r"the cache holds the caches of 3 layers, and this model has 2"),
                               (cache.layers[0], r"LanguageModel continues a ModelCache, got a LavoCache")):
            with pytest.raises(ValueError, match=rf"^{message}: pass the cache this model's previous call returned$"):
                model(ids[:, :1], cache=other)


# Every option that adds a tensor of the layer's own (a learned basis takes the orthonormal parametrization).
OWN_TENSORS = [("lavo", {"window": 4, "write": "gated", "read_temperature": True}),
               ("lavo", {"window": 4, "basis": "learned", "rank": 4, "write": "decay"}),
               ("local", {"window": 4}), ("abc", {"slots": 3}), ("longshort", {"window": 4}),
               ("performer", {"features": 8, "redraw_interval": 2}), ("s4d", {}), ("cosformer", {}), ("softmax", {})]


@pytest.mark.parametrize("attention, options", OWN_TENSORS, ids=[f"{a}-{len(o)}" for a, o in OWN_TENSORS])
def test_a_model_built_on_the_meta_device_is_initialised_by_reset_parameters(attention, options):
    """Deferred initialisation: build on the meta device, to_empty(), reset_parameters(). Every weight and buffer
    must be made again (the mechanisms' own ones too: LAVO's basis, Performer's features, S4D's system were left
    as uninitialised memory), so the result equals a model built eagerly and reset from the same seed."""
    config = dict(vocab_size=50, dim=16, depth=2, heads=2, attention=attention, attention_options=options)
    eager = build_model(config)
    with torch.device("meta"):
        deferred = build_model(config)
    deferred.to_empty(device="cpu")
    for model in (eager, deferred):
        torch.manual_seed(1)
        model.reset_parameters()
    expected = eager.state_dict()
    assert list(deferred.state_dict()) == list(expected)
    for name, tensor in deferred.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    ids = torch.randint(0, 50, (2, 9))
    logits, _ = deferred(ids)
    torch.testing.assert_close(logits, eager(ids)[0])
    layer = deferred.blocks[0].attention
    if attention == "lavo":
        basis = layer.basis
        torch.testing.assert_close(basis @ basis.mT, torch.eye(basis.shape[1]).expand_as(basis @ basis.mT))


def test_a_layer_reset_draws_every_tensor_as_construction_does():
    """A layer built on the meta device, materialised and reset, equals one built eagerly from the same seed: its
    linear layers and its own tensors are drawn again, in the order construction drew them (a lone layer's
    projections were left as uninitialised memory)."""
    from lavo import build_attention, build_cross_attention
    builders = [(build_attention, name, options) for name, options in OWN_TENSORS] + [
        (build_cross_attention, name, {}) for name in ("lavo", "performer", "softmax")]
    for build, name, options in builders:
        torch.manual_seed(0)
        eager = build(name, 16, 2, **options)
        with torch.device("meta"):
            deferred = build(name, 16, 2, **options)
        deferred.to_empty(device="cpu")
        torch.manual_seed(0)
        deferred.reset_parameters()
        for key, value in eager.state_dict().items():
            assert torch.equal(deferred.state_dict()[key], value), (name, key)


def test_a_tensor_made_after_a_missing_or_shared_submodule_is_made_again():
    """add_initialised counts a submodule set to None and one held under two names; the reset must too, or a
    tensor made after them is never made again (left as uninitialised memory on the meta device)."""
    from functools import partial

    from lavo.layers.base import Mechanism, add_initialised

    class Shared(Mechanism):
        def __init__(self, dim, heads, *, causal=True):
            super().__init__(dim, heads, causal=causal)
            self.to_q = self.to_k = torch.nn.Linear(dim, dim)
            self.norm = None
            add_initialised(self, "scale", partial(torch.randn, 2))

    torch.manual_seed(0)
    eager = Shared(4, 1)
    with torch.device("meta"):
        deferred = Shared(4, 1)
    deferred.to_empty(device="cpu")
    torch.manual_seed(0)
    deferred.reset_parameters()
    for key, value in eager.state_dict().items():
        assert torch.equal(deferred.state_dict()[key], value), key
