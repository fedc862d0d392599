r"""Memory variants of LAVO: other write rules and a vector memory, as weighted means with a stable state.

The paper's memory (``write="mean"``, ``memory="scalar"``) is :mod:`.blocked` and :mod:`.decoding`; this module
computes every other combination. Each is a weighted mean, per slot ``i``, over the compressed positions ``j``:

* ``write="mean"``: weight 1; ``write="decay"``: ``exp(-gamma_h (s - j))`` for a memory read at ``s`` (a learned
  rate per head); ``write="gated"``: ``exp(a_i . f_j)`` (a learned ``gate [H, r, D]``), so one important token is
  not diluted by ``T`` fillers.
* ``memory="scalar"``: slot ``i`` keeps the weighted mean of ``(B f_j)_i`` and is read as in the paper.
  ``memory="vector"``: slot ``i`` keeps a ``D``-vector, the weighted mean of ``f_j`` with the write weight times
  ``softmax_i(B f_j)`` (the feature's assignment to the slot, as in ABC's bounded memory); a query reads it with
  ``softmax_i(scale q . M_i)``, each slot both key and value.

All weights are kept as logits. A state is ``(top, total, norm)``, ``[..., r, 1]``, ``[..., r, V]``,
``[..., r, 1]`` with ``V = 1`` (scalar) or ``D`` (vector): the weighted sum and the sum of weights, both scaled by
``exp(-top)`` where ``top`` is the largest logit merged so far, so nothing overflows and ``norm >= 1`` once a real
token is in. Decay logits are counted from a reference position (a window's start), which a merge moves, so they
stay bounded at any length. ``top`` is a reference only (the mean does not depend on it) and carries no gradient.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..common import neg_inf
from .memory import memory_read, project

WRITES = ("mean", "decay", "gated")
MEMORIES = ("scalar", "vector")


class SlotState(NamedTuple):
    """A weighted sum over positions, per slot: ``top [..., r, 1]``, ``total [..., r, V]``, ``norm [..., r, 1]``."""

    top: torch.Tensor
    total: torch.Tensor
    norm: torch.Tensor

    def mean(self) -> torch.Tensor:
        """The weighted mean ``[..., r, V]``; zero for a slot nothing was written to."""
        # norm >= 1 when anything was written (its top weighs 1), and is often exactly 1, so a clamp at 1 would
        # decide the gradient: torch 2.14 gives none at a clamp's bound (2.13 all of it). Only empty slots
        # (norm 0, total 0) divide by 1 instead.
        return self.total / torch.where(self.norm > 0, self.norm, 1.0)


def is_variant(write: str, memory: str) -> bool:
    """Whether ``write`` and ``memory`` ask for a memory other than the paper's (a mean of scalar coordinates)."""
    return (write, memory) != ("mean", "scalar")


def check_triton_computes(backend: str, variant: bool) -> None:
    """Refuse ``backend="triton"`` for a memory variant or a read temperature (``variant``): only the torch path
    computes them."""
    if variant and backend == "triton":
        raise ValueError("backend='triton' computes the paper's memory only (write='mean', memory='scalar', no "
                         "read temperature); use backend='torch' or 'auto' for the variants")


def check_variant(write: str, memory: str, causal: bool, dissection: bool, decay: torch.Tensor | None,
                  gate: torch.Tensor | None, heads: int, rank: int, head_dim: int) -> None:
    """Raise on an unknown write rule or memory, or a parameter that does not match it."""
    if write not in WRITES:
        raise ValueError(f"write must be one of {WRITES}, got {write!r}")
    if memory not in MEMORIES:
        raise ValueError(f"memory must be one of {MEMORIES}, got {memory!r}")
    if is_variant(write, memory) and not dissection:
        raise ValueError(f"write={write!r}, memory={memory!r} needs dissection=True: the variants compress whole "
                         "earlier windows only")
    if write == "decay" and not causal:
        raise ValueError("write='decay' weighs positions by their distance from the query's past; it has no "
                         "non-causal form")
    if (decay is not None) != (write == "decay"):
        raise ValueError(f"decay [H] goes with write='decay' and only with it (write={write!r})")
    if (gate is not None) != (write == "gated"):
        raise ValueError(f"gate [H, r, D] goes with write='gated' and only with it (write={write!r})")
    if decay is not None and tuple(decay.shape) != (heads,):
        raise ValueError(f"decay must have shape [H] = ({heads},), got {tuple(decay.shape)}")
    if gate is not None and tuple(gate.shape) != (heads, rank, head_dim):
        raise ValueError(f"gate must have shape [H, r, D] = {(heads, rank, head_dim)}, got {tuple(gate.shape)}")


