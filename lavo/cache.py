"""Decoding caches: what a causal layer keeps to continue a sequence, and the protocol every cache follows."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, TypeVar

import torch

from .ops.common import accumulation_dtype, dtypes_may_differ

C = TypeVar("C", bound="Cache")


def read_only_here(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` was made under ``torch.inference_mode()`` and this code runs outside it, where torch
    refuses to write into it in place. Asked eagerly only (Dynamo does not trace ``is_inference``)."""
    return not torch.compiler.is_compiling() and tensor.is_inference() and not torch.is_inference_mode_enabled()


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
        """The same cache with its tensors on ``device``; its dtypes are what the layer wrote (a cache cannot
        change dtype: masks are bool, and sums may be kept in float32 under other inputs)."""
        if isinstance(device, torch.dtype):
            raise TypeError(f"Cache.to moves a cache to a device, not to {device}: a cache keeps the dtypes its "
                            "layer wrote")
        return _map(self, lambda t: t.to(device))

    def select(self: C, index: torch.Tensor) -> C:
        """The cache of the batch rows ``index`` (a LongTensor ``[B']``), e.g. to reorder or prune beams."""
        return _map(self, lambda t: t.index_select(0, index.to(t.device)))

    def check_batch_size(self, batch: int) -> None:
        if batch != self.batch_size:
            raise ValueError(f"cache was built for batch size {self.batch_size}, got input of batch size {batch}")

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Refuse, outside autocast, inputs of ``dtype`` that this cache cannot continue, by name rather than with
        an op's dtype error (:meth:`~lavo.layers.base.Mechanism.check_call` asks before every continued call). A
        cache whose arithmetic takes any input dtype accepts every one (the default)."""

    def check_sums_dtype(self, sums: torch.Tensor, dtype: torch.dtype) -> None:
        """:meth:`check_dtype` of a cache of running sums, kept in the accumulation dtype of its inputs (float32,
        float64 for float64 inputs): float64 sums and float32 inputs would be narrowed without a word."""
        refuse_wider(sums, "sums", dtype, accumulation_dtype(dtype))


def refuse_wider(held: torch.Tensor, what: str, inputs: torch.dtype, continued_in: torch.dtype) -> None:
    """Refuse, outside autocast, a cache whose ``what`` (``held``) are wider than ``continued_in``, the dtype that
    inputs of dtype ``inputs`` continue it in; a narrower one is widened as the next chunk is added."""
    if torch.promote_types(held.dtype, continued_in) == continued_in or dtypes_may_differ(held.device.type):
        return
    whose = "" if continued_in == inputs else f", whose {what} are {continued_in}"
    raise ValueError(f"the cache holds {held.dtype} {what} and the inputs are {inputs}{whose}: continue it with "
                     "inputs of its dtype, start a new one (layer.empty_cache(B)), or call under torch.autocast")


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


class _Buffers:
    """The preallocated buffers behind a :class:`KVCache`, ``[B, H, capacity, D]`` (the layout
    ``scaled_dot_product_attention`` reads) and a ``[B, capacity]`` mask, and ``end``: how far they have been
    written. The caches that view one buffer share this object, so a cache writes after its positions only when
    nothing was written there since it was made (otherwise it would overwrite what another cache sees)."""

    __slots__ = ("keys", "values", "mask", "end")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, end: int):
        self.keys, self.values, self.mask, self.end = keys, values, mask, end


@dataclass(frozen=True)
class KVCache(Cache):
    r"""Keys and values a causal softmax or sliding-window layer keeps to continue a sequence.

    Appending is amortised ``O(T)`` for ``T`` new positions, whatever the cache's length: the fields are views
    into preallocated buffers, and :meth:`append` writes after them in place when there is room, else moves the
    cached positions into new buffers with room for as many again (``max(L + T, 2L)`` positions), so a cache
    that grows one token at a time is copied ``O(log L)`` times and reserves at most twice what it holds. The
    input cache is never modified: a cache appended to twice (or one made by :meth:`to` or :meth:`select`)
    copies before it writes, and keys or values that need gradients are never written in place.

    Attributes:
        keys, values: ``[B, L, H, D]``, the cached positions ``position - L .. position - 1``.
        key_mask: ``[B, L]`` bool, True for real (non-padding) keys.
        position: tokens seen so far, padding included.
        padded: whether a padding mask came with any appended position (True: ``key_mask`` may hold False).
        rotary: whether the keys are stored rotated by their positions (a rotary softmax layer's); None, as in a
            cache built by hand, fits layers of either kind.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor
    position: int
    padded: bool = False
    rotary: bool | None = None
    buffers: _Buffers | None = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None, rotary: bool | None = None) -> KVCache:
        """The cache before the first token."""
        keys = torch.zeros(batch, 0, heads, head_dim, dtype=dtype, device=device)
        return cls(keys, keys, torch.zeros(batch, 0, dtype=torch.bool, device=device), 0, rotary=rotary)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None, *,
           rotary: bool | None = None) -> KVCache:
        """The cache after a first call's ``k, v [B, T, H, D]``: copies, so that it keeps no projection alive, and
        no buffers (the first append makes them), so that it is built without writing in place (``torch.func``'s
        transforms refuse in-place writes of their batched tensors into plain ones)."""
        mask = torch.ones(k.shape[:2], dtype=torch.bool, device=k.device) if padding_mask is None else padding_mask
        return cls(k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format),
                   mask.clone(), k.shape[1], padding_mask is not None, rotary)

    def _writable_end(self, *new: torch.Tensor) -> int | None:
        """Where this cache's positions end in its buffers when ``new`` may be written after them in place, else
        None."""
        buffers = self.buffers
        if buffers is None or any(t.requires_grad for t in (*new, buffers.keys, buffers.values)):
            return None  # autograd may have saved the buffers: writing into them would change what it saved
        if torch.compiler.is_compiling():
            return None  # Dynamo cannot trace a storage's address; a compiled step copies instead
        if read_only_here(buffers.keys):
            return None
        if self.keys.untyped_storage().data_ptr() != buffers.keys.untyped_storage().data_ptr():
            return None  # a copy (to, select): the views are no longer in these buffers
        end = self.keys.storage_offset() // self.keys.shape[-1] + self.keys.shape[1]
        return end if end == buffers.end else None

    def append(self, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None) -> KVCache:
        """The cache after ``T`` more positions: ``k, v [B, T, H, D]``, ``padding_mask [B, T]`` or None."""
        B, T, H, D = k.shape
        self.check_batch_size(B)
        if self.keys.shape[2:] != (H, D):  # a layer of another head split: else a copy's broadcasting error
            raise ValueError(f"the cache holds keys and values [B, L, H, D] = {tuple(self.keys.shape)}, this call "
                             f"[B, T, H, D] = {tuple(k.shape)}: pass the cache the previous call returned")
        length = self.keys.shape[1]
        end = self._writable_end(k, v)
        buffers = self.buffers
        if end is None or end + T > buffers.keys.shape[2]:
            capacity = max(length + T, 2 * length)
            dtype = torch.promote_types(self.keys.dtype, k.dtype)
            keys = self.keys.new_zeros(B, H, capacity, D, dtype=dtype)
            values = self.values.new_zeros(B, H, capacity, D, dtype=dtype)
            mask = self.key_mask.new_zeros(B, capacity)
            keys[:, :, :length], values[:, :, :length] = self.keys.transpose(1, 2), self.values.transpose(1, 2)
            mask[:, :length] = self.key_mask
            buffers, end = _Buffers(keys, values, mask, length), length
        buffers.keys[:, :, end:end + T] = k.transpose(1, 2)
        buffers.values[:, :, end:end + T] = v.transpose(1, 2)
        buffers.mask[:, end:end + T] = True if padding_mask is None else padding_mask
        buffers.end = end + T
        start = end - length
        return KVCache(buffers.keys[:, :, start:end + T].transpose(1, 2),
                       buffers.values[:, :, start:end + T].transpose(1, 2), buffers.mask[:, start:end + T],
                       self.position + T, self.padded or padding_mask is not None, self.rotary, buffers)

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Wider keys and values than the inputs are refused: the queries would meet keys of another dtype."""
        refuse_wider(self.keys, "keys and values", dtype, dtype)

    def check_rotary(self, rotary: bool) -> None:
        """Refuse a cache whose keys were stored rotated when this layer's are not, or the other way round: the
        scores would mix two position encodings without an error."""
        if self.rotary not in (None, rotary):
            stored = "rotated by their positions (rotary=True)" if self.rotary else "unrotated (rotary=False)"
            raise ValueError(f"the cache holds keys stored {stored}, and this layer has rotary={rotary}: pass the "
                             "cache this layer's previous call returned")

    def keep_last(self, count: int) -> KVCache:
        """The cache of the last ``count`` positions only (views: nothing is copied)."""
        drop = max(0, self.keys.shape[1] - count)
        return replace(self, keys=self.keys[:, drop:], values=self.values[:, drop:], key_mask=self.key_mask[:, drop:])


def in_autocast_dtype(cache: KVCache | LavoCache, dtype: torch.dtype) -> KVCache | LavoCache:
    """``cache`` with its keys and values in ``dtype``, the chunk's, when a cache made outside autocast (float32)
    is continued under it, as autocast casts a float32 tensor that enters a matmul; else ``cache`` itself. The
    ops that continue a cache run with autocast off, so they would meet the two dtypes."""
    if cache.keys.dtype == dtype or not torch.is_autocast_enabled(cache.keys.device.type):
        return cache
    return replace(cache, keys=cache.keys.to(dtype), values=cache.values.to(dtype))


def a_kind(name: str) -> str:
    """``name`` with its indefinite article: "a KVCache", "an ABCCache", "an S4DCache" (an initial said with a
    vowel sound), "a NoneType"."""
    initial = name[:1] in "FHLMNRSX" and (name[1:2].isupper() or name[1:2].isdigit())
    vowel_sound = initial or name[:1] in "AEIOUaeiou"
    return f"{'an' if vowel_sound else 'a'} {name}"


def check_kind(cache: Any, kinds: type[Cache] | tuple[type[Cache], ...], op: str, advice: str) -> None:
    """Refuse, by name, a ``cache`` given to ``op`` (a layer, a model, an op) that is none of ``kinds``: None, a
    tuple, another mechanism's cache or the other of the two LAVO caches, which ``op`` would meet with an
    ``AttributeError`` or read the shapes of wrongly."""
    if not isinstance(cache, kinds):
        names = " or ".join(a_kind(kind.__name__) for kind in (kinds if isinstance(kinds, tuple) else (kinds,)))
        raise ValueError(f"{op} continues {names}, got {a_kind(type(cache).__name__)}: {advice}")


def check_made_by(cache: LavoCache | LavoStepCache, **asked: Any) -> None:
    """Raise ``ValueError`` naming each setting (``window``, ``dissection``, ``write``, ``memory``) that the LAVO
    cache records with another value than ``asked``; a setting it records as None fits any."""
    made = {name: getattr(cache, name) for name in asked}
    differ = [f"{name} {made[name]!r} (this layer: {value!r})" for name, value in asked.items()
              if made[name] not in (None, value)]
    if differ:
        raise ValueError(f"the cache was made by another LAVO layer: {', '.join(differ)}")


# The write rule and memory a LavoCache of the paper's memory records (the layer options of those names).
PAPER_MEMORY = {"write": "mean", "memory": "scalar"}


@dataclass(frozen=True)
class _LavoState(Cache):
    """The fields of both LAVO caches (:class:`LavoCache`, :class:`LavoStepCache`), in either's layout."""

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor
    memory_sum: torch.Tensor
    memory_count: torch.Tensor
    window_sum: torch.Tensor
    window_count: torch.Tensor

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Refuse inputs of another dtype than the cached keys and values outside autocast (under it the two
        mix), by name rather than with an einsum's dtype error."""
        if self.keys.dtype == dtype or dtypes_may_differ(self.keys.device.type):
            return
        raise ValueError(f"the cache holds {self.keys.dtype} keys and values and the inputs are {dtype}: make the "
                         f"cache in the inputs' dtype (LavoCache.empty(..., dtype={dtype})) or call under "
                         "torch.autocast")


