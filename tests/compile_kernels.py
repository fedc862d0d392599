"""``python compile_kernels.py [--fast] [--targets sm_90,sm_86]``: compile every Triton kernel of the package for
real GPUs, without one.

Triton's CPU interpreter runs what compiled Triton refuses (a plain global in a kernel, mismatched dtypes, ...),
so the interpreter tests cannot vouch for a GPU. This script calls the package's own launchers
(:func:`~lavo.ops.local.kernels.window_attention` forward and backward, :func:`~lavo.ops.lavo.kernels.read_memory`
forward and backward, :func:`~lavo.ops.lavo.step_kernel.decode_step_triton`) on CPU tensors with every kernel
launch intercepted: each launch's arguments, constexprs and options are exactly what a GPU call would pass, and
Triton's own binder turns them into the signature and specialization it would compile. Each distinct one is then
compiled to a cubin for an H100/H200 (sm_90), an A100 (sm_80), a B200 (sm_100) and the GPUs with 99 KB of shared
memory per block (sm_86: an RTX 3090 or an A10; sm_120: an RTX 5090; sm_89 has as little), and its resources
checked against the hardware: shared memory per block (``metadata.shared``) and registers per block. Its stack
frame (where registers that do not fit spill) is reported. The launches for a target are recorded as on that GPU:
with less shared memory than an A100, the launchers take their smaller configurations
(:func:`lavo.ops.common.small_shared_memory`).

Cases: float32 and bfloat16 inputs, ``D`` in 32, 64, 128 and 60 (a padded block), with the launcher's switches
(causal, bias, its gradient, padding mask; full rank, per-token rows, basis gradient; a wide window, bias, read
scale, dissection) each on and off in each dtype, the first one on at ``D = 128`` (the largest tiles).
``--fast`` compiles one case per launcher: bfloat16, ``D = 128`` (the largest tiles; ``--head-dim 256`` shows why
wider heads stay on torch), every switch on, so every
branch of every kernel is compiled once per target (the ``else`` branches are not). Both modes also compile that
case of the window and memory-read launchers in their form for tensors past 2^31 elements (``WIDE``, int64
positions), forced at a small size.

The launch path is Triton's own, less the driver: ``create_function_from_signature`` and
``JITFunction._pack_args`` are internals (Triton 3.9), the price of compiling what a launch would rather than a
signature written by hand beside each launcher.

Prints a line per compiled kernel and ``compiled N kernels, F failed``; exits 1 on any failure. Run it with
``TRITON_INTERPRET`` unset (the kernels are defined when their modules are imported). Nothing in the package
knows of it; tests/test_compile_kernels.py runs it.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import lavo
from lavo.cache import LavoStepCache
from lavo.ops.common import A100_SHARED_MEMORY
from lavo.ops.lavo import kernels as read_kernels
from lavo.ops.lavo.kernels import read_memory
from lavo.ops.lavo.step_kernel import decode_step_triton
from lavo.ops.local import kernels as window_kernels
from lavo.ops.local.kernels import window_attention

# What a block may use (CUDA's opt-in maximum of shared memory per block; the register file).
LIMITS = {"sm_90": dict(shared=232448, registers=65536), "sm_80": dict(shared=166912, registers=65536),
          "sm_86": dict(shared=101376, registers=65536), "sm_100": dict(shared=232448, registers=65536),
          "sm_120": dict(shared=101376, registers=65536)}
TARGETS = {arch: GPUTarget("cuda", int(arch[3:]), 32) for arch in LIMITS}
DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (32, 64, 128, 60)
WINDOW = 64  # the layers' default
HEADS = 2


def window_attention_case(dtype: torch.dtype, head_dim: int, switches: tuple[bool, ...]) -> None:
    """Forward and backward of the sliding-window kernels; the length is a multiple of 16 or not with ``causal``
    (Triton specializes integer arguments on that)."""
    causal, bias, bias_grad, padding = switches
    length = 128 if causal else 100
    q, k, v = (torch.randn(2, length, HEADS, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    # the table in the model's dtype or in float32 (kept by autocast)
    table = torch.zeros(HEADS, 2 * WINDOW if causal else 4 * WINDOW - 1, dtype=dtype if bias_grad else torch.float32,
                        requires_grad=bias_grad)
    mask = torch.ones(2, length, dtype=torch.bool) if padding else None
    out = window_attention(q, k, v, window=WINDOW, causal=causal, pos_bias=table if bias else None,
                           padding_mask=mask, scale=head_dim ** -0.5)
    out.backward(torch.ones_like(out))


def memory_read_case(dtype: torch.dtype, head_dim: int, switches: tuple[bool, ...]) -> None:
    """Forward and backward of the memory read: one coefficient row per query or per window; rank ``D``, the
    layers' default, or ``D / 4`` (at ``D = 128``, the largest tiles of queries with a basis tile below the large
    ones, which the launcher configures apart)."""
    full_rank, per_token, basis_grad = switches
    length, rank = 100, head_dim if full_rank else head_dim // 4
    group = 1 if per_token else WINDOW
    q = torch.randn(2, length, HEADS, head_dim, dtype=dtype, requires_grad=True)
    coefficients = torch.randn(2, HEADS, triton.cdiv(length, group), rank, requires_grad=True)
    basis = torch.randn(HEADS, rank, head_dim, dtype=dtype, requires_grad=basis_grad)
    out = read_memory(q, coefficients, basis, head_dim ** -0.5, group)
    out.backward(torch.ones_like(out))


def decode_step_case(dtype: torch.dtype, head_dim: int, switches: tuple[bool, ...]) -> None:
    """One decoding step: the ring of the layers' window or of a window of 128 (the largest tile)."""
    wide, bias, read_scale, dissection = switches
    window, batch = 128 if wide else WINDOW, 3
    rank = head_dim
    q, k, v = (torch.randn(batch, 1, HEADS, head_dim, dtype=dtype) for _ in range(3))
    ring = torch.zeros(batch, HEADS, 2 * window, head_dim, dtype=dtype)
    sums = [torch.zeros(batch, HEADS, *shape) for shape in ((rank,), (), (rank,), ())]
    cache = LavoStepCache(ring, ring.clone(), torch.zeros(batch, 2 * window, dtype=torch.bool), *sums,
                          torch.zeros(batch, HEADS, dtype=torch.int64), position=0, window=window)
    decode_step_triton(q, k, v, torch.randn(HEADS, rank, head_dim, dtype=dtype), cache,
                       pos_bias=torch.zeros(HEADS, 2 * window) if bias else None, dissection=dissection,
                       real=torch.ones(batch, dtype=torch.bool), scale=head_dim ** -0.5,
                       read_scale=torch.ones(HEADS) if read_scale else None)


