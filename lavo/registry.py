"""Attention mechanisms by name, so a model switches attention by changing one string.

Every registered class is built as ``cls(dim, heads, causal=..., **options)`` and follows the
:class:`lavo.layers.base.AttentionLayer` contract: ``forward(x, padding_mask=None, cache=None) -> (y, cache)``.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

from torch import nn

ATTENTIONS: dict[str, type[nn.Module]] = {}


def register_attention(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def add(cls: type[nn.Module]) -> type[nn.Module]:
        if name in ATTENTIONS:
            raise ValueError(f"attention {name!r} is already registered (by {ATTENTIONS[name].__name__})")
        ATTENTIONS[name] = cls
        return cls
    return add


def available_attentions() -> list[str]:
    _load_builtin()
    return sorted(ATTENTIONS)


def build_attention(name: str, dim: int, heads: int, *, causal: bool = True, **options) -> nn.Module:
    """Build the attention registered as ``name``; ``options`` are that mechanism's keyword options."""
    _load_builtin()
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; available: {', '.join(sorted(ATTENTIONS))}")
    return ATTENTIONS[name](dim, heads, causal=causal, **options)


def _load_builtin() -> None:
    """Import every module of :mod:`lavo.layers`: each registers its mechanisms when imported."""
    from . import layers

    for module in pkgutil.iter_modules(layers.__path__):
        importlib.import_module(f"{layers.__name__}.{module.name}")