@dataclass(frozen=True)
class LavoCache(_LavoState):
    r"""Everything a causal LAVO layer needs to continue a sequence; its size does not grow with context.

    Attributes:
        keys, values: ``[B, L, H, D]`` for the last ``L <= 2w - 1`` positions, from the start of the previous
            window to ``position - 1``: all the local branch can still see.
        key_mask: ``[B, L]`` bool, True for real (non-padding) keys.
        memory_sum: ``[B, H, r]`` float32 (float64 for float64 inputs), sum of the projections over all completed
            windows.
        memory_count: ``[B]`` float32 (float64 for float64 inputs), real tokens in those windows.
        window_sum: ``[B, H, r]``, sum over the current, unfinished window, in the same dtype.
        window_count: ``[B]``, real tokens in it.
        position: tokens seen so far (padding included): fixes window boundaries and relative positions.
        window: the window of the layer that made it (None: not yet tied to one); a layer with another
            window cannot continue it.
        dissection, write, memory: what the memory holds: the layer's settings of those names (None: not yet
            tied to one). The sums of another rule have the same shapes, so a layer with other settings refuses
            the cache by these.
        memory_top, window_top: None for the paper's memory. For the other write rules and the vector memory
            (:mod:`lavo.ops.lavo.variants`) the two memories are weighted sums per slot kept as
            ``(top, sum, count)``: ``*_top [B, H, r, 1]``, ``*_sum [B, H, r, V]`` (``V`` = 1, or ``D`` for the
            vector memory), ``*_count [B, H, r, 1]``, sum and count scaled by ``exp(-top)``.
    """

    position: int
    window: int | None = None
    memory_top: torch.Tensor | None = None
    window_top: torch.Tensor | None = None
    dissection: bool | None = None
    write: str | None = None
    memory: str | None = None

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, rank: int, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None, window: int | None = None,
              dissection: bool | None = None) -> LavoCache:
        """The cache before the first token of the paper's memory, for inputs of ``dtype``; the sums are float32
        (float64 for float64 inputs)."""
        dtype = torch.get_default_dtype() if dtype is None else dtype
        keys = torch.zeros(batch, 0, heads, head_dim, dtype=dtype, device=device)
        memory = torch.zeros(batch, heads, rank, dtype=accumulation_dtype(dtype), device=device)
        count = torch.zeros(batch, dtype=memory.dtype, device=device)
        return cls(keys, keys, torch.zeros(batch, 0, dtype=torch.bool, device=device), memory, count, memory.clone(),
                   count.clone(), 0, window, dissection=dissection, **PAPER_MEMORY)

    def check_fits(self, batch: int, heads: int, head_dim: int, rank: int, **settings: Any) -> None:
        """Raise ``ValueError`` naming what differs when this cache was not made by a layer of this shape and
        these ``settings`` (``window``, ``dissection``, ``write``, ``memory``: see :func:`check_made_by`)."""
        self.check_batch_size(batch)
        shapes = {"heads": (self.keys.shape[2], heads), "head_dim": (self.keys.shape[3], head_dim),
                  "rank": (self.memory_sum.shape[2], rank)}
        differ = [f"{name} {made} (this layer: {asked})" for name, (made, asked) in shapes.items() if made != asked]
        if differ:
            raise ValueError(f"the cache was made by another LAVO layer: {', '.join(differ)}")
        check_made_by(self, **settings)

    @classmethod
    def empty_variant(cls, batch: int, heads: int, head_dim: int, rank: int, *, memory: str = "scalar",
                      dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                      window: int | None = None, write: str | None = None) -> LavoCache:
        """The cache before the first token of a memory variant (any write rule but the paper's ``mean``, or
        ``memory="vector"``; ``write`` None: any write rule)."""
        dtype = torch.get_default_dtype() if dtype is None else dtype
        keys = torch.zeros(batch, 0, heads, head_dim, dtype=dtype, device=device)
        slots = torch.zeros(batch, heads, rank, 1, dtype=accumulation_dtype(dtype), device=device)
        top = torch.full_like(slots, torch.finfo(slots.dtype).min)
        total = slots.expand(-1, -1, -1, head_dim if memory == "vector" else 1).clone()
        return cls(keys, keys, torch.zeros(batch, 0, dtype=torch.bool, device=device), total, slots, total.clone(),
                   slots.clone(), 0, window=window, memory_top=top, window_top=top.clone(), dissection=True,
                   write=write, memory=memory)

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


