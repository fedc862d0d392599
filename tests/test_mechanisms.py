"""What mechanisms declare, and generic code asking them: options, rotary, weight decay, residual init, cache
size, the registry."""
import pytest
import torch

from lavo import Mechanism, available_attentions, build_attention, build_cross_attention, register_attention
from lavo.model import ModelConfig, build_model
from lavo.registry import ATTENTIONS, attention_class

# A non-default value for every option of every mechanism (test_every_option_is_covered keeps it complete).
OPTION_VALUES = {
    "abc": {"slots": [3]},
    "cosformer": {"max_length": [64], "chunk": [5]},
    "lavo": {"rank": [4], "window": [4], "basis": ["learned"], "position_bias": [False], "dissection": [False],
             "write": ["decay", "gated"], "memory": ["vector"], "read_temperature": [True], "backend": ["torch"]},
    "local": {"window": [4], "position_bias": [False], "backend": ["torch"]},
    "longshort": {"window": [4], "landmarks": [2], "dual_ln": [False]},
    "performer": {"features": [8], "chunk": [5], "redraw_interval": [1]},
    "s4d": {"state_size": [6], "dt_min": [1e-2], "dt_max": [0.5]},
    "softmax": {"rotary": [True]},
}
CASES = [(name, option, value) for name, options in OPTION_VALUES.items()
         for option, values in options.items() for value in values]


def test_every_option_is_covered():
    assert sorted(OPTION_VALUES) == available_attentions()
    for name in available_attentions():
        assert sorted(OPTION_VALUES[name]) == sorted(attention_class(name).option_names()), name


@pytest.mark.parametrize("name,option,value", CASES)
def test_every_mechanism_and_option_trains_and_decodes_through_the_model(name, option, value):
    torch.manual_seed(0)
    position = "rope" if option == "rotary" else "none"
    options = {} if option == "rotary" else {option: value}
    if "window" in attention_class(name).option_names():
        options = {"window": 4, **options}  # 21 tokens cross window boundaries: LAVO's memory is written and read
    model = build_model(dict(vocab_size=50, dim=16, depth=2, heads=2, attention=name, attention_options=options,
                             position=position))
    ids = torch.randint(0, 50, (2, 21))
    logits, cache = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    assert torch.isfinite(loss).item()
    # every trainable parameter is reached by the loss
    unreached = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not unreached
    if model.supports_decoding:
        model.eval()  # decoding is inference: no dropout, no random features redrawn
        with torch.no_grad():
            first, cache = model(ids[:, :13])
            rest, cache = model(ids[:, 13:], cache=cache)
        torch.testing.assert_close(torch.cat([first, rest], 1), logits.detach(), atol=1e-4, rtol=1e-4)
    else:
        assert cache is None


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"attention 'lavo' has no option 'windw'; its options: rank, window, "
                                         r"basis, position_bias, dissection, write, memory, read_temperature, "
                                         r"backend"):
        ModelConfig(attention="lavo", attention_options={"windw": 8})
    with pytest.raises(ValueError, match=r"attention 'abc' has no option 'window'"):
        build_attention("abc", 16, 2, window=8)


@pytest.mark.parametrize("name", [n for n in available_attentions() if not attention_class(n).accepts_rotary])
def test_rope_with_an_attention_that_cannot_rotate_fails_when_configured(name):
    with pytest.raises(ValueError, match=rf"position='rope' .* {name!r} does not take rotary positions .*softmax"):
        ModelConfig(attention=name, position="rope")


def test_weight_decay_groups_come_from_the_mechanisms():
    model = build_model(dict(vocab_size=50, dim=16, depth=1, heads=2, attention="lavo",
                             attention_options={"window": 4, "basis": "learned"}))
    decay, no_decay = (group["params"] for group in model.parameter_groups(0.1, 1e-3))
    assert {id(p) for p in decay}.isdisjoint(id(p) for p in no_decay)
    assert len(decay) + len(no_decay) == len(list(model.parameters()))
    attention = model.blocks[0].attention
    excluded = {id(attention.pos_bias), id(attention.parametrizations["basis"].original)}
    assert excluded <= {id(p) for p in no_decay}
    assert {id(model.embed.weight), id(attention.to_qkv.weight)} <= {id(p) for p in decay}
    assert all(p.dim() >= 2 for p in decay)


