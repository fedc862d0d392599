"""Mechanisms by name, so a model switches attention by changing one string.

Every self-attention class is built as ``cls(dim, heads, causal=..., **options)`` and follows the
:class:`lavo.layers.base.Mechanism` contract: ``forward(x, padding_mask=None, cache=None) -> (y, cache)``.
Cross-attention classes are built as ``cls(dim, heads, **options)`` and called as
``forward(y, source, source_padding_mask=None, query_padding_mask=None) -> out``.

A mechanism of your own is added with :func:`register_attention` (or :func:`register_cross_attention`) when its
module is imported. For the command line and for saved runs and Hugging Face models, which import nothing of
yours, a package names the module in an entry point of the group ``lavo.attentions``; a name not registered yet
is looked up there (docs/ATTENTIONS.md, "A mechanism of your own").
"""
from __future__ import annotations

import inspect
import warnings
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Callable

from .layers.abc import ABCAttention, ABCCrossAttention
from .layers.base import CrossAttentionLayer, Mechanism
from .layers.cosformer import CosformerAttention, CosformerCrossAttention
from .layers.lavo import LavoAttention, LavoCrossAttention
from .layers.local import LocalAttention
from .layers.longshort import LongShortAttention
from .layers.performer import PerformerAttention, PerformerCrossAttention
from .layers.s4d import S4DLayer
from .layers.softmax import SoftmaxAttention, SoftmaxCrossAttention

ENTRY_POINT_GROUP = "lavo.attentions"

ATTENTIONS: dict[str, type[Mechanism]] = {
    "abc": ABCAttention,
    "cosformer": CosformerAttention,
    "lavo": LavoAttention,
    "local": LocalAttention,
    "longshort": LongShortAttention,
    "performer": PerformerAttention,
    "s4d": S4DLayer,
    "softmax": SoftmaxAttention,
}
CROSS_ATTENTIONS: dict[str, type[CrossAttentionLayer]] = {
    "abc": ABCCrossAttention,
    "cosformer": CosformerCrossAttention,
    "lavo": LavoCrossAttention,
    "performer": PerformerCrossAttention,
    "softmax": SoftmaxCrossAttention,
}


class UnknownAttention(ValueError):
    """A name neither registered nor given by an installed package's entry point."""


def _check_constructor(cls: type, fixed: tuple[str, ...]) -> None:
    """Refuse options a config could not set: every constructor parameter but ``fixed`` must be keyword-only."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    positional = [p.name for p in parameters if p.name not in fixed and p.kind in (p.POSITIONAL_ONLY,
                                                                                      p.POSITIONAL_OR_KEYWORD)]
    if positional:
        raise TypeError(f"{cls.__name__}.__init__ takes {', '.join(positional)} by position; options must be "
                        f"keyword-only (after a *, as in __init__(self, {', '.join(fixed)}, *, ...)) for "
                        "attention_options to set them")


def _register(table: dict, base: type, fixed: tuple[str, ...], name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"{cls!r} must subclass lavo.layers.{base.__name__} to be registered")
        _check_constructor(cls, fixed)
        known = table.get(name)
        # the same class defined again (its module reloaded) replaces itself; another class is refused
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"{name!r} is already registered (by {known.__module__}.{known.__qualname__})")
        table[name] = cls
        return cls
    return add


def register_attention(name: str) -> Callable[[type[Mechanism]], type[Mechanism]]:
    """Class decorator adding a self-attention mechanism of your own under ``name``."""
    return _register(ATTENTIONS, Mechanism, ("dim", "heads", "causal"), name)


def register_cross_attention(name: str) -> Callable[[type[CrossAttentionLayer]], type[CrossAttentionLayer]]:
    """Class decorator adding a cross attention of your own under ``name`` (``lavo forecast --cross name``)."""
    return _register(CROSS_ATTENTIONS, CrossAttentionLayer, ("dim", "heads"), name)


@cache
def _entry_points() -> tuple[EntryPoint, ...]:
    """The installed packages' ``lavo.attentions`` entry points (read once: scanning them costs milliseconds)."""
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


