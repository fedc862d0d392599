"""ListOps (Nangia & Bowman 2018, as the Long Range Arena uses it): nested list operations to evaluate.

An expression is a digit 0-9 or an operator applied to 2..``max_args`` expressions, written as bracketed
tokens, e.g. ``[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]`` (value 5). The operators:

* ``[MAX``, ``[MIN``: the largest and smallest argument;
* ``[MED``: the median; for an even count the mean of the two middle arguments rounded down (LRA's
  ``int(np.median(x))``);
* ``[SM``: the sum modulo 10.

The target is the value, one of 10 classes. Trees are drawn as LRA draws them: a node below ``max_depth`` is an
operator with probability 1/4 (the root always is), otherwise a digit; the operator and each digit uniform. Only
expressions whose token count lies in ``[min_length, max_length]`` are kept (LRA: 500..2000, depth 10, 10 args).
A split is a pure function of its seed, so train, validation and test sets are reproduced exactly.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .settings import SettingsError, at_least, check_at_most, check_settings, setting

OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
CLOSE = "]"
DIGITS = tuple(str(d) for d in range(10))
PAD = "<pad>"
# token ids: padding 0, then the digits (so digit d is id d + 1), the operators and the closing bracket
VOCAB = (PAD, *DIGITS, *OPERATORS, CLOSE)
TOKEN_ID = {token: i for i, token in enumerate(VOCAB)}
CLASSES = 10
OPERATOR_PROBABILITY = 0.25
SHORTEST = 4  # tokens of the shortest expression, e.g. [MAX 1 2 ]: the root is always an operator


def apply_operator(operator: str, values: list[int]) -> int:
    """The value of ``operator`` on its arguments' values."""
    if operator == "[MAX":
        return max(values)
    if operator == "[MIN":
        return min(values)
    if operator == "[SM":
        return sum(values) % 10
    if operator == "[MED":
        ordered = sorted(values)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) // 2
    raise ValueError(f"unknown operator {operator!r}; operators: {', '.join(OPERATORS)}")


class TooLong(Exception):
    """Raised while drawing a tree as soon as it passes the length limit (the draw is abandoned)."""


@dataclass(frozen=True)
class ListOpsSpec:
    """What a split is drawn from: token-count window, maximum depth and arguments per operator."""

    min_length: int = setting(500, at_least(1))
    max_length: int = setting(2000, at_least(1))
    max_depth: int = setting(10, at_least(1))
    max_args: int = setting(10, at_least(2))

    def __post_init__(self):
        check_settings(self, "listops.spec")
        check_at_most(self, "listops.spec", "min_length", "max_length")
        if self.max_length < SHORTEST:  # every draw would pass the limit: generate() would never end
            raise SettingsError(f"listops.spec.max_length ({self.max_length}) is shorter than any expression can be "
                                f"({SHORTEST} tokens: an operator over two digits): raise max_length")
        if self.min_length > self.longest():  # no draw could ever be long enough: generate() would never end
            raise SettingsError(f"listops.spec.min_length ({self.min_length}) is longer than any expression of "
                                f"depth {self.max_depth} with {self.max_args} arguments per operator can be "
                                f"({self.longest()} tokens): raise max_depth or max_args, or lower min_length")

    def longest(self) -> int:
        """Tokens of the longest expression: the root and every operator below ``max_depth`` with ``max_args``
        arguments."""
        length = 1  # a digit at the deepest level
        for _ in range(max(self.max_depth - 1, 1)):  # the root is an operator even at max_depth 1
            length = 2 + self.max_args * length  # operator, arguments, closing bracket
        return length


def draw_expression(rng: random.Random, spec: ListOpsSpec) -> tuple[list[str], int]:
    """One tree of at most ``spec.max_length`` tokens: ``(tokens, value)``; raises :class:`TooLong` when the
    tree being drawn passes the limit (the caller draws again)."""
    tokens: list[str] = []

    def draw(depth: int) -> int:
        is_operator = depth == 1 or (depth < spec.max_depth and rng.random() < OPERATOR_PROBABILITY)
        if not is_operator:
            digit = rng.randrange(10)
            tokens.append(DIGITS[digit])
            return digit
        operator = rng.choice(OPERATORS)
        tokens.append(operator)
        values = [draw(depth + 1) for _ in range(rng.randint(2, spec.max_args))]
        tokens.append(CLOSE)
        if len(tokens) > spec.max_length:
            raise TooLong
        return apply_operator(operator, values)

    value = draw(1)
    return tokens, value


def generate(count: int, seed: int | str, spec: ListOpsSpec = ListOpsSpec()) -> list[tuple[list[str], int]]:
    """``count`` expressions with ``spec.min_length <= len(tokens) <= spec.max_length``: ``[(tokens, value)]``,
    a pure function of ``(count, seed, spec)``."""
    rng = random.Random(seed)
    examples = []
    while len(examples) < count:
        try:
            tokens, value = draw_expression(rng, spec)
        except TooLong:
            continue
        if len(tokens) >= spec.min_length:
            examples.append((tokens, value))
    return examples


@dataclass
class Split:
    """One split as tensors: ``ids [N, T]`` (right-padded with 0), ``lengths [N]``, ``labels [N]``."""

    ids: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids [b, t], padding_mask [b, t] (True = token), labels [b])`` trimmed to the longest of the batch."""
        width = int(self.lengths[index].max())
        ids = self.ids[index, :width]
        return ids, ids != TOKEN_ID[PAD], self.labels[index]

    def majority_accuracy(self) -> float:
        """Accuracy of always answering the split's most frequent value (the floor a classifier must beat)."""
        return float(torch.bincount(self.labels, minlength=CLASSES).max()) / len(self)


def to_split(examples: list[tuple[list[str], int]]) -> Split:
    lengths = torch.tensor([len(tokens) for tokens, _ in examples])
    ids = torch.zeros(len(examples), int(lengths.max()), dtype=torch.long)
    for row, (tokens, _) in enumerate(examples):
        ids[row, :len(tokens)] = torch.tensor([TOKEN_ID[t] for t in tokens])
    return Split(ids, lengths, torch.tensor([value for _, value in examples]))


def make_splits(sizes: dict[str, int], seed: int, spec: ListOpsSpec = ListOpsSpec()) -> dict[str, Split]:
    """``{name: Split}`` for e.g. ``{"train": 20000, "valid": 1000, "test": 1000}``; each split has its own seed
    derived from ``seed`` and its name, so changing one split's size leaves the others unchanged."""
    return {name: to_split(generate(size, f"listops-{seed}-{name}", spec)) for name, size in sizes.items()}
