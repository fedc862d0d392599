"""The ``flops`` section: LAVO's matmul FLOPs counted analytically (:func:`lavo_flops`), divided by the measured
op time, against the rate of a large square matmul measured in the same run."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..ops.common import uses_triton
from ..ops.local import blocked as local_blocked
from .attention import OPS, attention_call
from .measure import Skipped
from .runner import Runner, fill, record
from .settings import DTYPES, Settings


def lavo_flops(batch: int, length: int, heads: int, head_dim: int, rank: int, window: int, *,
               backward: bool = False, causal: bool = True, basis_grad: bool = False,
               torch_path: bool = True) -> dict[str, int]:
    r"""Matmul FLOPs of one :func:`~lavo.ops.lavo_attention` call with context dissection (a multiply-add counts
    2; softmax, masking, sums and other elementwise work are not counted).

    Per batch element and head, with ``T' = ceil(T / w) w`` (the padded length: whole blocks are computed),
    ``n = T' / w`` windows, ``K = 2w`` keys per block causal (``3w`` non-causal), ``D`` the head dim and ``r`` the
    rank. A sequence shorter than its window is one block of ``T`` (:func:`~lavo.ops.local.blocked.blocking_window`):
    there ``w`` is ``T``.

    - local branch, forward: ``Q K^T`` and ``P V`` over every block's ``K`` keys: ``2 * 2 T' K D``.
    - local branch, backward: ``dV = P^T dO``, ``dP = dO V^T``, ``dQ = dS K`` and ``dK = dS^T Q``
      (``4 * 2 T' K D``), plus the recomputed scores (``2 T' K D``) when the whole sequence's weights exceed
      ``lavo.ops.local.blocked.SAVED_WEIGHTS_LIMIT`` elements and are not kept. Not ``torch_path`` (the Triton
      kernels, which recompute the scores in backward at every length): the four products only, the work of
      the algorithm, so that a rate is of the same work at every length.
    - memory branch, forward: each window's feature sum projected once (``2 n r D``), the queries projected and
      the read ``(weights * H) @ basis`` (``2 * 2 T' r D``).
    - memory branch, backward: the read recomputes the query projection and runs two gradient matmuls
      (``3 * 2 T' r D``), two more when the basis is learned; the window projection's gradient is ``2 n r D``
      (twice that with a learned basis).

    Returns:
        ``{"local": ..., "memory": ..., "total": ...}`` for the forward, or forward + backward when ``backward``.
    """
    window = min(window, length)  # the block the op computes in
    padded = math.ceil(length / window) * window
    keys = (2 if causal else 3) * window
    unit_local = 2 * padded * keys * head_dim * batch * heads  # one [T', K, D] matmul
    unit_memory = 2 * padded * rank * head_dim * batch * heads  # one [T', r, D] matmul
    per_window = unit_memory // window  # one [n, r, D] matmul
    local = 2 * unit_local
    memory = 2 * unit_memory + per_window
    if backward:
        recomputed = torch_path and padded * keys * batch * heads > local_blocked.SAVED_WEIGHTS_LIMIT
        local += (5 if recomputed else 4) * unit_local
        memory += (5 if basis_grad else 3) * unit_memory + (2 if basis_grad else 1) * per_window
    return {"local": local, "memory": memory, "total": local + memory}


def runs_torch_path(settings: Settings, device: torch.device) -> bool:
    """Whether the section's ``lavo_attention`` op runs the blocked torch path, not the Triton kernels."""
    q = torch.empty(1, 1, settings.heads, settings.head_dim, device=device, dtype=settings.torch_dtype)
    return not uses_triton(settings.backend, q)


def matmul(size: int, dtype: torch.dtype, device: torch.device) -> Callable[[], Any]:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return lambda: torch.matmul(a, b)


def matmul_dtypes(settings: Settings) -> list[str]:
    """The matmul rate is measured in fp32 and in ``--dtype``."""
    return list(dict.fromkeys(["fp32", settings.dtype]))


def planned(settings: Settings) -> int:
    return len(matmul_dtypes(settings)) + len(settings.passes) * len(settings.lengths)


def run(runner: Runner) -> None:
    s, device = runner.settings, runner.device
    rates: dict[str, float] = {}
    for dtype in matmul_dtypes(s):
        entry = record("flops", "op", "matmul", "matmul", s.matmul_size, s, batch=1, gflop=None,
                       gflops_per_s=None)
        entry["dtype"] = dtype

        def work(entry, dtype=dtype):
            fill(entry, runner.measure(matmul(s.matmul_size, DTYPES[dtype], device)))
            entry["gflop"] = 2 * s.matmul_size ** 3 / 1e9
            entry["gflops_per_s"] = entry["gflop"] / (entry["ms"] / 1e3)
            rates[dtype] = entry["gflops_per_s"]

        runner.run(entry, ("flops", "matmul", dtype), "linear", work)
    op = OPS["lavo_attention"]
    measured = {(r["op"], r["length"]): r for r in runner.records
                if r["section"] == "attention" and r["mechanism"] == op.label}
    torch_path = runs_torch_path(s, device)
    for which in s.passes:
        for length in s.lengths:
            count = lavo_flops(s.batch, length, s.heads, s.head_dim, s.rank, s.window, backward=which == "fwd+bwd",
                               torch_path=torch_path)
            entry = record("flops", "op", op.label, which, length, s, gflop=count["total"] / 1e9,
                           gflop_local=count["local"] / 1e9, gflop_memory=count["memory"] / 1e9, gflops_per_s=None,
                           matmul_gflops_per_s=rates.get(s.dtype), matmul_gflops_per_s_fp32=rates.get("fp32"))

            def work(entry, which=which, length=length):
                if (which, length) in measured:
                    source = measured[which, length]
                    if source["ms"] is None:
                        raise Skipped(f"not measured in the attention section ({source['note']})")
                    entry.update(ms=source["ms"], times_ms=source["times_ms"], peak_mib=source["peak_mib"])
                else:
                    fill(entry, runner.measure(attention_call(op.label, s, length, which, runner)))
                entry["gflops_per_s"] = entry["gflop"] / (entry["ms"] / 1e3)
                if entry["matmul_gflops_per_s"]:
                    entry.update(ratio=entry["gflops_per_s"] / entry["matmul_gflops_per_s"], ratio_to="matmul")

            runner.run(entry, ("flops", op.label, which), op.time_complexity, work)