@dataclass(frozen=True)
class LavoStepCache(_LavoState):
    r"""A :class:`LavoCache` in a fixed layout that a one-token step updates in place (:mod:`lavo.ops.lavo.step`):
    its tensors never change shape or address, and the position lives on the device, so the same step can be
    captured once in a CUDA graph and replayed for every token.

    The keys sit in a ring of two windows: position ``j`` at slot ``j mod 2w``, so the previous and the current
    window, all a query can see, are always held, and a new window overwrites the one nobody sees any more.
    Sums and counts are kept per (batch, head), so a step's programs (one per batch row and head) each own theirs.

    A step consumes the cache: the one it returns shares the tensors, and only that one continues the sequence.

    Attributes:
        keys, values: ``[B, H, 2w, D]``, the ring.
        key_mask: ``[B, 2w]`` bool, True for a real key in that slot (False also for a slot never written).
        memory_sum, window_sum: ``[B, H, r]`` float32 (float64 for float64 inputs), as in :class:`LavoCache`.
        memory_count, window_count: ``[B, H]``, the same count for every head of a row.
        steps: ``[B, H]`` int64, the position each (batch, head) continues from: what the step reads and
            advances: rows may continue from different positions (all the same when made by :meth:`from_cache`).
        position: tokens seen when this cache was returned.
        window: the window of the layer that made it.
        dissection: whether the memory holds the local outputs (True) or the values; None: either.
    """

    steps: torch.Tensor
    position: int
    window: int
    dissection: bool | None = None

    @classmethod
    def from_cache(cls, cache: LavoCache, window: int) -> LavoStepCache:
        """The same state in the ring layout (new tensors: ``cache`` stays valid)."""
        if cache.memory_top is not None:
            raise ValueError("a LavoStepCache holds the paper's memory; a memory variant decodes through LavoCache")
        check_made_by(cache, window=window)
        B, length, H, D = cache.keys.shape
        span = 2 * window
        slots = torch.arange(cache.position - length, cache.position, device=cache.keys.device) % span
        keys = cache.keys.new_zeros(B, H, span, D)
        values = cache.values.new_zeros(B, H, span, D)
        key_mask = cache.key_mask.new_zeros(B, span)
        keys[:, :, slots], values[:, :, slots] = cache.keys.transpose(1, 2), cache.values.transpose(1, 2)
        key_mask[:, slots] = cache.key_mask
        per_head = cache.memory_sum.shape[:2]
        steps = torch.full(per_head, cache.position, dtype=torch.int64, device=keys.device)
        memory_sum, window_sum, memory_count, window_count = (
            x.expand(*per_head, -1).clone(memory_format=torch.contiguous_format)
            for x in (cache.memory_sum, cache.window_sum, cache.memory_count[:, None, None],
                      cache.window_count[:, None, None]))
        memory_count, window_count = memory_count[..., 0], window_count[..., 0]
        return cls(keys, values, key_mask, memory_sum, memory_count, window_sum, window_count, steps, cache.position,
                   window, cache.dissection)
