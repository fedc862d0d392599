"""LAVO self-attention and cross-attention layers."""
from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from ..cache import LavoCache, LavoStepCache, check_made_by, in_autocast_dtype
from ..ops import code_cross_attention, lavo_attention, lavo_attention_cached, lavo_decode_step, orthogonal_basis
from ..ops.common import check_backend, check_positive, check_switches, check_window
from ..ops.lavo.variants import check_triton_computes, check_variant, is_variant
from .base import AttentionLayer, CrossAttentionLayer, add_initialised
from .local import add_position_bias
from .orthonormal import register_orthonormal


def add_basis(module: nn.Module, heads: int, rank: int, head_dim: int, kind: str) -> None:
    """Give ``module.basis [H, r, D]``: a fixed random buffer, or a parameter kept exactly orthonormal."""
    if kind not in ("fixed", "learned"):
        raise ValueError(f"basis must be 'fixed' or 'learned', got {kind!r}")
    check_positive(type(module).__name__, rank=rank)
    add_initialised(module, "basis", partial(orthogonal_basis, heads, rank, head_dim), buffer=kind == "fixed")
    if kind == "learned":
        register_orthonormal(module, "basis")


def initial_log_decay(heads: int, window: int) -> torch.Tensor:
    """``[H]``: the log decay rates of half-lives from ``w`` to ``64 w``, geometric over the heads."""
    half_lives = window * 64.0 ** (torch.arange(heads) / max(1, heads - 1))
    return (math.log(2) / half_lives).log()


def learned_basis(module: nn.Module) -> list[nn.Parameter]:
    """The unconstrained parameter behind a learned basis (empty for a fixed one): an orthogonal matrix has
    unit norm, so decaying it only fights the parametrisation."""
    if not hasattr(module, "parametrizations"):
        return []
    return [module.parametrizations["basis"].original]


