r"""Sliding-window attention in Triton: the GPU form of :func:`.blocked.local_attention`, forward and backward.

Flash-style: a program takes ``BLOCK`` queries and walks the key blocks its window rule reaches (``2w`` keys
causal, ``3w`` non-causal, around the diagonal), with an online softmax; only the output and one log-sum-exp per
query are written. The relative-position bias is gathered into the scores, and its gradient is summed along the
diagonals of each tile of score gradients (a skew by :func:`tl.gather`, then column sums) before a few atomic
adds. Backward recomputes the weights three times: per query block for ``dO . O`` (from the float32 weights), per
key block (``dK``, ``dV``), per query block (``dQ``, the bias gradient), so nothing of size ``T x w`` is ever
stored.

Inputs are ``[B, T, H, D]`` with a unit stride along ``D``; ``D`` is padded to a power of two inside the kernel.
Scores are kept in base-2 units (``exp2``), the log-sum-exp too. Offsets are int32 unless a tensor reaches 2^31
elements from where a program addresses it (:func:`wide_offsets`: a million tokens at width 2048), where the
kernels are compiled with ``WIDE`` and count positions in int64. Importing this module defines the kernels, so
``TRITON_INTERPRET`` must be set before it is first imported.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import first_order_only, launching_on, small_shared_memory, triton_interpreting

LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in base 2: exp(x) = exp2(x log2(e))
INT32_OFFSETS = 2**31  # an offset this large or larger needs int64 arithmetic


def wide_offsets(q: Tensor) -> bool:
    """Whether the kernels must count positions in int64 for ``q [B, T, H, D]``: when ``T`` rows of its stride, of
    ``H D`` (the contiguous gradients) or the ``[B H, T]`` log-sum-exp reach 2^31 elements. Below that int32 keeps
    the kernels' registers lower."""
    B, T, H, D = q.shape
    return max(T * q.stride(1), T * H * D, B * H * T) >= INT32_OFFSETS


@triton.jit
def _wide(x, WIDE: tl.constexpr):
    """``x`` in int64 when ``WIDE``, else as it is."""
    if WIDE:
        x = x.to(tl.int64)
    return x


@triton.jit
def _visible(t, j, window, length, CAUSAL: tl.constexpr):
    """Whether query ``t`` sees key ``j`` by the window rule (broadcasting ``t [M, 1]`` against ``j [1, N]``)."""
    own = t // window
    seen = (j >= (own - 1) * window) & (j < length) & (t < length)
    if CAUSAL:
        seen = seen & (j <= t)
    else:
        seen = seen & (j < (own + 2) * window)
    return seen


@triton.jit
def _bias_index(t, j, window, CAUSAL: tl.constexpr):
    """Column of the relative-position table for query ``t`` and key ``j``."""
    if CAUSAL:
        return t - j
    return j - t + 2 * window - 1