CASES = {window_attention_case: 4, memory_read_case: 3, decode_step_case: 4}  # each with its number of switches
# Beyond the matrix: the memory read at D = 128 with a basis tile below the large ones (rank 32), in each dtype,
# per token and per window, with the basis gradient (float32 needed up to 196 KB pipelined, more than an A100 has).
EXTRA = [(memory_read_case, dtype, 128, (False, per_token, True)) for dtype in DTYPES for per_token in (True, False)]
WIDE_CASES = (window_attention_case, memory_read_case)  # the launchers with a form for offsets past 2^31


def settings(switch_count: int, fast: bool, fast_head_dim: int = 128):
    """``(dtype, D, switches)`` for one launcher. Per dtype, over its four ``D``: a setting, its complement, another
    and its complement (the settings counting up in binary over the dtypes), so that every switch is on and off in
    each dtype. ``fast``: every switch on, bfloat16, ``D = fast_head_dim`` (all of a kernel's code; 128, the
    largest tiles the kernels are sized for)."""
    if fast:
        return [(torch.bfloat16, fast_head_dim, (True,) * switch_count)]
    chosen = []
    for dtype_index, dtype in enumerate(DTYPES):
        for index, d in enumerate(HEAD_DIMS):
            count, flip = 2 * dtype_index + index // 2, index % 2 == 1
            chosen.append((dtype, d, tuple(bool(count >> bit & 1) != flip for bit in range(switch_count))))
    return chosen


@contextlib.contextmanager
def wide_offsets_forced():
    """Within: the launchers pick their int64-offsets form (``WIDE``) for any size, as past 2^31 elements."""
    original = window_kernels.INT32_OFFSETS
    window_kernels.INT32_OFFSETS = 0
    try:
        yield
    finally:
        window_kernels.INT32_OFFSETS = original


@contextlib.contextmanager
def shared_memory_of(arch: str):
    """Within: the launchers choose their configurations as on a GPU of ``arch`` (CPU tensors report none)."""
    small = LIMITS[arch]["shared"] < A100_SHARED_MEMORY
    originals = [(module, module.small_shared_memory) for module in (window_kernels, read_kernels)]
    for module, _ in originals:
        module.small_shared_memory = lambda q: small
    try:
        yield
    finally:
        for module, original in originals:
            module.small_shared_memory = original


def recorded(arch: str, fast: bool, fast_head_dim: int = 128) -> list[tuple]:
    """The launches of every case, as on a GPU of ``arch``: ``(kernel, args, kwargs)``."""
    with recorded_launches() as launches, shared_memory_of(arch):
        for case, switch_count in CASES.items():
            for dtype, head_dim, switches in settings(switch_count, fast, fast_head_dim):
                case(dtype, head_dim, switches)
        for case, dtype, head_dim, switches in [] if fast else EXTRA:
            case(dtype, head_dim, switches)
        with wide_offsets_forced():
            for case in WIDE_CASES:
                case(*settings(CASES[case], True, fast_head_dim)[0])
    return launches


