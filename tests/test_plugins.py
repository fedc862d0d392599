"""Mechanisms of your own: registration, entry points for code that imports nothing of yours (the command line,
saved runs, Hugging Face models), and the contract checks that catch what would otherwise go unnoticed."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import lavo.registry as registry
from lavo import Mechanism, register_attention
from lavo.cache import Cache, KVCache
from lavo.model import build_model
from lavo.registry import ATTENTIONS, UnknownAttention, attention_class, build_attention, register_cross_attention
from lavo.run import read_run_config

PLUGIN = textwrap.dedent('''
    import torch
    from lavo import Mechanism, register_attention

    @register_attention("plugin-scale")
    class Scale(Mechanism):
        """y = factor * x: enough to tell it apart, nothing to learn but the factor."""

        def __init__(self, dim, heads, *, causal=True, factor=2.0):
            super().__init__(dim, heads, causal=causal)
            self.factor = torch.nn.Parameter(torch.tensor(float(factor)))

        def forward(self, x, padding_mask=None, cache=None):
            self.check_call(x, padding_mask, cache)
            return self.factor * x, None
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """An installed package ``lavo-plugin-demo`` whose entry point names the module that registers
    ``plugin-scale``; yields the folder to put on a subprocess's path."""
    (tmp_path / "lavo_plugin_demo.py").write_text(PLUGIN)
    info = tmp_path / "lavo_plugin_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lavo-plugin-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lavo.attentions]\nplugin-scale = lavo_plugin_demo\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry._entry_points.cache_clear()
    try:
        yield tmp_path
    finally:
        ATTENTIONS.pop("plugin-scale", None)
        registry._loaded.discard("plugin-scale")
        registry._entry_points.cache_clear()
        sys.modules.pop("lavo_plugin_demo", None)


def test_an_entry_point_registers_its_mechanism_when_the_name_is_first_asked_for(plugin):
    assert "plugin-scale" not in ATTENTIONS and "lavo_plugin_demo" not in sys.modules
    layer = build_attention("plugin-scale", 8, 2, factor=3.0)
    x = torch.randn(1, 4, 8)
    assert torch.equal(layer(x)[0], 3.0 * x)
    assert "plugin-scale" in registry.available_attentions()