@triton.jit
def _scores(q, k, t, j, b, h, bias_ptr, bias_stride, keep_ptr, keep_stride, window, length, scale_log2,
            CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of a tile in base-2 units, ``-inf`` where the key is out of reach or padding; and the visibility."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    seen = _visible(t[:, None], j[None, :], window, length, CAUSAL)
    if HAS_KEEP:
        seen = seen & (tl.load(keep_ptr + b * keep_stride + j, mask=j < length, other=0) != 0)[None, :]
    if HAS_BIAS:
        index = _bias_index(t[:, None], j[None, :], window, CAUSAL)
        s += tl.load(bias_ptr + h * bias_stride + index, mask=seen, other=0.0).to(tl.float32) * LOG2E
    return tl.where(seen, s, float("-inf")), seen


@triton.jit
def _key_range(first, last, window, length, BLOCK: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys any query in ``[first, last]`` may see, the start rounded down to a block: ``[lo, hi)``."""
    lo = tl.maximum((first // window - 1) * window, 0) // BLOCK * BLOCK
    if CAUSAL:
        hi = last + 1
    else:
        hi = tl.minimum((last // window + 2) * window, length)
    return lo, hi


@triton.jit
def _query_range(first, last, window, length, BLOCK: tl.constexpr, CAUSAL: tl.constexpr):
    """Queries that may see a key in ``[first, last]``, the start rounded down to a block: ``[lo, hi)``."""
    if CAUSAL:
        lo = first // BLOCK * BLOCK
    else:
        lo = tl.maximum((first // window - 1) * window, 0) // BLOCK * BLOCK
    hi = tl.minimum((last // window + 2) * window, length)
    return lo, hi


@triton.jit
def _tile(ptr, rows, d, row_stride, length, head_dim, FLOAT32_DOTS: tl.constexpr):
    """A ``[rows, D]`` tile of a ``[T, D]`` slice, zeros outside; float32 when ``FLOAT32_DOTS``."""
    x = tl.load(ptr + rows[:, None] * row_stride + d[None, :],
                mask=(rows[:, None] < length) & (d[None, :] < head_dim), other=0.0)
    if FLOAT32_DOTS:
        x = x.to(tl.float32)
    return x


@triton.jit
def _grid_row(per_row):
    """This program's ``(batch, head)`` row and its index among the row's ``per_row`` programs. The kernels' grids
    are one axis, the programs of each row in turn: CUDA allows 2^31 - 1 programs there, 65,535 on the others."""
    return tl.program_id(0) // per_row, tl.program_id(0) % per_row


@triton.jit
def _program(heads, length, stride_b, stride_h, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):
    """This program's ``[B * H, T]`` row, batch ``b``, head ``h``, its block's first position and positions, the
    ``D`` lanes and the input offset (``b`` and ``h`` in int64, so offsets into tensors past 2^31 elements do not
    overflow, whatever the layout; positions too when ``WIDE``); a program per block."""
    row, block = _grid_row(tl.cdiv(length, BLOCK))
    b, h = (row // heads).to(tl.int64), (row % heads).to(tl.int64)
    first = _wide(block * BLOCK, WIDE)
    return row, b, h, first, first + tl.arange(0, BLOCK), tl.arange(0, BLOCK_D), b * stride_b + h * stride_h


@triton.jit
def _contiguous_tile(X, b, h, rows, d, heads, length, head_dim, FLOAT32_DOTS: tl.constexpr):
    """A ``[rows, D]`` tile of batch ``b``, head ``h`` of a contiguous ``[B, T, H, D]`` tensor."""
    return _tile(X + (b * length * heads + h) * head_dim, rows, d, heads * head_dim, length, head_dim, FLOAT32_DOTS)


@triton.jit
def _per_query(X, row, rows, length):
    """Entries ``rows`` of row ``row`` of a float32 ``[B * H, T]`` tensor (the lse, the deltas)."""
    return tl.load(X + row.to(rows.dtype) * length + rows, mask=rows < length, other=0.0)


@triton.jit
def _weights(q, k, t, j, row, b, h, LSE, BIAS, bias_stride, KEEP, keep_stride, window, length, scale_log2,
             CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr, PRECISION: tl.constexpr):
    """The softmax weights of a tile, recomputed from the saved log-sum-exp; zero where a key is not seen."""
    s, seen = _scores(q, k, t, j, b, h, BIAS, bias_stride, KEEP, keep_stride, window, length, scale_log2, CAUSAL,
                      HAS_BIAS, HAS_KEEP, PRECISION)
    return tl.where(seen, tl.exp2(s - _per_query(LSE, row, t, length)[:, None]), 0.0)


@triton.jit
def _store(X, x, b, h, rows, d, heads, length, head_dim):
    """Store a float32 tile ``[rows, D]`` of batch ``b``, head ``h`` into a contiguous ``[B, T, H, D]`` tensor."""
    place = X + ((b * length + rows[:, None]) * heads + h) * head_dim + d[None, :]
    tl.store(place, x.to(X.dtype.element_ty), mask=(rows[:, None] < length) & (d[None, :] < head_dim))


@triton.jit
def _forward(Q, K, V, BIAS, KEEP, O, LSE, stride_b, stride_t, stride_h, bias_stride, keep_stride, heads, length,
             window, head_dim, scale_log2,
             CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr,
             BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, FLOAT32_DOTS: tl.constexpr, WIDE: tl.constexpr):
    row, b, h, first, t, d, offset = _program(heads, length, stride_b, stride_h, BLOCK, BLOCK_D, WIDE)
    q = _tile(Q + offset, t, d, stride_t, length, head_dim, FLOAT32_DOTS)
    peak = tl.full([BLOCK], -1.0e30, tl.float32)  # finite: a row with nothing seen yet gives exp2(-inf) = 0
    total = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    lo, hi = _key_range(first, tl.minimum(first + BLOCK, length) - 1, window, length, BLOCK, CAUSAL)
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        k = _tile(K + offset, j, d, stride_t, length, head_dim, FLOAT32_DOTS)
        s, _ = _scores(q, k, t, j, b, h, BIAS, bias_stride, KEEP, keep_stride, window, length, scale_log2, CAUSAL,
                       HAS_BIAS, HAS_KEEP, PRECISION)
        new_peak = tl.maximum(peak, tl.max(s, 1))
        decay = tl.exp2(peak - new_peak)
        p = tl.exp2(s - new_peak[:, None])
        total = total * decay + tl.sum(p, 1)
        v = _tile(V + offset, j, d, stride_t, length, head_dim, FLOAT32_DOTS)
        acc = acc * decay[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        peak = new_peak
    total = tl.where(total > 0, total, 1.0)  # no key at all (a padded query): output zeros
    out = acc / total[:, None]
    _store(O, out, b, h, t, d, heads, length, head_dim)
    tl.store(LSE + row.to(t.dtype) * length + t, peak + tl.log2(total), mask=t < length)


@triton.jit
def _backward_keys(Q, K, V, BIAS, KEEP, DO, LSE, DELTA, DK, DV, stride_b, stride_t, stride_h, bias_stride,
                   keep_stride, heads, length, window, head_dim, scale, scale_log2, CAUSAL: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                   PRECISION: tl.constexpr, FLOAT32_DOTS: tl.constexpr, WIDE: tl.constexpr):
    """``dK`` and ``dV`` of one key block, over the query blocks that see it. DO, DK, DV are contiguous."""
    row, b, h, first, j, d, offset = _program(heads, length, stride_b, stride_h, BLOCK, BLOCK_D, WIDE)
    k = _tile(K + offset, j, d, stride_t, length, head_dim, FLOAT32_DOTS)
    v = _tile(V + offset, j, d, stride_t, length, head_dim, FLOAT32_DOTS)
    dk = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    lo, hi = _query_range(first, tl.minimum(first + BLOCK, length) - 1, window, length, BLOCK, CAUSAL)
    for start in range(lo, hi, BLOCK):
        t = start + tl.arange(0, BLOCK)
        q = _tile(Q + offset, t, d, stride_t, length, head_dim, FLOAT32_DOTS)
        p = _weights(q, k, t, j, row, b, h, LSE, BIAS, bias_stride, KEEP, keep_stride, window, length, scale_log2,
                     CAUSAL, HAS_BIAS, HAS_KEEP, PRECISION)
        do = _contiguous_tile(DO, b, h, t, d, heads, length, head_dim, FLOAT32_DOTS)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - _per_query(DELTA, row, t, length)[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    _store(DK, dk * scale, b, h, j, d, heads, length, head_dim)
    _store(DV, dv, b, h, j, d, heads, length, head_dim)


@triton.jit
def _add_diagonal_sums(ds, first, start, h, DBIAS, bias_size, window, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """Add the tile ``ds [BLOCK, BLOCK]`` (queries from ``first``, keys from ``start``) into the bias gradient: each
    diagonal ``m - n = e`` shares one table entry. Row ``m`` is rotated left by ``m`` so diagonal ``e`` lands in
    column ``e`` (rows ``m >= e``) or ``e + BLOCK`` wraps into it (rows ``m < e``, diagonal ``e - BLOCK``)."""
    m = tl.arange(0, BLOCK)
    e = tl.arange(0, BLOCK)
    skewed = tl.gather(ds, (m[:, None] - e[None, :] + BLOCK) % BLOCK, 1)
    below = m[:, None] >= e[None, :]
    for part in tl.static_range(2):
        if part == 0:
            sums = tl.sum(tl.where(below, skewed, 0.0), 0)
            offset = first - start + e  # t - j
        else:
            sums = tl.sum(tl.where(below, 0.0, skewed), 0)
            offset = first - start + e - BLOCK
        if CAUSAL:
            index = offset
        else:
            index = 2 * window - 1 - offset
        tl.atomic_add(DBIAS + h * bias_size + index, sums, mask=(index >= 0) & (index < bias_size))


@triton.jit
def _backward_queries(Q, K, V, BIAS, KEEP, DO, LSE, DELTA, DQ, DBIAS, stride_b, stride_t, stride_h, bias_stride,
                      keep_stride, bias_size, heads, length, window, head_dim, scale, scale_log2,
                      CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, HAS_KEEP: tl.constexpr,
                      DELTAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                      FLOAT32_DOTS: tl.constexpr, WIDE: tl.constexpr):
    """One query block over the key blocks it sees. With ``DELTAS`` (the first pass), ``delta_t = dO_t . O_t`` in
    float32 into ``DELTA`` ``[B * H, T]``, summed as ``sum_j p_tj dO_t . v_j`` from the float32 weights, not from
    the output rounded to 16 bits: with values that share a large offset, the score gradients
    ``p (dO . v - delta)`` cancel, and the rounding of ``O`` multiplied the 16-bit ``q`` and ``k`` gradients' error
    (docs/DESIGN.md, the Triton path, gives the measured ratio). Otherwise (the last pass) ``dQ`` and the block's
    part of the bias gradient (``DBIAS``, float32 ``[H, bias_size]``, atomically). DO and DQ are contiguous."""
    row, b, h, first, t, d, offset = _program(heads, length, stride_b, stride_h, BLOCK, BLOCK_D, WIDE)
    q = _tile(Q + offset, t, d, stride_t, length, head_dim, FLOAT32_DOTS)
    do = _contiguous_tile(DO, b, h, t, d, heads, length, head_dim, FLOAT32_DOTS)
    if DELTAS:
        delta = tl.zeros([BLOCK], tl.float32)
    else:
        delta = _per_query(DELTA, row, t, length)
    dq = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    lo, hi = _key_range(first, tl.minimum(first + BLOCK, length) - 1, window, length, BLOCK, CAUSAL)
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        k = _tile(K + offset, j, d, stride_t, length, head_dim, FLOAT32_DOTS)
        p = _weights(q, k, t, j, row, b, h, LSE, BIAS, bias_stride, KEEP, keep_stride, window, length, scale_log2,
                     CAUSAL, HAS_BIAS, HAS_KEEP, PRECISION)
        v = _tile(V + offset, j, d, stride_t, length, head_dim, FLOAT32_DOTS)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DELTAS:
            delta += tl.sum(p * dp, 1)
        else:
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
            if BIAS_GRAD:
                _add_diagonal_sums(ds, first, start, h, DBIAS, bias_size, window, CAUSAL, BLOCK)
    if DELTAS:
        tl.store(DELTA + row.to(t.dtype) * length + t, delta, mask=t < length)
    else:
        _store(DQ, dq * scale, b, h, t, d, heads, length, head_dim)


def _config(head_dim: int, dtype: torch.dtype, wide: bool, small_shared: bool) -> dict:
    """Tile sizes and launch options: ``BLOCK`` queries and keys per tile, ``D`` padded to a power of two (at least
    16, what a Triton matmul needs); float32 inputs multiply in full float32, not TF32; int64 positions when
    ``wide``. With less shared memory than an A100 (``small_shared``), no software pipelining: float32 tiles of
    ``D = 64`` would need up to 145 KB (tests/compile_kernels.py), and those GPUs have 99 KB."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return dict(BLOCK=64 if block_d <= 64 else 32, BLOCK_D=block_d, WIDE=wide, **pipelining(not small_shared),
                **dot_options(dtype))


def pipelining(on: bool) -> dict:
    """Launch options for Triton's software pipelining: its default stages, or one stage (``num_stages=1``), which
    keeps a single set of a loop's tiles in shared memory."""
    return {} if on else dict(num_stages=1)


def dot_options(dtype: torch.dtype) -> dict:
    """How the kernels multiply tiles of ``dtype``: float32 in full precision (not TF32). Triton's CPU interpreter
    multiplies 16-bit float tiles wrongly (3.9), so there they are widened to float32 first."""
    return dict(PRECISION="ieee" if dtype == torch.float32 else "tf32",
                FLOAT32_DOTS=dtype != torch.float32 and triton_interpreting())


def _shared_strides(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors as they are when they share strides with a unit stride along ``D`` (e.g. views of one
    projection), else contiguous copies: the kernels address them with one set of strides."""
    if all(x.stride() == tensors[0].stride() for x in tensors) and tensors[0].stride(-1) == 1:
        return list(tensors)
    return [x.contiguous() for x in tensors]


# The kernels' launches are torch custom ops, so that torch.compile keeps them as opaque nodes of one graph (shapes
# from the fake implementations) instead of tracing into Triton's launcher.
@torch.library.custom_op("lavo::window_attention_forward", mutates_args=())
def _window_forward(q: Tensor, k: Tensor, v: Tensor, pos_bias: Tensor | None, keep: Tensor | None, causal: bool,
                    window: int, scale: float) -> tuple[Tensor, Tensor]:
    """The output ``[B, T, H, D]`` and a float32 log-sum-exp ``[B * H, T]``."""
    q, k, v = _shared_strides(q, k, v)
    B, T, H, D = q.shape
    out, lse = _window_forward_fake(q, k, v, pos_bias, keep, causal, window, scale)  # one place for the layout
    config = _config(D, q.dtype, wide_offsets(q), small_shared_memory(q))
    grid = (triton.cdiv(T, config["BLOCK"]) * B * H,)
    with launching_on(q):
        _forward[grid](q, k, v, pos_bias, keep, out, lse, *q.stride()[:3],
                       0 if pos_bias is None else pos_bias.stride(0), 0 if keep is None else keep.stride(0), H, T,
                       window, D, scale * LOG2E.value, CAUSAL=causal, HAS_BIAS=pos_bias is not None,
                       HAS_KEEP=keep is not None, **config)
    return out, lse


@_window_forward.register_fake
def _window_forward_fake(q, k, v, pos_bias, keep, causal, window, scale):
    B, T, H, D = q.shape
    return q.new_empty(B, T, H, D), q.new_empty(B * H, T, dtype=torch.float32)


@torch.library.custom_op("lavo::window_attention_backward", mutates_args=())
def _window_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, pos_bias: Tensor | None, keep: Tensor | None,
                     lse: Tensor, causal: bool, window: int, scale: float,
                     bias_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``q, k, v`` and of ``pos_bias`` (an empty tensor unless ``bias_grad``)."""
    q, k, v = _shared_strides(q, k, v)
    B, T, H, D = q.shape
    config = _config(D, q.dtype, wide_offsets(q), small_shared_memory(q))
    grid = (triton.cdiv(T, config["BLOCK"]) * B * H,)
    grad_out = grad_out.to(q.dtype).contiguous()
    delta = torch.empty_like(lse)
    grad_q, grad_k, grad_v = (torch.empty(B, T, H, D, dtype=q.dtype, device=q.device) for _ in range(3))
    bias_size = 0 if pos_bias is None else pos_bias.shape[1]
    grad_bias = torch.zeros(H, bias_size, dtype=torch.float32, device=q.device) if bias_grad else None
    shared = dict(CAUSAL=causal, HAS_BIAS=pos_bias is not None, HAS_KEEP=keep is not None, **config)
    strides = (*q.stride()[:3], 0 if pos_bias is None else pos_bias.stride(0), 0 if keep is None else keep.stride(0))
    with launching_on(q):
        query_pass = (q, k, v, pos_bias, keep, grad_out, lse, delta, grad_q, grad_bias, *strides, bias_size, H, T,
                      window, D, scale, scale * LOG2E.value)
        _backward_queries[grid](*query_pass, BIAS_GRAD=False, DELTAS=True, **shared)
        _backward_keys[grid](q, k, v, pos_bias, keep, grad_out, lse, delta, grad_k, grad_v, *strides, H, T, window,
                             D, scale, scale * LOG2E.value, **shared)
        _backward_queries[grid](*query_pass, BIAS_GRAD=bias_grad, DELTAS=False, **shared)
    return grad_q, grad_k, grad_v, grad_bias.to(pos_bias.dtype) if bias_grad else q.new_empty(H, 0)


@_window_backward.register_fake
def _(grad_out, q, k, v, pos_bias, keep, lse, causal, window, scale, bias_grad):
    B, T, H, D = q.shape
    grad_bias = q.new_empty(H, 0) if not bias_grad else pos_bias.new_empty(pos_bias.shape)
    return (*(q.new_empty(B, T, H, D) for _ in range(3)), grad_bias)


def _window_setup(ctx, inputs, output):
    q, k, v, pos_bias, keep, causal, window, scale = inputs
    ctx.save_for_backward(q, k, v, pos_bias, keep, output[1])  # the log-sum-exp; backward needs no output
    ctx.causal, ctx.window, ctx.scale = causal, window, scale


# The backward kernels have no derivative: create_graph=True is refused by name, as on the PyTorch path, not by torch's
# custom-op error at the second backward (which asks to register an autograd formula).
@first_order_only("The sliding-window attention (Triton path)",
                  "lavo.ops.local_attention_naive or lavo_attention_naive")
def _window_gradients(ctx, grad_out, grad_lse):
    q, k, v, pos_bias, keep, lse = ctx.saved_tensors
    bias_grad = pos_bias is not None and ctx.needs_input_grad[3]
    grad_q, grad_k, grad_v, grad_bias = _window_backward(grad_out, q, k, v, pos_bias, keep, lse, ctx.causal,
                                                         ctx.window, ctx.scale, bias_grad)
    return grad_q, grad_k, grad_v, grad_bias if bias_grad else None, None, None, None, None


_window_forward.register_autograd(_window_gradients, setup_context=_window_setup)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, causal: bool,
                     pos_bias: torch.Tensor | None, padding_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    r"""Sliding-window attention by the Triton kernels; arguments as :func:`.blocked.local_attention` (checked
    there). Returns ``[B, T, H, D]``; rows of padded queries are not zeroed (the caller masks them)."""
    keep = None if padding_mask is None else padding_mask.to(torch.uint8).contiguous()  # the kernels step T by 1
    pos_bias = None if pos_bias is None else pos_bias.contiguous()
    return _window_forward(q, k, v, pos_bias, keep, causal, window, scale)[0]
