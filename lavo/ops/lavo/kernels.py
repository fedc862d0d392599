r"""The memory read in Triton: the GPU form of :func:`.memory.memory_read`, forward and backward in one kernel each.

A query reads ``softmax_i(scale H_i (B q)_i) H_i b_i`` (see :mod:`.memory`). Consecutive queries share a row of
coefficients ``H``: a window of ``w`` with context dissection, the whole sequence non-causal, one query each
without dissection. Programs walk blocks of queries that never straddle two rows, so the coefficient gradient of
a block is one row sum; a program keeps its share of the basis gradient ``[r, D]`` in registers and adds it
atomically once. Nothing of size ``[T, r]`` is stored, forward or backward.

Importing this module defines the kernels, so ``TRITON_INTERPRET`` must be set before it is first imported.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import first_order_only, launching_on, small_shared_memory
from ..local.kernels import _grid_row, _shared_strides, _wide, dot_options, pipelining, wide_offsets

# Programs per (batch, head) row at most: enough to fill a GPU, few enough that the basis gradient's atomic adds
# (one [r, D] tile per program) stay cheap.
PROGRAMS = 512


@triton.jit
def _rows(block, group, length, BLOCK: tl.constexpr):
    """Coefficient row ``c`` of block ``block``, its query positions ``t [BLOCK]`` and which of them exist."""
    per_row = tl.cdiv(group, BLOCK)
    c = block // per_row
    t = c * group + (block % per_row) * BLOCK + tl.arange(0, BLOCK)
    return c, t, (t < (c + 1) * group) & (t < length)


@triton.jit
def _read(Q, COEF, BASIS, block, bh, heads, stride_b, stride_t, stride_h, group, length, head_dim, rank, scale,
          PER_TOKEN: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
          PRECISION: tl.constexpr, FLOAT32_DOTS: tl.constexpr, WIDE: tl.constexpr):
    """Recompute one block's read: positions (int64 when ``WIDE``), validity, ``q``, ``B q``, coefficients and
    softmax weights."""
    b, h = bh // heads, bh % heads
    c, t, valid = _rows(block, group, length, BLOCK)
    t = _wide(t, WIDE)
    d = tl.arange(0, BLOCK_D)
    slot = tl.arange(0, BLOCK_R)
    q = tl.load(Q + b * stride_b + h * stride_h + t[:, None] * stride_t + d[None, :],
                mask=valid[:, None] & (d[None, :] < head_dim), other=0.0)
    if FLOAT32_DOTS:
        q = q.to(tl.float32)
    basis = tl.load(BASIS + (h * rank + slot[:, None]) * head_dim + d[None, :],
                    mask=(slot[:, None] < rank) & (d[None, :] < head_dim), other=0.0)
    proj = tl.dot(q, tl.trans(basis.to(q.dtype)), input_precision=PRECISION)  # [BLOCK, BLOCK_R] float32
    if PER_TOKEN:
        coef = tl.load(COEF + (bh * length + t[:, None]) * rank + slot[None, :],
                       mask=valid[:, None] & (slot[None, :] < rank), other=0.0)
    else:
        coef = tl.load(COEF + (bh * tl.cdiv(length, group) + c) * rank + slot, mask=slot < rank, other=0.0)[None, :]
    logits = tl.where(slot[None, :] < rank, coef * scale * proj, float("-inf"))
    weights = tl.exp(logits - tl.max(logits, 1)[:, None])
    weights = weights / tl.sum(weights, 1)[:, None]
    return b, h, t, valid, d, slot, q, basis, proj, coef, weights


@triton.jit
def _forward(Q, COEF, BASIS, O, stride_b, stride_t, stride_h, heads, group, length, head_dim, rank, blocks, scale,
             PER_TOKEN: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
             PRECISION: tl.constexpr, FLOAT32_DOTS: tl.constexpr, WIDE: tl.constexpr):
    bh, block = _grid_row(blocks)  # a block each
    bh = bh.to(tl.int64)  # offsets into tensors past 2^31 elements must not overflow
    b, h, t, valid, d, slot, q, basis, proj, coef, weights = _read(
        Q, COEF, BASIS, block, bh, heads, stride_b, stride_t, stride_h, group, length, head_dim, rank, scale,
        PER_TOKEN, BLOCK, BLOCK_D, BLOCK_R, PRECISION, FLOAT32_DOTS, WIDE)
    out = tl.dot(weights * coef, basis, input_precision=PRECISION)
    tl.store(O + ((b * length + t[:, None]) * heads + h) * head_dim + d[None, :], out.to(O.dtype.element_ty),
             mask=valid[:, None] & (d[None, :] < head_dim))


@triton.jit
def _backward(Q, COEF, BASIS, DO, DQ, DCOEF, DBASIS, stride_b, stride_t, stride_h, heads, group, length, head_dim,
              rank, blocks, programs, scale, PER_TOKEN: tl.constexpr, BASIS_GRAD: tl.constexpr, BLOCK: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
              FLOAT32_DOTS: tl.constexpr, WIDE: tl.constexpr):
    """``DO``, ``DQ`` contiguous ``[B, T, H, D]``; ``DCOEF`` float32 ``[B * H, T, r]`` per token, else one row per
    block ``[B * H, blocks, r]``; ``DBASIS`` float32 ``[H, r, D]``, added to atomically."""
    bh, first = _grid_row(programs)  # the program walks every programs-th block of its row
    bh = bh.to(tl.int64)
    grad_basis = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for block in range(first, blocks, programs):
        b, h, t, valid, d, slot, q, basis, proj, coef, weights = _read(
            Q, COEF, BASIS, block, bh, heads, stride_b, stride_t, stride_h, group, length, head_dim, rank, scale,
            PER_TOKEN, BLOCK, BLOCK_D, BLOCK_R, PRECISION, FLOAT32_DOTS, WIDE)
        place = ((b * length + t[:, None]) * heads + h) * head_dim + d[None, :]
        inside = valid[:, None] & (d[None, :] < head_dim)
        grad = tl.load(DO + place, mask=inside, other=0.0).to(tl.float32)
        grad_read = tl.dot(grad, tl.trans(basis), input_precision=PRECISION)  # d/d(weights * coef)
        grad_weights = grad_read * coef
        grad_logits = weights * (grad_weights - tl.sum(grad_weights * weights, 1)[:, None])
        grad_proj = grad_logits * coef * scale
        grad_q = tl.dot(grad_proj, basis, input_precision=PRECISION)
        tl.store(DQ + place, grad_q.to(DQ.dtype.element_ty), mask=inside)
        grad_coef = grad_read * weights + grad_logits * scale * proj
        if PER_TOKEN:
            tl.store(DCOEF + (bh * length + t[:, None]) * rank + slot[None, :], grad_coef,
                     mask=valid[:, None] & (slot[None, :] < rank))
        else:
            tl.store(DCOEF + (bh * blocks + block) * rank + slot, tl.sum(grad_coef, 0), mask=slot < rank)
        if BASIS_GRAD:
            grad_basis += tl.dot(tl.trans(grad_proj), q.to(tl.float32), input_precision=PRECISION)
            grad_basis += tl.dot(tl.trans(weights * coef), grad, input_precision=PRECISION)
    if BASIS_GRAD:
        h = bh % heads
        slot = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        tl.atomic_add(DBASIS + (h * rank + slot[:, None]) * head_dim + d[None, :], grad_basis,
                      mask=(slot[:, None] < rank) & (d[None, :] < head_dim))


def _config(head_dim: int, rank: int, group: int, dtype: torch.dtype, wide: bool, per_token: bool,
            small_shared: bool) -> dict:
    """Tile sizes and launch options (shared memory by tests/compile_kernels.py). A large basis tile (``D r >
    4096``, e.g. ``D = r = 128``) takes 8 warps, blocks of 32 queries and no software pipelining: otherwise the
    kernels need up to 360 KB of shared memory, where an H100 has 227 KB and an A100 163 KB. float32 queries of
    ``D = 128`` are not pipelined either: with a small basis (``r <= 32``) the backward's stages of query and
    output-gradient tiles need up to 196 KB. With less than an A100 (``small_shared``: 99 KB), no pipelining at
    all, and a large tile read per token (without dissection) in 16-bit also takes blocks of 16 queries and
    multiplies in float32 without tensor cores: their operand copies of the basis alone fill 128 KB."""
    block_d, block_r = (max(16, triton.next_power_of_2(n)) for n in (head_dim, rank))
    large = block_d * block_r > 4096
    wide_float32 = dtype == torch.float32 and block_d >= 128
    launch = dict(num_warps=8 if large else 4, **pipelining(not (large or wide_float32 or small_shared)))
    block, dots = 32 if large else 64, dot_options(dtype)
    if small_shared and large and per_token and dtype != torch.float32:
        block, dots = 16, dict(PRECISION="ieee", FLOAT32_DOTS=True)
    return dict(BLOCK=max(16, min(block, triton.next_power_of_2(group))), BLOCK_D=block_d, BLOCK_R=block_r,
                WIDE=wide, **launch, **dots)


def _launch(q: Tensor, rank: int, group: int) -> tuple[bool, int, dict, int]:
    """Whether rows are per token, the queries a kernel row spans, the kernels' config, and their blocks."""
    T, D = q.shape[1], q.shape[3]
    per_token = group == 1
    kernel_group = T if per_token else group  # per token, blocks only have to stay inside the sequence
    config = _config(D, rank, kernel_group, q.dtype, wide_offsets(q), per_token, small_shared_memory(q))
    return per_token, kernel_group, config, triton.cdiv(T, kernel_group) * triton.cdiv(kernel_group, config["BLOCK"])


