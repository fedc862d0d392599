"""Mechanisms by name, so a model switches attention by changing one string.

Every self-attention class is built as ``cls(dim, heads, causal=..., **options)`` and follows the
:class:`lavo.layers.base.Mechanism` contract: ``forward(x, padding_mask=None, cache=None) -> (y, cache)``.
Cross-attention classes are built as ``cls(dim, heads, **options)`` and called as
``forward(y, source, source_padding_mask=None) -> out``.
"""
from __future__ import annotations

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


def register_attention(name: str) -> Callable[[type[Mechanism]], type[Mechanism]]:
    """Class decorator adding a self-attention mechanism of your own under ``name``."""
    def add(cls: type[Mechanism]) -> type[Mechanism]:
        if not (isinstance(cls, type) and issubclass(cls, Mechanism)):
            raise TypeError(f"{cls!r} must subclass lavo.layers.Mechanism to be registered")
        if name in ATTENTIONS:
            raise ValueError(f"attention {name!r} is already registered (by {ATTENTIONS[name].__name__})")
        ATTENTIONS[name] = cls
        return cls
    return add


def available_attentions() -> list[str]:
    return sorted(ATTENTIONS)


def available_cross_attentions() -> list[str]:
    return sorted(CROSS_ATTENTIONS)


def attention_class(name: str) -> type[Mechanism]:
    """The class registered as ``name``; an unknown name raises an error listing the available ones."""
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; available: {', '.join(sorted(ATTENTIONS))}")
    return ATTENTIONS[name]


def check_options(name: str, options: dict, kind: str = "attention") -> None:
    """Raise naming the mechanism and its valid options when ``options`` has one its constructor lacks, or a
    switch (an option whose default is True or False) set to anything but a bool ("yes" would count as on).
    ``kind``: ``"attention"`` or ``"cross attention"``, the registry ``name`` is in."""
    defaults = (attention_class(name) if kind == "attention" else CROSS_ATTENTIONS[name]).option_defaults()
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
    if name not in CROSS_ATTENTIONS:
        raise ValueError(f"unknown cross attention {name!r}; available: {', '.join(available_cross_attentions())}")
    check_options(name, options, "cross attention")
    return CROSS_ATTENTIONS[name](dim, heads, **options)