class LavoAttention(AttentionLayer):
    r"""LAVO self-attention: local windows with a relative-position bias, plus an orthogonal memory of ``rank``
    slots per head over the local outputs (context dissection).

    ``forward(x [B, T, dim], padding_mask [B, T] | None, cache | None) -> (y [B, T, dim], cache)``; for causal
    layers the returned :class:`~lavo.cache.LavoCache` continues the sequence, whatever the chunking.

    Memory variants (:mod:`lavo.ops.lavo.variants`; the defaults are the paper's): ``write="decay"`` learns a
    decay rate per head (half-lives initialised from ``w`` to ``64 w``, geometric over the heads);
    ``write="gated"`` learns the write gates ``[H, r, D]`` (initialised to zero: the plain mean);
    ``memory="vector"`` keeps a ``D``-vector per slot; ``read_temperature=True`` learns a factor per head on the
    memory read's logits (initialised to 1).
    """

    cache_types = (LavoCache, LavoStepCache)
    absolute_positions = True

    def __init__(self, dim: int, heads: int, *, rank: int | None = None, window: int = 64, causal: bool = True,
                 basis: str = "fixed", position_bias: bool = True, dissection: bool = True, write: str = "mean",
                 memory: str = "scalar", read_temperature: bool = False, backend: str = "auto"):
        super().__init__(dim, heads, causal=causal)
        check_window(window)
        check_backend(backend)
        check_switches("LavoAttention", position_bias=position_bias, dissection=dissection,
                       read_temperature=read_temperature)
        self.backend = backend
        self.rank = self.head_dim if rank is None else rank
        self.window, self.dissection, self.write, self.memory = window, dissection, write, memory
        add_basis(self, heads, self.rank, self.head_dim, basis)
        add_position_bias(self, heads, window, causal, position_bias)
        self.log_decay = self.write_gate = self.log_read_scale = None
        if write == "decay":  # log of the decay rate per position, [H]
            add_initialised(self, "log_decay", partial(initial_log_decay, heads, window))
        if write == "gated":
            add_initialised(self, "write_gate", partial(torch.zeros, heads, self.rank, self.head_dim))
        if read_temperature:
            add_initialised(self, "log_read_scale", partial(torch.zeros, heads))
        check_variant(write, memory, causal, dissection, self.log_decay, self.write_gate, heads, self.rank,
                      self.head_dim)
        check_triton_computes(backend, is_variant(write, memory) or read_temperature)

    @property
    def is_variant(self) -> bool:
        """Whether the memory is one of the variants rather than the paper's (the read temperature aside)."""
        return is_variant(self.write, self.memory)

    def attend(self, q, k, v, padding_mask, cache):
        options = dict(window=self.window, pos_bias=self.pos_bias, dissection=self.dissection,
                       padding_mask=padding_mask)
        if self.is_variant:
            options.update(write=self.write, memory=self.memory, gate=self.write_gate,
                           decay=None if self.log_decay is None else self.log_decay.exp())
        if self.log_read_scale is not None:
            options["read_scale"] = self.log_read_scale.exp()
        if isinstance(cache, LavoStepCache):
            return self._steps(q, k, v, padding_mask, cache, options)
        if cache is not None:
            return lavo_attention_cached(q, k, v, self.basis, in_autocast_dtype(cache, q.dtype), **options)
        if self.causal:
            return lavo_attention(q, k, v, self.basis, causal=True, return_cache=True, backend=self.backend,
                                  **options)
        return lavo_attention(q, k, v, self.basis, causal=False, backend=self.backend, **options), None

    def _steps(self, q, k, v, padding_mask, cache: LavoStepCache, options: dict):
        """The positions of ``q, k, v`` one decoding step each, on the fixed-layout cache."""
        if self.is_variant:
            raise ValueError("a LavoStepCache holds the paper's memory; this layer's memory variant decodes through "
                             "LavoCache")
        check_made_by(cache, window=self.window)
        # a step takes its window from the cache, and the padding of its own position
        step_options = {name: value for name, value in options.items() if name not in ("window", "padding_mask")}
        outputs = []
        for t in range(q.shape[1]):
            mask = None if padding_mask is None else padding_mask[:, t:t + 1]
            out, cache = lavo_decode_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], self.basis, cache,
                                          padding_mask=mask, backend=self.backend, **step_options)
            outputs.append(out)
        return torch.cat(outputs, 1), cache

    @property
    def has_step_layout(self) -> bool:
        """The paper's memory has one (:class:`~lavo.cache.LavoStepCache`); the variants continue their
        :class:`~lavo.cache.LavoCache`."""
        return not self.is_variant

    def _step_cache(self, cache: LavoCache | LavoStepCache) -> LavoStepCache:
        """A :class:`~lavo.cache.LavoStepCache` (a step cache itself as it is)."""
        check_made_by(cache, window=self.window, dissection=self.dissection)
        if isinstance(cache, LavoStepCache):
            return cache
        return LavoStepCache.from_cache(cache, self.window)

    def _new_cache(self, batch_size: int, *, device: torch.device | str, dtype: torch.dtype) -> LavoCache:
        if self.is_variant:
            return LavoCache.empty_variant(batch_size, self.heads, self.head_dim, self.rank, memory=self.memory,
                                           device=device, dtype=dtype, window=self.window, write=self.write)
        return LavoCache.empty(batch_size, self.heads, self.head_dim, self.rank, device=device, dtype=dtype,
                               window=self.window, dissection=self.dissection)

    def no_weight_decay(self) -> list[nn.Parameter]:
        return learned_basis(self) + ([self.pos_bias] if self.pos_bias is not None else [])

    def cache_nbytes(self, batch_size: int, context: int, dtype: torch.dtype = torch.float32) -> int:
        return LavoCache.max_nbytes(batch_size, self.heads, self.head_dim, self.rank, self.window, dtype,
                                    variant=self.memory if self.is_variant else None)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.heads}, rank={self.rank}, window={self.window}, causal={self.causal}, "
                f"position_bias={self.pos_bias is not None}, dissection={self.dissection}, write={self.write!r}, "
                f"memory={self.memory!r}, read_temperature={self.log_read_scale is not None}, "
                f"backend={self.backend!r}")


class LavoCrossAttention(CrossAttentionLayer):
    r"""LAVO cross attention: the source is compressed into ``rank`` orthogonal slots per head, read by ``y``.

    ``forward(y [B, Tq, dim], source [B, S, dim], source_padding_mask [B, S] | None,
    query_padding_mask [B, Tq] | None) -> [B, Tq, dim]``; the source has one projection per head (the features
    written into the memory). Invariant to permuting the source: the memory is a mean over it.
    """

    def __init__(self, dim: int, heads: int, *, rank: int | None = None, basis: str = "fixed",
                 backend: str = "auto"):
        super().__init__(dim, heads, source_projections=1)
        check_backend(backend)
        self.backend = backend
        self.rank = self.head_dim if rank is None else rank
        add_basis(self, heads, self.rank, self.head_dim, basis)

    def attend(self, q, x, source_padding_mask):
        return code_cross_attention(q, x, self.basis, padding_mask=source_padding_mask, backend=self.backend)