# Custom ops, like the window kernels' (see ..local.kernels): opaque to torch.compile.
@torch.library.custom_op("lavo::memory_read_forward", mutates_args=())
def _read_forward(q: Tensor, coefficients: Tensor, basis: Tensor, scale: float, group: int) -> Tensor:
    # q: [B, T, H, D]; coefficients: float32 [B, H, rows, r]; basis: [H, r, D]; group: queries per row.
    (q,) = _shared_strides(q)
    B, T, H, D = q.shape
    per_token, kernel_group, config, blocks = _launch(q, basis.shape[1], group)
    out = _read_forward_fake(q, coefficients, basis, scale, group)
    with launching_on(q):
        _forward[(blocks * B * H,)](q, coefficients.contiguous(), basis.to(coefficients.dtype).contiguous(), out,
                                    *q.stride()[:3], H, kernel_group, T, D, basis.shape[1], blocks, scale,
                                    PER_TOKEN=per_token, **config)
    return out


@_read_forward.register_fake
def _read_forward_fake(q, coefficients, basis, scale, group):
    return q.new_empty(q.shape)


@torch.library.custom_op("lavo::memory_read_backward", mutates_args=())
def _read_backward(grad_out: Tensor, q: Tensor, coefficients: Tensor, basis: Tensor, scale: float, group: int,
                   basis_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``q``, the coefficients and the basis (an empty tensor unless ``basis_grad``)."""
    (q,) = _shared_strides(q)
    B, T, H, D = q.shape
    rank = basis.shape[1]
    per_token, kernel_group, config, blocks = _launch(q, rank, group)
    coefficients = coefficients.contiguous()
    basis_acc = basis.to(coefficients.dtype).contiguous()
    grad_out = grad_out.to(q.dtype).contiguous()
    grad_q = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    grad_coef = torch.empty(B * H, T if per_token else blocks, rank, dtype=torch.float32, device=q.device)
    grad_basis = torch.zeros_like(basis_acc) if basis_grad else None
    programs = min(blocks, max(1, PROGRAMS // (B * H)))
    with launching_on(q):
        _backward[(programs * B * H,)](q, coefficients, basis_acc, grad_out, grad_q, grad_coef, grad_basis,
                                       *q.stride()[:3], H, kernel_group, T, D, rank, blocks, programs, scale,
                                       PER_TOKEN=per_token, BASIS_GRAD=basis_grad, **config)
    grad_coef = grad_coef.view(B, H, coefficients.shape[2], -1, rank).sum(3)  # a row's blocks, or each token alone
    return grad_q, grad_coef, grad_basis.to(basis.dtype) if basis_grad else basis.new_empty(0)


@_read_backward.register_fake
def _(grad_out, q, coefficients, basis, scale, group, basis_grad):
    return (q.new_empty(q.shape), coefficients.new_empty(coefficients.shape, dtype=torch.float32),
            basis.new_empty(basis.shape if basis_grad else 0))


def _read_setup(ctx, inputs, output):
    q, coefficients, basis, scale, group = inputs
    ctx.save_for_backward(q, coefficients, basis)
    ctx.scale, ctx.group = scale, group


# As the window kernels' backward (..local.kernels): create_graph=True is refused by name.
@first_order_only("LAVO's memory read (Triton path)", "lavo.ops.lavo_attention_naive or code_cross_attention_naive")
def _read_gradients(ctx, grad_out):
    q, coefficients, basis = ctx.saved_tensors
    basis_grad = ctx.needs_input_grad[2]
    grad_q, grad_coef, grad_basis = _read_backward(grad_out, q, coefficients, basis, ctx.scale, ctx.group, basis_grad)
    return grad_q, grad_coef, grad_basis if basis_grad else None, None, None


_read_forward.register_autograd(_read_gradients, setup_context=_read_setup)


def read_memory(q: torch.Tensor, coefficients: torch.Tensor, basis: torch.Tensor, scale: float,
                group: int) -> torch.Tensor:
    r"""The memory read by the Triton kernels.

    Args:
        q: ``[B, T, H, D]``.
        coefficients: float32 ``[B, H, ceil(T / group), r]``: row ``c`` serves queries ``c group .. (c + 1) group - 1``
            (``group = 1``: a row per query; ``group >= T``: one row for all).
        basis: ``[H, r, D]``.
    Returns:
        ``[B, T, H, D]`` in ``q``'s dtype.
    """
    return _read_forward(q, coefficients, basis, scale, min(group, q.shape[1]))
