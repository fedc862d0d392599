r"""LAVO as the paper states it, one query at a time: the reference the fast forms are tested against.

Zhang et al., *Linear Attention via Orthogonal Memory* (arXiv 2312.11135). Read this file first: :mod:`.blocked`,
:mod:`.decoding` and :mod:`.cross` compute the same numbers without the loops, and the tests compare them on
outputs and gradients. Quadratic in the length; small inputs only.

Shapes: ``q, k, v [B, T, H, D]``; ``basis [H, r, D]``, each head's rows ``b_1 .. b_r`` orthonormal; window length
``w``; ``padding_mask [B, T]`` bool, True for real tokens (padding never enters a mean or a softmax, and padded
positions output zeros). docs/DESIGN.md gives the choices the paper leaves open.
"""
from __future__ import annotations

import torch

from ..common import zero_padding
from ..local.naive import local_attention_naive
from .memory import project

# §3.1 Context compression via orthogonal decomposition --------------------------------------------------------


def coordinates(features: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    r"""``B f``: the coordinates of ``features [B, L, H, D]`` on the basis, ``[B, L, H, r]``."""
    return torch.einsum("blhd,hrd->blhr", features, basis)


def coefficients_of(features: torch.Tensor, basis: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    r"""The memory's coefficients ``H = mean_j B f_j`` over the positions ``j`` where ``selected [B, L]`` holds.

    Returns:
        ``[B, H, r]``; zero where nothing is selected.
    """
    summed = (coordinates(features, basis) * selected[:, :, None, None]).sum(1)
    return summed / selected.sum(1).clamp(min=1)[:, None, None]


def memory_slots(coefficients: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    r"""The orthogonal memory: slot ``i`` is ``H_i b_i``. ``[B, H, r]``, ``[H, r, D]`` -> ``[B, H, r, D]``."""
    return coefficients[..., None] * basis


def read(q_t: torch.Tensor, memory: torch.Tensor, scale: float) -> torch.Tensor:
    r"""A query reads the memory with a softmax over its ``r`` slots, each slot both key and value:
    ``sum_i softmax_i(scale q_t . M_i) M_i``. ``q_t [B, H, D]``, ``memory [B, H, r, D]`` -> ``[B, H, D]``."""
    weights = (scale * torch.einsum("bhd,bhrd->bhr", q_t, memory)).softmax(-1)
    return torch.einsum("bhr,bhrd->bhd", weights, memory)


def memory_read_naive(q: torch.Tensor, coefficients: torch.Tensor, basis: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """:func:`.memory.memory_read` in plain autograd, in its layout and dtypes (no chunks, no hand-written
    backward): ``softmax(scale H (B q)) (H B)``, which is :func:`read` of :func:`memory_slots`."""
    weights = (coefficients * scale * project(q, basis)).softmax(-1)
    return ((weights * coefficients) @ basis.to(coefficients.dtype)).to(q.dtype)


# Memory variants (not in the paper; :mod:`.variants`) ------------------------------------------------------------


def write_weights(features, basis, selected, t, *, memory, decay=None, gate=None):
    r"""Each position's weight in each slot's mean for a memory read at ``t``: ``[B, L, H, r]``.

    1 per selected position (the paper), times ``exp(-decay_h (t - j))`` (``write="decay"``), times
    ``exp(gate_i . f_j)`` (``write="gated"``), times ``softmax_i(B f_j)`` (``memory="vector"``: the position's
    assignment to the slot)."""
    B, L, H, _ = features.shape
    weights = selected[:, :, None, None].to(features.dtype).expand(B, L, H, basis.shape[1])
    if memory == "vector":
        weights = weights * coordinates(features, basis).softmax(-1)
    if gate is not None:
        weights = weights * coordinates(features, gate).exp()
    if decay is not None:
        distance = (t - torch.arange(L, dtype=features.dtype))[None, :, None, None]
        weights = weights * (-decay[None, None, :, None] * distance).exp()
    return weights


def weighted_memory(features, basis, weights, memory):
    r"""The slots: scalar, ``(sum_j w_ji (B f_j)_i / sum_j w_ji) b_i``; vector, ``sum_j w_ji f_j / sum_j w_ji``.
    ``[B, H, r, D]``, zero where no weight."""
    norm = weights.sum(1)  # [B, H, r]
    norm = torch.where(norm > 0, norm, 1)  # no weight: the sums are zero, and so is the slot
    if memory == "vector":
        return torch.einsum("blhr,blhd->bhrd", weights, features) / norm[..., None]
    return memory_slots((weights * coordinates(features, basis)).sum(1) / norm, basis)


# §3.2 Context dissection -------------------------------------------------------------------------------------


def compressed_positions(t: int, length: int, window: int, causal: bool, dissection: bool) -> torch.Tensor:
    r"""``[T]`` bool: the positions whose features the memory of query ``t`` compresses.

    Non-causal: all of them. Causal with dissection: the whole windows before ``t``'s own (``j < (t // w) w``):
    the local branch covers the rest, so the memory holds only finished windows. Causal without: ``j <= t``.
    """
    positions = torch.arange(length)
    if not causal:
        return torch.ones(length, dtype=torch.bool)
    return positions < (t // window) * window if dissection else positions <= t


def lavo_attention_naive(q, k, v, basis, *, window, causal=True, pos_bias=None, dissection=True, padding_mask=None,
                         scale=None, write="mean", memory="scalar", decay=None, gate=None, read_scale=None):
    r"""Reference for :func:`lavo.ops.lavo_attention`: ``o_t = (o_loc_t + o_glb_t) / 2``.

    ``o_loc`` is sliding-window attention with the relative-position bias ``pos_bias`` (§3.2, §3.3; see
    :mod:`lavo.ops.local.naive`). ``o_glb_t`` reads the memory of the features ``f`` at
    :func:`compressed_positions`: with context dissection ``f = o_loc`` (the memory compresses what the local branch
    extracted), without it ``f = v``. Arguments and shapes as in :func:`lavo.ops.lavo_attention`; the memory
    variants (``write``, ``memory``) weigh each position by :func:`write_weights`, and ``read_scale [H]``
    multiplies the queries of the memory read.
    """
    B, T, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    real = torch.ones(B, T, dtype=torch.bool) if padding_mask is None else padding_mask
    q, k, v = zero_padding(real, q, k, v)
    local = local_attention_naive(q, k, v, window=window, causal=causal, pos_bias=pos_bias, padding_mask=real,
                                  scale=scale)
    features = local if dissection else v
    out = torch.zeros_like(q)
    queries = q if read_scale is None else q * read_scale[:, None]
    for t in range(T):
        selected = real & compressed_positions(t, T, window, causal, dissection)
        if (write, memory) == ("mean", "scalar"):
            slots = memory_slots(coefficients_of(features, basis, selected), basis)
        else:
            weights = write_weights(features, basis, selected, t, memory=memory, decay=decay, gate=gate)
            slots = weighted_memory(features, basis, weights, memory)
        out[:, t] = (local[:, t] + read(queries[:, t], slots, scale)) / 2
    return out * real[:, :, None, None]


def code_cross_attention_naive(q, x, basis, *, padding_mask=None, scale=None):
    r"""Reference for :func:`lavo.ops.code_cross_attention`: the memory compresses the whole source
    ``x [B, S, H, D]`` (its real positions) once, and every query ``q [B, Tq, H, D]`` reads it."""
    B, S, H, D = x.shape
    scale = D ** -0.5 if scale is None else scale
    real = torch.ones(B, S, dtype=torch.bool) if padding_mask is None else padding_mask
    (x,) = zero_padding(real, x)
    memory = memory_slots(coefficients_of(x, basis, real), basis)
    return torch.stack([read(q[:, t], memory, scale) for t in range(q.shape[1])], 1)
