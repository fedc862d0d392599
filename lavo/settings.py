"""Typed settings with their allowed values declared once, on the dataclass field, and checked by one validator.

    @dataclass
    class TrainConfig:
        steps: int = setting(1000, at_least(1))
        def __post_init__(self):
            check_settings(self, "train")

A field's annotation gives its type (``int``, ``float``, ``str``, ``bool``, ``list[int]``, ``X | None``), its
``Allowed`` rule the range or choices; :func:`check_settings` enforces both (all errors at once, each naming the
setting, the value and what is allowed), and :func:`flag_type` turns the same declaration into an argparse
``type=`` for a command-line flag.
"""
from __future__ import annotations

import argparse
import json
import math
import numbers
import re
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable


class SettingsError(ValueError):
    """A setting has a value of the wrong type or outside its range; the message names each one."""


@dataclass(frozen=True)
class Allowed:
    """What a setting may be: ``test(value)`` and the words that describe it (``">= 1"``, ``"one of a, b"``), or
    a function giving them when asked (choices that can grow, as the registry's)."""

    test: Callable[[Any], bool]
    description: str | Callable[[], str]

    @property
    def words(self) -> str:
        return self.description() if callable(self.description) else self.description


def at_least(low: float) -> Allowed:
    return Allowed(lambda v: v >= low, f">= {low:g}")


def above(low: float) -> Allowed:
    return Allowed(lambda v: v > low, f"> {low:g}")


def between(low: float, high: float, *, high_open: bool = False, low_open: bool = False) -> Allowed:
    """``low <= v <= high``; ``low_open`` / ``high_open`` exclude an end."""
    left, right = ("(" if low_open else "["), (")" if high_open else "]")
    return Allowed(lambda v: (v > low if low_open else v >= low) and (v < high if high_open else v <= high),
                   f"in {left}{low:g}, {high:g}{right}")


# a random seed: what torch's generators take (they read it as a signed 64-bit integer)
SEED = Allowed(lambda v: 0 <= v < 2**63, "in [0, 2^63)")


def one_of(*choices: str | Callable[[], list[str]]) -> Allowed:
    """One of ``choices``; a function among them gives choices read at each check (a registry that can grow)."""
    def current() -> list[str]:
        return [name for choice in choices for name in (choice() if callable(choice) else [choice])]
    return Allowed(lambda v: v in current(), lambda: f"one of {', '.join(current())}")


def matches(pattern: str, words: str) -> Allowed:
    """A string matching the regular expression ``pattern`` entirely."""
    compiled = re.compile(pattern)
    return Allowed(lambda v: compiled.fullmatch(v) is not None, words)


def setting(default: Any = MISSING, allowed: Allowed | None = None, *, factory: Callable[[], Any] | None = None):
    """A dataclass field with its allowed values (for a list: the allowed value of each item)."""
    metadata = {"allowed": allowed} if allowed is not None else {}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# ----------------------------------------------------------------------------------------------- types

@dataclass(frozen=True)
class Kind:
    """A field's type: ``base`` (int, float, str, bool, list or dict), the type of a list's items, and
    whether None is allowed."""

    base: type
    item: type | None
    optional: bool

    def words(self, allowed: Allowed | None = None) -> str:
        """``"an integer >= 1"``, ``"one of float32, bfloat16"``, ``"a non-empty list of integers, each > 0"``."""
        names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a table"}
        if self.base is list:
            text = "a non-empty list" + (f" of {names[self.item].split(' ', 1)[1]}s" if self.item else "")
            text += f", each {allowed.words}" if allowed else ""
        elif allowed is not None and self.base is str:
            text = allowed.words
        else:
            text = names[self.base] + (f" {allowed.words}" if allowed else "")
        return text + (", or null" if self.optional else "")


def kind_of(hint: Any) -> Kind:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arguments = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(arguments) < len(typing.get_args(hint))
        (hint,) = arguments
    origin = typing.get_origin(hint) or hint
    item = typing.get_args(hint)[0] if origin is list and typing.get_args(hint) else None
    return Kind(origin, item, optional)


def _convert(value: Any, base: type) -> tuple[bool, Any]:
    """``(True, value as base)`` if ``value`` has the type ``base`` (an integer is a number; a bool is not)."""
    if isinstance(value, bool):
        return base is bool, value
    if base is int and isinstance(value, numbers.Integral):
        return True, int(value)
    if base is float and isinstance(value, numbers.Real):
        return math.isfinite(value), float(value)
    return isinstance(value, base), value


def _describe(value: Any, kind: Kind) -> str:
    """``value`` as the message shows it; a string where a list or a table belongs comes with how ``--set``
    writes one (its value is read as JSON, and text that is not JSON stays a string)."""
    if not isinstance(value, str):
        return repr(value)
    if kind.base is list:
        return f"{value!r} (a string; write a list as JSON, {_as_json_list(value, kind.item)}, in --set too)"
    if kind.base is dict:
        return f"{value!r} (a string; write a table as JSON, {{\"window\": 32}}, in --set too)"
    return f"{value!r} (a string)"


def _as_json_list(text: str, item: type | None) -> str:
    """The JSON list ``text`` (``persuasion``, ``[emma, persuasion]``) was likely meant as, or an example."""
    words = [word.strip().strip("'\"") for word in text.strip().strip("[]").split(",")]
    if item is str and all(words):
        return json.dumps(words)
    return '["a", "b"]' if item is str else "[1, 2]"