_loaded: set[str] = set()


def _load_entry_points(name: str | None = None) -> None:
    """Import what the ``lavo.attentions`` entry points name (only ``name``'s, when given), each once: a module
    registers its mechanisms as it is imported; a class named directly is registered under the entry point's
    name. An entry point that fails to import raises when it is the one asked for by name, and is skipped with a
    warning otherwise, so that one broken package does not stop lavo from listing or finding the others."""
    for point in _entry_points():
        if point.name in _loaded or (name is not None and point.name != name):
            continue
        try:
            loaded = point.load()
        except Exception as error:
            message = (f"entry point {point.name!r} = {point.value!r} of group {ENTRY_POINT_GROUP!r} failed to "
                       f"import: {error}")
            if name is not None:
                raise ImportError(message) from error
            warnings.warn(f"skipped {message}", stacklevel=3)
            continue
        _loaded.add(point.name)
        if isinstance(loaded, type) and issubclass(loaded, Mechanism) and loaded not in ATTENTIONS.values():
            register_attention(point.name)(loaded)
        if isinstance(loaded, type) and issubclass(loaded, CrossAttentionLayer) \
                and loaded not in CROSS_ATTENTIONS.values():
            register_cross_attention(point.name)(loaded)


def _lookup(table: dict, name: str, kind: str) -> type:
    if name not in table:
        _load_entry_points(name)
    if name not in table:  # a module named by one entry point may register several mechanisms
        _load_entry_points()
    if name not in table:  # every entry point is loaded by now: the table is all there is
        decorator = "register_attention" if table is ATTENTIONS else "register_cross_attention"
        raise UnknownAttention(f"unknown {kind} {name!r}; available: {', '.join(sorted(table))}. A mechanism "
                               f"of your own is registered when its module is imported (@{decorator}); for "
                               f"the command line and saved models, name that module in an entry point of the "
                               f"group {ENTRY_POINT_GROUP!r} of its package")
    return table[name]


def _available(table: dict) -> list[str]:
    _load_entry_points()
    return sorted(table)


def available_attentions() -> list[str]:
    """The registered self-attention names, with those the installed packages' entry points add."""
    return _available(ATTENTIONS)


def available_cross_attentions() -> list[str]:
    """The registered cross-attention names, with those the installed packages' entry points add."""
    return _available(CROSS_ATTENTIONS)


def attention_class(name: str) -> type[Mechanism]:
    """The class registered as ``name``; an unknown name raises an error listing the available ones."""
    return _lookup(ATTENTIONS, name, "attention")


def cross_attention_class(name: str) -> type[CrossAttentionLayer]:
    """The cross-attention class registered as ``name``; an unknown name raises an error listing the available
    ones."""
    return _lookup(CROSS_ATTENTIONS, name, "cross attention")


def check_options(name: str, options: dict, kind: str = "attention") -> None:
    """Raise naming the mechanism and its valid options when ``options`` has one its constructor lacks, or a
    switch (an option whose default is True or False) set to anything but a bool ("yes" would count as on).
    ``kind``: ``"attention"`` or ``"cross attention"``, the registry ``name`` is in."""
    defaults = (attention_class(name) if kind == "attention" else cross_attention_class(name)).option_defaults()
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"{kind} {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(defaults) or 'none'}")
    for option, value in options.items():
        if isinstance(defaults[option], bool) and not isinstance(value, bool):
            raise ValueError(f"{kind} {name!r} option {option} must be true or false, got {value!r}")


def build_attention(name: str, dim: int, heads: int, *, causal: bool = True, **options) -> Mechanism:
    """Build the attention registered as ``name``; ``options`` are that mechanism's keyword options."""
    check_options(name, options)
    return attention_class(name)(dim, heads, causal=causal, **options)


def build_cross_attention(name: str, dim: int, heads: int, **options) -> CrossAttentionLayer:
    """Build the cross-attention registered as ``name`` (the source is compressed, the targets read it)."""
    check_options(name, options, "cross attention")
    return cross_attention_class(name)(dim, heads, **options)