def test_s4d_system_is_not_decayed_and_its_learning_rate_is_capped_as_in_the_reference():
    model = build_model(dict(vocab_size=50, dim=16, depth=2, heads=2, attention="s4d"))
    groups = model.parameter_groups(0.1, 4e-3)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    system = {id(p) for block in model.blocks for p in (block.attention.log_dt, block.attention.log_a_real,
                                                         block.attention.a_imag)}
    (capped,) = [g for g in groups if g["lr_scale"] != 1]
    assert {id(p) for p in capped["params"]} == system
    assert (capped["lr"], capped["lr_scale"], capped["weight_decay"]) == (1e-3, 0.25, 0.0)
    decayed = {id(p) for g in groups if g["weight_decay"] == 0.1 for p in g["params"]}
    s4d = model.blocks[0].attention
    assert id(s4d.c) in decayed and id(s4d.to_glu.weight) in decayed and id(s4d.skip) not in decayed
    assert all(g["lr"] == 4e-3 and g["lr_scale"] == 1 for g in groups if g is not capped)
    assert {g["lr_scale"] for g in model.parameter_groups(0.1, 5e-4)} == {1.0}  # below the cap: unchanged


def test_residual_projections_get_the_scaled_init():
    depth = 6
    model = build_model(dict(vocab_size=50, dim=64, depth=depth, heads=2, attention="s4d"))
    s4d = model.blocks[0].attention
    expected = 0.02 / (2 * depth) ** 0.5
    assert s4d.residual_weights() == [s4d.to_glu.weight]
    assert abs(s4d.to_glu.weight.std().item() - expected) < 0.15 * expected
    assert abs(model.blocks[0].mlp[0].weight.std().item() - 0.02) < 0.1 * 0.02
    assert not hasattr(s4d, "to_qkv")


# Each decoding mechanism with its defaults and with each option value (a window of 4, so it is reached).
CACHE_CASES = [(name, {}) for name in available_attentions() if ATTENTIONS[name].supports_decoding] + [
    (name, {option: value}) for name, option, value in CASES
    if ATTENTIONS[name].supports_decoding and option not in ("window", "rotary")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name,options", CACHE_CASES, ids=[f"{n}-{o}" for n, o in CACHE_CASES])
def test_cache_nbytes_is_the_tight_upper_bound(name, options, dtype):
    torch.manual_seed(0)
    if "window" in attention_class(name).option_names():
        options = {"window": 4, **options}
    layer = build_attention(name, 16, 2, **options).to(dtype)
    cache, sizes = None, []
    with torch.no_grad():
        for context in range(1, 15):
            _, cache = layer(torch.randn(2, 1, 16, dtype=dtype), cache=cache)
            nbytes = cache.nbytes()
            bound = layer.cache_nbytes(2, context, dtype)
            assert nbytes <= bound, (context, nbytes, bound)
            sizes.append(bound - nbytes)
    assert min(sizes) == 0  # reached at some context: the bound is not loose


def test_layers_without_decoding_refuse_a_cache():
    layer = build_attention("longshort", 16, 2, window=4)
    for call in (lambda: layer.empty_cache(1), lambda: layer.cache_nbytes(1, 10)):
        with pytest.raises(ValueError, match="LongShortAttention has no decoding form, so no cache"):
            call()


def test_registering_a_new_mechanism():
    @register_attention("test-identity")
    class Identity(Mechanism):
        def forward(self, x, padding_mask=None, cache=None):
            self.check_call(x, padding_mask, cache)
            return x, None

    try:
        assert "test-identity" in available_attentions()
        x = torch.randn(1, 3, 8)
        y, _ = build_model(dict(vocab_size=5, dim=8, depth=1, heads=2, attention="test-identity"))(
            torch.zeros(1, 3, dtype=torch.long))
        assert y.shape == (1, 3, 5)
        assert torch.equal(build_attention("test-identity", 8, 2)(x)[0], x)
        assert not Identity.supports_decoding  # no cache_types
        # the same class defined again (its module reloaded) replaces itself; another one is refused
        register_attention("test-identity")(type("Identity", (Identity,), {"__qualname__": Identity.__qualname__}))
        with pytest.raises(ValueError, match=r"^'test-identity' is already registered \(by test_mechanisms\.test_"
                           r"registering_a_new_mechanism\.<locals>\.Identity\)$"):
            register_attention("test-identity")(type("Other", (Identity,), {}))
    finally:
        ATTENTIONS.pop("test-identity")
    with pytest.raises(TypeError, match="must subclass lavo.layers.Mechanism"):
        register_attention("not-a-mechanism")(torch.nn.Linear)


def test_cross_attention_is_in_the_registry():
    cross = build_cross_attention("lavo", 16, 2, rank=4)
    assert cross(torch.randn(1, 3, 16), torch.randn(1, 7, 16)).shape == (1, 3, 16)
    with pytest.raises(ValueError, match="unknown cross attention 'nope'; available: abc, cosformer, lavo, "
                       "performer, softmax"):
        build_cross_attention("nope", 16, 2)

