r"""One LAVO decoding step as one Triton kernel: the ``"triton"`` backend of :func:`.step.lavo_decode_step`.

A program per (batch row, head) does the whole step in registers: it reads the ``2w`` ring slots of its keys and
values (``[2w, D]`` tiles; one query needs no tensor cores, so the products are broadcast sums), puts the new key
and value in their slot in registers, takes the local softmax with the relative-position bias, projects the
result onto the basis, reads the memory (a softmax over the ``r`` slots), writes the average, and stores the new
key and value, the running sums and its advanced position. Every program owns what it writes (row ``b``'s key
mask is written by head 0 only, and read from registers for the new slot by every head), so no two programs
race. The position comes from the cache, never from the host: the launch is the same at every step, and the
whole step can be replayed from a CUDA graph. Its cost is ``O(w D + r D)`` whatever the context.

Importing this module defines the kernel, so ``TRITON_INTERPRET`` must be set before it is first imported.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from ...cache import LavoStepCache
from ..common import launching_on

# Scores of keys out of reach: finite, so a row without any real key gets uniform weights (zeroed later) and no NaN.
HIDDEN = tl.constexpr(-1.0e30)


@triton.jit
def _step(Q, K, V, REAL, BASIS, BIAS, READ_SCALE, RING_K, RING_V, KEY_MASK, MEMORY_SUM, MEMORY_COUNT, WINDOW_SUM,
          WINDOW_COUNT, STEPS, OUT, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, heads, window,
          head_dim, rank, scale, HAS_BIAS: tl.constexpr, HAS_READ_SCALE: tl.constexpr, DISSECTION: tl.constexpr,
          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // heads, bh % heads
    span = 2 * window
    position = tl.load(STEPS + bh)
    new_slot = position % span
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    in_d = d < head_dim
    in_ring = s < span
    real = tl.load(REAL + b) != 0
    q = tl.load(Q + b * stride_qb + h * stride_qh + d, mask=in_d, other=0.0).to(tl.float32)
    k_new = tl.load(K + b * stride_kb + h * stride_kh + d, mask=in_d, other=0.0)
    v_new = tl.load(V + b * stride_vb + h * stride_vh + d, mask=in_d, other=0.0)

    # Local attention over the ring, the new key in its slot.
    ring = (bh * span + s[:, None]) * head_dim + d[None, :]
    tile = in_ring[:, None] & in_d[None, :]
    is_new = (s == new_slot)[:, None]
    keys = tl.where(is_new, k_new[None, :], tl.load(RING_K + ring, mask=tile, other=0.0)).to(tl.float32)
    values = tl.where(is_new, v_new[None, :], tl.load(RING_V + ring, mask=tile, other=0.0)).to(tl.float32)
    key_real = tl.where(s == new_slot, real, tl.load(KEY_MASK + b * span + s, mask=in_ring, other=0) != 0)
    offset = (position - s + span) % span  # how far back the slot's position is
    first_seen = tl.maximum((position // window - 1) * window, 0)
    visible = in_ring & key_real & (position - offset >= first_seen)
    scores = tl.sum(keys * q[None, :], 1) * scale
    if HAS_BIAS:
        scores += tl.load(BIAS + h * span + offset, mask=in_ring, other=0.0).to(tl.float32)
    scores = tl.where(visible, scores, HIDDEN)
    weights = tl.exp(scores - tl.max(scores, 0))
    weights = tl.where(in_ring, weights, 0.0)
    local = tl.sum(weights[:, None] * values, 0) / tl.sum(weights, 0)  # [BLOCK_D]

    # The memory: this token's projection, the coefficients it reads, the read.
    r = tl.arange(0, BLOCK_R)
    in_r = r < rank
    basis = tl.load(BASIS + (h * rank + r[:, None]) * head_dim + d[None, :], mask=in_r[:, None] & in_d[None, :],
                    other=0.0).to(tl.float32)
    count = tl.where(real, 1.0, 0.0)
    if DISSECTION:
        written = local
    else:
        written = v_new.to(tl.float32)
    proj = tl.sum(basis * written[None, :], 1) * count  # [BLOCK_R]
    slots = bh * rank + r
    memory_sum = tl.load(MEMORY_SUM + slots, mask=in_r, other=0.0)
    window_sum = tl.load(WINDOW_SUM + slots, mask=in_r, other=0.0)
    memory_count = tl.load(MEMORY_COUNT + bh)
    window_count = tl.load(WINDOW_COUNT + bh)
    if DISSECTION:
        coefficients = memory_sum / tl.maximum(memory_count, 1.0)
    else:
        coefficients = (memory_sum + window_sum + proj) / tl.maximum(memory_count + window_count + count, 1.0)
    read_q = q
    if HAS_READ_SCALE:
        read_q = q * tl.load(READ_SCALE + h).to(tl.float32)
    logits = tl.where(in_r, coefficients * scale * tl.sum(basis * read_q[None, :], 1), float("-inf"))
    slot_weights = tl.exp(logits - tl.max(logits, 0))
    slot_weights = slot_weights / tl.sum(slot_weights, 0)
    read = tl.sum((slot_weights * coefficients)[:, None] * basis, 0)
    out = tl.where(real, (local + read) * 0.5, 0.0)
    tl.store(OUT + bh * head_dim + d, out.to(OUT.dtype.element_ty), mask=in_d)

    # The cache: the new key and value, the sums (folded into the memory at a window's end), the position. A value
    # may be held by several threads; the barrier keeps one thread's store from reaching another's earlier load.
    tl.debug_barrier()
    new = (bh * span + new_slot) * head_dim + d
    tl.store(RING_K + new, k_new.to(RING_K.dtype.element_ty), mask=in_d)
    tl.store(RING_V + new, v_new.to(RING_V.dtype.element_ty), mask=in_d)
    tl.store(KEY_MASK + b * span + new_slot, real.to(tl.uint8), mask=h == 0)
    window_sum += proj
    window_count += count
    ends = (position + 1) % window == 0
    tl.store(MEMORY_SUM + slots, tl.where(ends, memory_sum + window_sum, memory_sum), mask=in_r)
    tl.store(WINDOW_SUM + slots, tl.where(ends, 0.0, window_sum), mask=in_r)
    tl.store(MEMORY_COUNT + bh, tl.where(ends, memory_count + window_count, memory_count))
    tl.store(WINDOW_COUNT + bh, tl.where(ends, 0.0, window_count))
    tl.store(STEPS + bh, position + 1)


def decode_step_triton(q, k, v, basis, cache: LavoStepCache, *, pos_bias, dissection, real, scale, read_scale):
    r""":func:`.step.lavo_decode_step` (arguments checked there) in one launch: ``q, k, v [B, 1, H, D]`` (any
    strides with a unit one along ``D``), ``real [B]`` bool; returns ``[B, 1, H, D]``."""
    if not all(x.is_contiguous() for x in cache.tensors()):
        # a contiguous copy would take the step's updates, not the cache
        raise ValueError("the step kernel updates a LavoStepCache in place and addresses its tensors as contiguous; "
                         "this one has a strided tensor: make it with LavoStepCache.from_cache (layer.step_cache)")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    pos_bias, read_scale = (None if x is None else x.contiguous() for x in (pos_bias, read_scale))
    return _step_launch(q, k, v, real.contiguous(), basis.contiguous(), pos_bias, read_scale, cache.keys,
                        cache.values, cache.key_mask, cache.memory_sum, cache.memory_count, cache.window_sum,
                        cache.window_count, cache.steps, cache.window, scale, dissection)


# The launch is a torch custom op that updates the cache's tensors, as the other kernels' launches are custom ops
# (see ..local.kernels): torch.compile keeps it as one opaque node instead of tracing Triton's launcher, which it
# cannot in the interpreter. Module without `from __future__ import annotations`: torch 2.4 infers the schema only
# from real types.
@torch.library.custom_op("lavo::decode_step", mutates_args=("keys", "values", "key_mask", "memory_sum",
                                                            "memory_count", "window_sum", "window_count", "steps"))
def _step_launch(q: Tensor, k: Tensor, v: Tensor, real: Tensor, basis: Tensor, pos_bias: Tensor | None,
                 read_scale: Tensor | None, keys: Tensor, values: Tensor, key_mask: Tensor, memory_sum: Tensor,
                 memory_count: Tensor, window_sum: Tensor, window_count: Tensor, steps: Tensor, window: int,
                 scale: float, dissection: bool) -> Tensor:
    B, _, H, D = q.shape
    out = _step_launch_fake(q, k, v, real, basis, pos_bias, read_scale, keys, values, key_mask, memory_sum,
                            memory_count, window_sum, window_count, steps, window, scale, dissection)
    rank = basis.shape[1]
    with launching_on(q):
        _step[(B * H,)](q, k, v, real.view(torch.uint8), basis, pos_bias, read_scale, keys, values,
                        key_mask.view(torch.uint8), memory_sum, memory_count, window_sum, window_count, steps, out,
                        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2), H, window, D,
                        rank, scale, HAS_BIAS=pos_bias is not None, HAS_READ_SCALE=read_scale is not None,
                        DISSECTION=dissection, BLOCK_S=triton.next_power_of_2(2 * window),
                        BLOCK_D=triton.next_power_of_2(D), BLOCK_R=triton.next_power_of_2(rank),
                        num_warps=4 if 2 * window * D <= 8192 else 8)
    return out


@_step_launch.register_fake
def _step_launch_fake(q, k, v, real, basis, pos_bias, read_scale, keys, values, key_mask, memory_sum, memory_count,
                      window_sum, window_count, steps, window, scale, dissection):
    B, _, H, D = q.shape
    return q.new_empty(B, 1, H, D)