def check_value(value: Any, kind: Kind, allowed: Allowed | None) -> tuple[Any, bool]:
    """``(the value converted to its type, True)``, or ``(value, False)`` when it is not allowed."""
    if value is None:
        return value, kind.optional
    ok, converted = _convert(value, kind.base)
    if not ok or (kind.base is list and not converted):
        return value, False
    if kind.base is list:
        items = []
        for item in converted:
            ok, item = _convert(item, kind.item) if kind.item else (True, item)
            if not ok or (allowed is not None and not allowed.test(item)):
                return value, False
            items.append(item)
        return items, True
    ok = allowed is None or allowed.test(converted)
    return (converted if ok else value), ok


def check_settings(instance: Any, section: str) -> None:
    """Check (and convert in place: ``3`` for a float becomes ``3.0``) every field of the dataclass
    ``instance``; raise one :class:`SettingsError` listing every bad setting as ``section.name``."""
    hints = typing.get_type_hints(type(instance))
    problems = []
    for f in fields(instance):
        kind, allowed = kind_of(hints[f.name]), f.metadata.get("allowed")
        value, ok = check_value(getattr(instance, f.name), kind, allowed)
        if ok:
            object.__setattr__(instance, f.name, value)
        else:
            problems.append(f"{section}.{f.name} must be {kind.words(allowed)}; got {_describe(value, kind)}")
    if problems:
        raise SettingsError("; ".join(problems))


def check_known(cls: type, values: dict, section: str) -> None:
    """Raise ``ValueError`` naming the keys of ``values`` that are not fields of the dataclass ``cls``."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {section} settings {unknown}; known: {', '.join(sorted(known))}")


def comma_list(kind: Callable[[str], Any] = str, allowed: typing.Collection[str] = (), may_be_empty: bool = False):
    """An argparse ``type=`` for a comma-separated list of ``kind``: ``"a, b"`` is ``["a", "b"]``, not ``" b"``.
    ``allowed``: the only items taken, if given; empty only where that means "none of these" (mechanisms, ops)."""
    def parse(text: str) -> list:
        items = [kind(item.strip()) for item in text.split(",") if item.strip()]
        if not items and not may_be_empty:
            raise argparse.ArgumentTypeError(f"must be a non-empty comma-separated list; got {text!r}")
        unknown = sorted(set(items) - set(allowed)) if allowed else []
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
        return items
    parse.__name__ = f"comma-separated {kind.__name__}"  # argparse's "invalid comma-separated int value: '1,a'"
    return parse


def flag_type(cls: type, name: str) -> Callable[[str], Any]:
    """An argparse ``type=`` for a flag that sets the field ``name`` of the dataclass ``cls``: it parses the
    text as the field's type (a list is comma-separated) and checks the field's allowed values."""
    kind = kind_of(typing.get_type_hints(cls)[name])
    allowed = next(f for f in fields(cls) if f.name == name).metadata.get("allowed")
    parse = kind.item if kind.base is list else kind.base

    def parse_flag(text: str) -> Any:
        try:
            value = comma_list(parse, may_be_empty=True)(text) if kind.base is list else parse(text)
        except ValueError:
            value = text
        value, ok = check_value(value, kind, allowed)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {flag_kind.words(allowed)}; got {text!r}")
        return value

    flag_kind = Kind(kind.base, kind.item, optional=False)  # a flag cannot be null: leaving it out is
    parse_flag.__name__ = flag_kind.words(allowed)  # what argparse calls the type in its own messages
    return parse_flag


def check_at_most(obj: Any, section: str, name: str, bound: str) -> None:
    """Raise :class:`SettingsError` when the setting ``name`` of ``obj`` exceeds its setting ``bound`` (e.g. a
    minimum learning rate above the peak one)."""
    value, limit = getattr(obj, name), getattr(obj, bound)
    if value > limit:
        raise SettingsError(f"{section}.{name} must be at most {section}.{bound} ({limit:g}); got {value:g}")


def read_results(path: Path, keys: tuple[str, ...], kind: str, advice: str) -> dict:
    """The JSON object of results in ``path``; ``ValueError`` naming the file when it is not JSON or lacks one of
    ``keys`` (``kind`` says what it should be, ``advice`` what to do instead)."""
    try:
        results = json.loads(path.read_text())
    except ValueError:
        results = None
    if not isinstance(results, dict) or not set(keys) <= results.keys():
        raise ValueError(f"{path} is not a results file of {kind} (a JSON object of {' and '.join(keys)}); "
                         f"{advice}")
    return results


def check_same_settings(path: Any, recorded: dict, requested: dict, advice: str) -> None:
    """Raise ``ValueError`` unless the settings ``recorded`` with the results in ``path`` equal the ``requested``
    ones (results are reused only for the settings they were made with); the message names each setting that
    differs and ends with ``advice``, what to do instead."""
    differing = [f"{key} {recorded.get(key)!r}, asked for {requested.get(key)!r}"
                 for key in dict.fromkeys([*requested, *recorded]) if recorded.get(key) != requested.get(key)]
    if differing:
        raise ValueError(f"{path} was written with other settings ({'; '.join(differing)}); {advice}")
