"""The orthogonal memory (CODE): compress features onto an orthonormal basis, read with a softmax over slots.

With basis rows ``b_1..b_r`` and coefficients ``H`` (a mean of ``B f`` over the context), memory slot ``i`` is
``H_i b_i``: it is both key and value. A query reads ``o = sum_i softmax_i(scale H_i (B q)_i) H_i b_i``, which
never materialises the ``[r, D]`` memory per token. Functions here take head-major tensors ``[..., H, L, D]``;
coefficients are at least float32 whatever the input dtype (a float16 running sum overflows past ~65K tokens).
"""
from __future__ import annotations

import torch

from ..common import accumulation_dtype, autocast_off, first_order_only


def per_head_matmul(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    r"""``x [..., H, L, K] @ m [H, K, N]`` -> ``[..., H, L, N]``, as one product per head over every leading
    index and row: a broadcast matmul copies ``m`` to each leading index and multiplies many small matrices."""
    heads_first = x.movedim(-3, 0)
    out = torch.bmm(heads_first.reshape(x.shape[-3], -1, x.shape[-1]), m)
    return out.view(*heads_first.shape[:-1], m.shape[-1]).movedim(0, -3)


def check_head_major(name: str, x: torch.Tensor, basis: torch.Tensor) -> None:
    """Refuse ``x`` unless it is ``[..., H, L, D]`` with the basis's ``H`` and ``D``: these functions take heads
    before positions, unlike the ops' ``[B, T, H, D]`` (else a ``bmm`` size error; one with ``T = H`` passes)."""
    heads, _, head_dim = basis.shape
    if x.dim() < 3 or x.shape[-3] != heads or x.shape[-1] != head_dim:
        raise ValueError(f"{name} must have shape [..., H, L, D] with the basis's H={heads}, D={head_dim} (heads "
                         f"before positions: a [B, T, H, D] tensor needs .transpose(1, 2)), got {tuple(x.shape)}")


def project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    r"""Coordinates on the basis: ``x [..., H, L, D]``, ``basis [H, r, D]`` -> ``[..., H, L, r]``, computed in at
    least float32: the coordinates of 16-bit inputs are not rounded to 16 bits (what the Triton kernels, which
    accumulate their products in float32, compute too), autocast or not."""
    check_head_major("x", x, basis)
    acc = accumulation_dtype(x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        return per_head_matmul(x.to(acc), basis.to(acc).transpose(-1, -2))


# Elements of [.., r] intermediates per step of the read (4 MiB in float32).
READ_ELEMENTS_PER_CHUNK = 1 << 20


class _MemoryRead(torch.autograd.Function):
    """The read, a few rows of dim 0 at a time, with a hand-written backward: its [.., L, r] intermediates exist
    for one chunk only, forward and backward, instead of for the whole sequence."""

    @staticmethod
    @autocast_off
    def forward(ctx, q, coefficients, basis, scale):
        chunk = max(1, READ_ELEMENTS_PER_CHUNK // (q[0].numel() // q.shape[-1] * basis.shape[1]))
        out = q.new_empty(q.shape)
        for c0 in range(0, q.shape[0], chunk):
            c1 = min(q.shape[0], c0 + chunk)
            coef = _rows(coefficients, c0, c1)
            weights = (coef * scale * project(q[c0:c1], basis)).softmax(-1)
            out[c0:c1] = per_head_matmul(weights * coef, basis.to(coef.dtype)).to(q.dtype)
        ctx.save_for_backward(q, coefficients, basis)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    @first_order_only("LAVO's memory read (PyTorch path)",
                      "lavo.ops.lavo_attention_naive or code_cross_attention_naive")
    @autocast_off
    def backward(ctx, grad_out):
        q, coefficients, basis, = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        basis_acc = basis.to(coefficients.dtype)
        grad_q = q.new_empty(q.shape)
        grad_coefficients = torch.zeros_like(coefficients)
        grad_basis = torch.zeros_like(basis_acc)
        for c0 in range(0, q.shape[0], chunk):
            c1 = min(q.shape[0], c0 + chunk)
            coef, grad = _rows(coefficients, c0, c1), grad_out[c0:c1].to(coefficients.dtype)
            q_acc = q[c0:c1].to(coefficients.dtype)
            q_proj = per_head_matmul(q_acc, basis_acc.transpose(-1, -2))
            weights = (coef * scale * q_proj).softmax(-1)
            grad_read = per_head_matmul(grad, basis_acc.transpose(-1, -2))  # d/d(weights * coef)
            grad_weights = grad_read * coef
            grad_logits = weights * (grad_weights - (grad_weights * weights).sum(-1, keepdim=True))
            grad_proj = grad_logits * coef * scale
            grad_q[c0:c1] = per_head_matmul(grad_proj, basis_acc).to(q.dtype)
            grad_coef = grad_read * weights + grad_logits * scale * q_proj
            if coefficients.shape[0] == 1:
                grad_coefficients += grad_coef.sum_to_size(coefficients.shape)
            else:
                grad_coefficients[c0:c1] = grad_coef.sum_to_size(coef.shape)
            if ctx.needs_input_grad[2]:
                grad_basis += (grad_proj.transpose(-1, -2) @ q_acc + (weights * coef).transpose(-1, -2) @ grad
                               ).sum_to_size(basis.shape)
        return grad_q, grad_coefficients, grad_basis.to(basis.dtype), None


def _rows(coefficients: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """Rows ``c0 .. c1 - 1`` of dim 0, or the one row that broadcasts over it."""
    return coefficients if coefficients.shape[0] == 1 else coefficients[c0:c1]


def memory_read(q: torch.Tensor, coefficients: torch.Tensor, basis: torch.Tensor, scale: float) -> torch.Tensor:
    r"""Read the memory ``diag(H) B``.

    Args:
        q: ``[N, ..., H, L, D]`` queries.
        coefficients: ``[N or 1, ..., H, L or 1, r]``, broadcastable against ``project(q)`` (``L = 1``: one
            memory shared by all queries).
        basis: ``[H, r, D]``.
    Returns:
        ``[N, ..., H, L, D]`` in ``q``'s dtype, read at least at ``q``'s precision (float64 queries of float32
        coefficients, as cross attention's over a float32 source, take them as float64).
    """
    check_head_major("q", q, basis)
    if coefficients.shape[-1] != basis.shape[1]:
        raise ValueError(f"coefficients must have one per slot, [..., r] with the basis's r={basis.shape[1]}, got "
                         f"{tuple(coefficients.shape)}")
    acc = torch.promote_types(coefficients.dtype, accumulation_dtype(q.dtype))
    return _MemoryRead.apply(q, coefficients.to(acc), basis, scale)