def test_a_saved_run_and_a_fresh_process_find_the_mechanism_through_its_entry_point(plugin, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {"dim": 8, "depth": 1, "heads": 2,
                                                           "attention": "plugin-scale"}}))
    assert read_run_config(run).model["attention"] == "plugin-scale"
    script = ("from lavo.model import build_model\n"
              "model = build_model(dict(vocab_size=5, dim=8, depth=1, heads=2, attention='plugin-scale'))\n"
              "print(type(model.blocks[0].attention).__module__)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), *sys.path])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "lavo_plugin_demo"


def test_an_unknown_name_in_a_saved_run_says_how_to_register_it_and_not_that_the_run_is_damaged(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model": {"attention": "nowhere"}}))
    available = re.escape(", ".join(registry.available_attentions()))  # the built-in ones, and any installed
    with pytest.raises(UnknownAttention, match=rf"^unknown attention 'nowhere'; available: {available}\. A mechanism "
                       r"of your own is registered when its module is imported \(@register_attention\); for the "
                       r"command line and saved models, name that module in an entry point of the group "
                       r"'lavo\.attentions' of its package$"):
        read_run_config(tmp_path)


def test_a_module_that_registers_several_mechanisms_is_found_by_each_name(plugin):
    """The entry point is named after one of them; the others are found by importing every entry point."""
    (plugin / "lavo_plugin_demo.py").write_text(PLUGIN + textwrap.dedent('''
        @register_attention("plugin-scale-twice")
        class Twice(Scale):
            pass
    '''))
    try:
        assert attention_class("plugin-scale-twice").__name__ == "Twice"
    finally:
        ATTENTIONS.pop("plugin-scale-twice", None)


def test_a_broken_entry_point_is_named_when_asked_for_and_skipped_with_a_warning_otherwise(plugin):
    """One broken package must not stop lavo from listing, or telling apart, the others."""
    (plugin / "lavo_plugin_demo.py").write_text("raise ImportError('needs a package that is not installed')\n")
    message = (r"entry point 'plugin-scale' = 'lavo_plugin_demo' of group 'lavo\.attentions' failed to import: "
               r"needs a package that is not installed")
    with pytest.warns(UserWarning, match=f"^skipped {message}$"):
        assert "lavo" in registry.available_attentions()
    with pytest.raises(ImportError, match=f"^{message}$"):
        attention_class("plugin-scale")
    with pytest.warns(UserWarning, match="^skipped"), pytest.raises(UnknownAttention, match="^unknown attention 'x'"):
        attention_class("x")


def test_options_a_config_could_not_set_are_refused_at_registration():
    class Positional(Mechanism):
        def __init__(self, dim, heads, causal=True, factor=1.0):
            super().__init__(dim, heads, causal=causal)

    with pytest.raises(TypeError, match=r"^Positional\.__init__ takes factor by position; options must be "
                                        r"keyword-only \(after a \*, as in __init__\(self, dim, heads, causal, \*, "
                                        r"\.\.\.\)\) for attention_options to set them$"):
        register_attention("test-positional")(Positional)
    assert "test-positional" not in ATTENTIONS


def test_a_cross_attention_of_your_own_is_built_by_name():
    from lavo.layers.base import CrossAttentionLayer
    from lavo.registry import CROSS_ATTENTIONS, build_cross_attention

    @register_cross_attention("test-first-source")
    class FirstSource(CrossAttentionLayer):
        def attend(self, q, k, v, source_padding_mask):
            return v[:, :1].expand_as(q)

    try:
        out = build_cross_attention("test-first-source", 8, 2)(torch.randn(1, 3, 8), torch.randn(1, 5, 8))
        assert out.shape == (1, 3, 8)
    finally:
        CROSS_ATTENTIONS.pop("test-first-source")


def test_decoding_is_what_a_class_declares_caches_for():
    class Forgetful(Mechanism):
        def forward(self, x, padding_mask=None, cache=None):
            return x, cache

    class Decoding(Forgetful):
        cache_types = (KVCache,)

    assert not Forgetful.supports_decoding and Decoding.supports_decoding
    with pytest.raises(TypeError, match="^Claims sets supports_decoding but declares no cache_types, the caches its "
                                        "calls return and continue$"):
        type("Claims", (Forgetful,), {"supports_decoding": True})
    layer = Decoding(8, 2)
    with pytest.raises(NotImplementedError, match="^Decoding decodes but does not implement _new_cache, which "
                                                  "empty_cache calls$"):
        layer.empty_cache(1)
    with pytest.raises(NotImplementedError, match="^Decoding decodes but does not implement cache_nbytes$"):
        layer.cache_nbytes(1, 10)


@pytest.mark.parametrize("declares, returns, message", [
    # None from a layer that decodes: the next chunk would forget the context, silently
    ((KVCache,), lambda cache: None, "^Broken returned NoneType as its cache, not a KVCache \\(its cache_types\\); "
                                     "a layer without a decoding form declares no cache_types and returns None$"),
    # a cache beam search could not reorder
    ((KVCache,), lambda cache: {"state": 0}, "^Broken returned dict as its cache, not a KVCache"),
    ((), lambda cache: KVCache.empty(1, 2, 4),
     "^Broken returned a KVCache but declares no cache_types, so nothing would continue from it"),
])
def test_a_model_refuses_a_layer_that_returns_another_cache_than_it_declares(declares, returns, message):
    @register_attention("test-broken")
    class Broken(Mechanism):
        cache_types = declares

        def forward(self, x, padding_mask=None, cache=None):
            return x, returns(cache)

    try:
        model = build_model(dict(vocab_size=5, dim=8, depth=1, heads=2, attention="test-broken"))
        with pytest.raises(TypeError, match=message):
            model(torch.zeros(1, 3, dtype=torch.long))
    finally:
        ATTENTIONS.pop("test-broken")


def test_the_builtin_caches_are_caches():
    for name in registry.available_attentions():
        assert all(issubclass(kind, Cache) for kind in attention_class(name).cache_types), name