@contextlib.contextmanager
def recorded_launches():
    """Within: ``kernel[grid](...)`` launches nothing and appends ``(kernel, args, kwargs)`` to the list."""
    launches = []

    def record(kernel, *args, grid, warmup, **kwargs):
        launches.append((kernel, args, kwargs))

    original = JITFunction.run
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict, target: GPUTarget):
    """What ``kernel[grid](*args, **kwargs)`` compiles on a ``target`` GPU (Triton's launch path, less the
    driver), and the key of its specialization."""
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    key = repr((kernel.fn.__name__, signature, constexprs, attrs, sorted(options.__dict__.items())))
    return key, lambda: triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                       options=options.__dict__)


def registers_and_stack(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and bytes of stack frame per thread of a one-kernel cubin, by ``cuobjdump``: registers
    that do not fit spill to the stack (its ``LOCAL`` count stays 0 for them)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", file.name], check=True,
                               capture_output=True, text=True).stdout
    registers, stack = (int(re.search(rf"\b{name}:(\d+)", usage).group(1)) for name in ("REG", "STACK"))
    return registers, stack


def check(compiled, arch: str) -> tuple[str, list[str]]:
    """A line on the compiled kernel's resources, and what exceeds the ``arch``'s limits."""
    registers, stack = registers_and_stack(compiled.asm["cubin"])
    threads = compiled.metadata.num_warps * 32
    shared = compiled.metadata.shared
    limits = LIMITS[arch]
    over = [f"shared memory {shared} > {limits['shared']} bytes"] * (shared > limits["shared"])
    over += [f"registers {registers} x {threads} threads > {limits['registers']}"] * (
        registers * threads > limits["registers"])
    return f"shared {shared:6d} B  registers {registers:3d} x {threads:3d} threads  stack {stack:5d} B", over


def describe(kernel: JITFunction, args: tuple, kwargs: dict) -> str:
    """The kernel, its input dtype and its constexprs, for a reader."""
    tensors = [x.dtype for x in args if isinstance(x, torch.Tensor) and x.is_floating_point()]
    switches = ", ".join(f"{name}={value}" for name, value in kwargs.items() if name in kernel.arg_names)
    return f"{kernel.fn.__module__.removeprefix('lavo.ops.')}.{kernel.fn.__name__} {tensors[0]} ({switches})"


def all_kernels() -> set[str]:
    """Every kernel the package launches: ``name[`` in a module that defines ``@triton.jit`` functions."""
    launched = set()
    for path in Path(lavo.__file__).parent.rglob("*.py"):
        source = path.read_text()
        if "@triton.jit" in source:
            module = ".".join(path.relative_to(Path(lavo.__file__).parent.parent).with_suffix("").parts)
            launched |= {f"{module}.{name}" for name in re.findall(r"\b(\w+)\[", source)
                         if f"@triton.jit\ndef {name}(" in source}
    return launched


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="one case per launcher, every switch on")
    parser.add_argument("--head-dim", type=int, default=128,
                        help="D of the --fast case (128; the kernels are not sized for more: backend='auto' keeps "
                        "wider heads on torch)")
    parser.add_argument("--targets", type=lambda names: names.split(","), default=list(TARGETS),
                        help=f"comma-separated targets to compile for (default: all, {','.join(TARGETS)})")
    options = parser.parse_args()
    if unknown := sorted(set(options.targets) - set(TARGETS)):
        parser.error(f"unknown targets {unknown}; choose from {list(TARGETS)}")
    launches = {arch: recorded(arch, options.fast, options.head_dim) for arch in options.targets}
    reached = {f"{kernel.fn.__module__}.{kernel.fn.__name__}" for arch in options.targets
               for kernel, _, _ in launches[arch]}
    failures = [f"never launched by a case: {name}" for name in sorted(all_kernels() - reached)]
    seen, compiled_count = set(), 0
    for arch in options.targets:
        for kernel, args, kwargs in launches[arch]:
            key, build = compile_launch(kernel, args, kwargs, TARGETS[arch])
            if (arch, key) in seen:
                continue
            seen.add((arch, key))
            name = f"{arch} {describe(kernel, args, kwargs)}"
            start = time.perf_counter()
            try:
                line, over = check(build(), arch)
            except Exception:  # a compile error: reported with the kernel, the others still compiled
                failures.append(f"{name}\n{traceback.format_exc(limit=0)}")
                continue
            compiled_count += 1
            print(f"{line}  {time.perf_counter() - start:4.1f} s  {name}", flush=True)
            failures += [f"{name}: {problem}" for problem in over]
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    print(f"compiled {compiled_count} kernels, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