def write_logits(features: torch.Tensor, basis: torch.Tensor, memory: str, decay: torch.Tensor | None,
                 gate: torch.Tensor | None, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Per position and slot, the write logit and what is written.

    Args:
        features: ``[..., H, L, D]``.
        offsets: ``[L]``, each position's distance after the reference position (decay logits grow with it).
    Returns:
        logits ``[..., H, L, r]`` and values ``[..., H, L, r]`` (scalar: the coordinates ``B f``) or
        ``[..., H, L, D]`` (vector: the features), in the accumulation dtype.
    """
    coordinates = project(features, basis)
    logits = torch.zeros_like(coordinates)
    if memory == "vector":
        logits = logits + coordinates.log_softmax(-1)
    if gate is not None:
        logits = logits + project(features, gate)
    if decay is not None:
        logits = logits + decay.to(logits.dtype)[:, None, None] * offsets.to(logits.dtype)[:, None]
    values = coordinates if memory == "scalar" else features.to(coordinates.dtype)
    return logits, values


def summarise(logits: torch.Tensor, values: torch.Tensor, real: torch.Tensor, memory: str) -> SlotState:
    r"""The state of ``L`` positions: ``logits [..., L, r]``, ``values`` as from :func:`write_logits`,
    ``real [..., 1, L, 1]`` (1 for real tokens, 0 for padding)."""
    logits = logits.masked_fill(real == 0, neg_inf(logits.dtype))
    top = logits.amax(-2, keepdim=True).detach()
    # A window of padding only has top = neg_inf: its exponents are 0, and `real` zeroes them.
    weights = (logits - top).exp() * real  # [..., L, r]
    if memory == "scalar":
        total = (weights * values).sum(-2)[..., None]  # [..., r, 1]
    else:
        total = weights.transpose(-1, -2) @ values  # [..., r, D]
    return SlotState(top.transpose(-1, -2), total, weights.sum(-2)[..., None])


def merge(earlier: SlotState, later: SlotState, shift: torch.Tensor | float) -> SlotState:
    r"""The state of ``earlier``'s positions followed by ``later``'s. ``shift`` (broadcastable to ``top``) is how
    much the decay logits of ``earlier`` drop when its reference position moves to ``later``'s."""
    moved = (earlier.top - shift).clamp(min=neg_inf(earlier.top.dtype))
    top = torch.maximum(moved, later.top).detach()
    keep_earlier, keep_later = (moved - top).exp(), (later.top - top).exp()
    return SlotState(top, keep_earlier * earlier.total + keep_later * later.total,
                     keep_earlier * earlier.norm + keep_later * later.norm)


def rows(state: SlotState, index: slice | int) -> SlotState:
    """The entries ``index`` of dim 0 of each field."""
    return SlotState(*(x[index] for x in state))


def empty_state(like: torch.Tensor, value_dim: int) -> SlotState:
    """The state of no positions, shaped as ``like [..., r, 1]`` with ``value_dim`` values per slot."""
    top = torch.full_like(like, neg_inf(like.dtype))
    return SlotState(top, torch.zeros(*like.shape[:-1], value_dim, dtype=like.dtype, device=like.device),
                     torch.zeros_like(like))


def head_shift(decay: torch.Tensor | None, distance: int) -> torch.Tensor | float:
    """How much decay logits drop over ``distance`` positions, ``[H, 1, 1]`` (0 without decay)."""
    return 0.0 if decay is None else (decay * distance)[:, None, None]


def scan_windows(states: SlotState, decay: torch.Tensor | None, window: int) -> SlotState:
    r"""Inclusive scan over dim 0 of per-window states (each referenced to its window's start): entry ``c`` is the
    state of windows ``0..c``, referenced to window ``c``'s start. ``log2(n)`` vectorised merges."""
    step = 1
    while step < states.top.shape[0]:
        earlier, later = rows(states, slice(None, -step)), rows(states, slice(step, None))
        merged = merge(earlier, later, head_shift(decay, step * window))
        states = SlotState(*(torch.cat([x[:step], m]) for x, m in zip(states, merged)))
        step *= 2
    return states


def read_variant(q: torch.Tensor, means: torch.Tensor, basis: torch.Tensor, scale: float, memory: str) -> torch.Tensor:
    r"""Read the memory: ``q [..., H, L, D]``, ``means [..., H, r, V]`` (broadcast over ``L``) -> ``[..., H, L, D]``.

    Scalar: the paper's read of the coefficients ``means[..., 0]``. Vector: ``softmax_i(scale q . M_i) M_i``."""
    if memory == "scalar":
        return memory_read(q, means.transpose(-1, -2), basis, scale)
    weights = (scale * q.to(means.dtype) @ means.transpose(-1, -2)).softmax(-1)  # in the accumulation dtype
    return (weights @ means).to(q.dtype)


def variant_memory_branch(q: torch.Tensor, features: torch.Tensor, counts: torch.Tensor, basis: torch.Tensor,
                          scale: float, causal: bool, memory: str, decay: torch.Tensor | None,
                          gate: torch.Tensor | None) -> tuple[torch.Tensor, SlotState, SlotState]:
    r"""The memory branch of a variant on blocks (dissection): ``q, features [n, B, H, w, D]``, ``counts
    [n, B, 1, w, 1]`` -> (read-out ``[n, B, H, w, D]``, the per-window states referenced to their windows' starts,
    and their inclusive scan (windows ``0..c`` at ``c``)."""
    window = q.shape[3]
    offsets = torch.arange(window, device=q.device)
    logits, values = write_logits(features, basis, memory, decay, gate, offsets)
    windows = summarise(logits, values, counts.to(logits.dtype), memory)  # each [n, B, H, r, .]
    upto = scan_windows(windows, decay, window)
    if not causal:
        means = rows(upto, slice(-1, None)).mean()
    else:  # the memory of window c holds windows 0..c-1
        first = empty_state(upto.top[:1], upto.total.shape[-1])
        means = SlotState(*(torch.cat([f, x[:-1]]) for f, x in zip(first, upto))).mean()
    return read_variant(q, means, basis, scale, memory), windows, upto
