"""Decoding caches: what a causal layer keeps to continue a sequence, and the protocol every cache follows."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, TypeVar

import torch

from .ops.common import accumulation_dtype

C = TypeVar("C", bound="Cache")


class Cache:
    r"""Base of every cache: a frozen dataclass with a ``position: int`` field (tokens seen, padding included)
    whose tensors all have the batch first. A field may also hold caches, or a list or tuple of them (a model's
    cache holds one per layer). Each cache class also has an ``empty(...)`` classmethod: the cache before the
    first token.
    """

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds, through nested caches."""
        return _tensors(self)

    @property
    def batch_size(self) -> int:
        return self.tensors()[0].shape[0]

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self: C, device: torch.device | str) -> C:
        """The same cache with its tensors on ``device``."""
        return _map(self, lambda t: t.to(device))

    def select(self: C, index: torch.Tensor) -> C:
        """The cache of the batch rows ``index`` (a LongTensor ``[B']``), e.g. to reorder or prune beams."""
        return _map(self, lambda t: t.index_select(0, index.to(t.device)))

    def check_batch_size(self, batch: int) -> None:
        if batch != self.batch_size:
            raise ValueError(f"cache was built for batch size {self.batch_size}, got input of batch size {batch}")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Cache):
        value = [getattr(value, f.name) for f in fields(value)]
    if isinstance(value, (list, tuple)):
        return [t for part in value for t in _tensors(part)]
    return []


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to each of its tensors, keeping every type."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Cache):
        return replace(value, **{f.name: _map(getattr(value, f.name), fn) for f in fields(value)})
    if isinstance(value, (list, tuple)):
        return type(value)(_map(part, fn) for part in value)
    return value


@dataclass(frozen=True)
class KVCache(Cache):
    r"""Keys and values a causal softmax or sliding-window layer keeps to continue a sequence.

    Attributes:
        keys, values: ``[B, L, H, D]``, the cached positions ``position - L .. position - 1``.
        key_mask: ``[B, L]`` bool, True for real (non-padding) keys.
        position: tokens seen so far, padding included.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor
    position: int

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> KVCache:
        """The cache before the first token."""
        keys = torch.zeros(batch, 0, heads, head_dim, dtype=dtype, device=device)
        return cls(keys, keys, torch.zeros(batch, 0, dtype=torch.bool, device=device), 0)

    def append(self, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None) -> KVCache:
        """The cache after ``T`` more positions: ``k, v [B, T, H, D]``, ``padding_mask [B, T]`` or None."""
        B, T = k.shape[:2]
        self.check_batch_size(B)
        real = torch.ones(B, T, dtype=torch.bool, device=k.device) if padding_mask is None else padding_mask
        return KVCache(torch.cat([self.keys, k], 1), torch.cat([self.values, v], 1),
                       torch.cat([self.key_mask, real], 1), self.position + T)


@dataclass(frozen=True)
class LavoCache(Cache):
    r"""Everything a causal LAVO layer needs to continue a sequence; its size does not grow with context.

    Attributes:
        keys, values: ``[B, L, H, D]`` for the last ``L <= 2w - 1`` positions, from the start of the previous
            window to ``position - 1``: all the local branch can still see.
        key_mask: ``[B, L]`` bool, True for real (non-padding) keys.
        memory_sum: ``[B, H, r]`` float32, sum of the projections over all completed windows.
        memory_count: ``[B]`` float32, real tokens in those windows.
        window_sum: ``[B, H, r]`` float32, sum over the current, unfinished window.
        window_count: ``[B]`` float32, real tokens in it.
        position: tokens seen so far (padding included): fixes window boundaries and relative positions.
        memory_top, window_top: None for the paper's memory. For the other write rules and the vector memory
            (:mod:`lavo.ops.lavo.variants`) the two memories are weighted sums per slot kept as
            ``(top, sum, count)``: ``*_top [B, H, r, 1]``, ``*_sum [B, H, r, V]`` (``V`` = 1, or ``D`` for the
            vector memory), ``*_count [B, H, r, 1]``, sum and count scaled by ``exp(-top)``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor
    memory_sum: torch.Tensor
    memory_count: torch.Tensor
    window_sum: torch.Tensor
    window_count: torch.Tensor
    position: int
    memory_top: torch.Tensor | None = None
    window_top: torch.Tensor | None = None

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, rank: int, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> LavoCache:
        """The cache before the first token, for inputs of ``dtype``; the sums are float32 (float64 for
        float64 inputs)."""
        dtype = torch.get_default_dtype() if dtype is None else dtype
        keys = torch.zeros(batch, 0, heads, head_dim, dtype=dtype, device=device)
        memory = torch.zeros(batch, heads, rank, dtype=accumulation_dtype(dtype), device=device)
        count = torch.zeros(batch, dtype=memory.dtype, device=device)
        return cls(keys, keys, torch.zeros(batch, 0, dtype=torch.bool, device=device), memory, count, memory, count, 0)

    @classmethod
    def empty_variant(cls, batch: int, heads: int, head_dim: int, rank: int, *, memory: str = "scalar",
                      dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> LavoCache:
        """The cache before the first token of a memory variant (any write rule but the paper's ``mean``, or
        ``memory="vector"``)."""
        dtype = torch.get_default_dtype() if dtype is None else dtype
        keys = torch.zeros(batch, 0, heads, head_dim, dtype=dtype, device=device)
        slots = torch.zeros(batch, heads, rank, 1, dtype=accumulation_dtype(dtype), device=device)
        top = torch.full_like(slots, torch.finfo(slots.dtype).min)
        total = slots.expand(-1, -1, -1, head_dim if memory == "vector" else 1).clone()
        return cls(keys, keys, torch.zeros(batch, 0, dtype=torch.bool, device=device), total, slots, total, slots, 0,
                   memory_top=top, window_top=top)

    @staticmethod
    def max_nbytes(batch: int, heads: int, head_dim: int, rank: int, window: int,
                   dtype: torch.dtype = torch.float32, *, variant: str | None = None) -> int:
        """Upper bound of ``nbytes()`` for any context length and input ``dtype``: ``2w - 1`` cached keys
        and values of ``dtype`` with their bool mask, and two memories in the accumulation dtype: a sum and a
        count each for the paper's memory (``variant=None``), ``(top, sum, count)`` per slot for
        ``variant="scalar"`` or ``"vector"`` (the other write rules and the vector memory)."""
        length = 2 * window - 1
        element = torch.empty((), dtype=dtype).element_size()
        accumulated = torch.empty((), dtype=accumulation_dtype(dtype)).element_size()
        if variant is None:
            memories = batch * heads * rank + batch
        else:
            memories = batch * heads * rank * ((head_dim if variant == "vector" else 1) + 2)
        return 2 * batch * length * heads * head_dim * element + batch * length + 2 * accumulated * memories
