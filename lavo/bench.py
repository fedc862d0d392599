"""Efficiency benchmark: ``python -m lavo.bench --help``.

Four sections, each selectable with ``--sections``:

``attention``
    Every registered attention layer (``dim = H * D``, with its projections) and two raw ops, the
    :func:`~lavo.ops.lavo_attention` op and ``scaled_dot_product_attention(is_causal=True)`` (SDPA): forward
    (under ``no_grad``) and forward + backward time and peak memory against the sequence length. Quadratic
    mechanisms stop at ``--max-quadratic-length``. ``ratio`` is the time over SDPA's at the same length and pass.
``decode``
    Per-token step time and cache bytes against the context length for causal layers with a decoding form.
``model``
    Training throughput (tokens/s; forward, loss, backward, clipping, AdamW step) and peak memory of the whole
    language model for a preset, per attention.
``flops``
    LAVO's own FLOPs counted analytically (:func:`lavo_flops`), divided by the measured op time, against the rate
    of a large square matmul measured in the same run.

Each measurement: ``--warmup`` untimed calls, one untimed call whose peak memory is measured, then ``--repeats``
timed calls; the median is reported. Peak memory on CPU is the growth of the process's resident set during the
call (``/proc/self/clear_refs`` resets the high-water mark ``VmHWM``; ``None`` where that is not possible); on
CUDA it is ``max_memory_allocated`` above the memory allocated before the call.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .ops.local import blocked as local_ops

SECTIONS = ("attention", "decode", "model", "flops")
PASSES = ("fwd", "fwd+bwd")
OPS = ("lavo_attention", "sdpa")
OP_NAMES = {"lavo_attention": "lavo_attention (op)", "sdpa": "sdpa (op)"}
SDPA = OP_NAMES["sdpa"]
QUADRATIC = {"softmax", SDPA}  # mechanisms whose cost grows with T^2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIB = 2 ** 20

# Full-run and --quick values of the settings the user did not give.
FULL = dict(lengths=[2 ** i for i in range(10, 17)], max_quadratic_length=16384, repeats=5, warmup=1,
            decode_lengths=[2 ** i for i in range(10, 17)], decode_steps=32, model_preset="small",
            model_lengths=[1024, 4096], model_repeats=3, matmul_size=2048, time_limit=60.0, heads=8, head_dim=64,
            rank=64, window=128, model_overrides={})
QUICK = dict(lengths=[128, 256], max_quadratic_length=256, repeats=2, warmup=1, decode_lengths=[128, 256],
             decode_steps=4, model_preset="tiny", model_lengths=[64], model_repeats=1, matmul_size=256,
             time_limit=30.0, heads=2, head_dim=16, rank=16, window=32,
             model_overrides=dict(dim=64, heads=2, depth=2, vocab_size=512))


# --------------------------------------------------------------------------------------------------- measuring

def tensor_nbytes(obj: Any) -> int:
    """Bytes of every tensor reachable from ``obj`` through dataclasses, named tuples, tuples, lists, sets and
    dict values; each tensor object counts once (a tensor referenced twice is stored once). Other objects (ints,
    None, strings) count zero."""
    seen: set[int] = set()

    def walk(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return 0
            seen.add(id(x))
            return x.numel() * x.element_size()
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return sum(walk(getattr(x, f.name)) for f in dataclasses.fields(x))
        if isinstance(x, (tuple, list, set, frozenset)):
            return sum(walk(item) for item in x)
        if isinstance(x, dict):
            return sum(walk(item) for item in x.values())
        return 0

    return walk(obj)


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _release_free_memory() -> None:
    """Return freed heap memory to the system (glibc), so that the next call's growth is its own working set."""
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Peak memory of one call, in MiB: ``with PeakMemory(device) as peak: f()`` then ``peak.mib``."""

    def __init__(self, device: torch.device):
        self.device, self.mib, self._before = device, None, None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
            return self
        _release_free_memory()
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # reset VmHWM to the current resident set
        except OSError:
            return self
        self._before = _proc_status_kib("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self._before is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.mib = (torch.cuda.max_memory_allocated(self.device) - self._before) / MIB
            return
        peak = _proc_status_kib("VmHWM")
        if peak is not None:
            self.mib = max(0, peak - self._before) / 1024


def available_mib(device: torch.device) -> float | None:
    """Memory that can still be allocated: ``MemAvailable`` on CPU, free device memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / MIB
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


class TooSlow(Exception):
    """One call took longer than the time limit."""


@dataclass
class Measurement:
    ms: float
    times_ms: list
    peak_mib: float | None


def measure(fn: Callable[[], Any], device: torch.device, *, repeats: int, warmup: int,
            time_limit: float) -> Measurement:
    """Warm-up calls, one call under :class:`PeakMemory`, then ``repeats`` timed calls; median time in ms.
    Raises :class:`TooSlow` as soon as a call exceeds ``time_limit`` seconds."""
    def call() -> float:
        seconds = _timed(fn, device)
        if seconds > time_limit:
            raise TooSlow(f"one call took {seconds:.3g} s > --time-limit {time_limit:g} s")
        return seconds

    for _ in range(warmup):
        call()
    with PeakMemory(device) as peak:
        call()
    times = [call() * 1e3 for _ in range(max(1, repeats))]
    return Measurement(statistics.median(times), times, peak.mib)


# ------------------------------------------------------------------------------------------------------- FLOPs

def lavo_flops(batch: int, length: int, heads: int, head_dim: int, rank: int, window: int, *,
               backward: bool = False, causal: bool = True, basis_grad: bool = False) -> dict[str, int]:
    r"""Matmul FLOPs of one :func:`~lavo.ops.lavo_attention` call with context dissection (a multiply-add counts
    2; softmax, masking, sums and other elementwise work are not counted).

    Per batch element and head, with ``T' = ceil(T / w) w`` (the padded length: whole blocks are computed),
    ``n = T' / w`` windows, ``K = 2w`` keys per block causal (``3w`` non-causal), ``D`` the head dim and ``r`` the
    rank:

    - local branch, forward: ``Q K^T`` and ``P V`` over every block's ``K`` keys: ``2 * 2 T' K D``.
    - local branch, backward: ``dV = P^T dO``, ``dP = dO V^T``, ``dQ = dS K`` and ``dK = dS^T Q``
      (``4 * 2 T' K D``), plus the recomputed scores (``2 T' K D``) when the whole sequence's weights exceed
      ``lavo.ops.local.SAVED_WEIGHTS_LIMIT`` elements and are not kept.
    - memory branch, forward: each window's feature sum projected once (``2 n r D``), the queries projected and
      the read ``(weights * H) @ basis`` (``2 * 2 T' r D``).
    - memory branch, backward: the read recomputes the query projection and runs two gradient matmuls
      (``3 * 2 T' r D``), two more when the basis is learned; the window projection's gradient is ``2 n r D``
      (twice that with a learned basis).

    Returns:
        ``{"local": ..., "memory": ..., "total": ...}`` for the forward, or forward + backward when ``backward``.
    """
    padded = math.ceil(length / window) * window
    keys = (2 if causal else 3) * window
    unit_local = 2 * padded * keys * head_dim * batch * heads  # one [T', K, D] matmul
    unit_memory = 2 * padded * rank * head_dim * batch * heads  # one [T', r, D] matmul
    per_window = unit_memory // window  # one [n, r, D] matmul
    local = 2 * unit_local
    memory = 2 * unit_memory + per_window
    if backward:
        recomputed = padded * keys * batch * heads > local_ops.SAVED_WEIGHTS_LIMIT
        local += (5 if recomputed else 4) * unit_local
        memory += (5 if basis_grad else 3) * unit_memory + (2 if basis_grad else 1) * per_window
    return {"local": local, "memory": memory, "total": local + memory}


def matmul(size: int, dtype: torch.dtype, device: torch.device) -> Callable[[], Any]:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return lambda: torch.matmul(a, b)


# ---------------------------------------------------------------------------------------------------- settings

@dataclass
class Settings:
    sections: list
    attentions: list
    ops: list
    passes: list
    lengths: list
    max_quadratic_length: int
    batch: int
    heads: int
    head_dim: int
    rank: int
    window: int
    dtype: str
    repeats: int
    warmup: int
    time_limit: float
    decode_attentions: list
    decode_lengths: list
    decode_steps: int
    model_preset: str
    model_overrides: dict
    model_attentions: list
    model_lengths: list
    model_batch: int
    model_repeats: int
    matmul_size: int
    attention_options: dict
    device: str
    threads: int | None
    seed: int
    quick: bool

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def mechanism_options(name: str, settings: Settings, max_length: int) -> dict:
    """Options each mechanism is built with: the paper's window and rank where they apply, cosFormer's horizon
    long enough for the longest sequence, then ``--attention-options`` on top."""
    w, r = settings.window, settings.rank
    defaults = {"lavo": dict(window=w, rank=r), "local": dict(window=w), "longshort": dict(window=w),
                "cosformer": dict(max_length=max_length)}
    return {**defaults.get(name, {}), **settings.attention_options.get(name, {})}


def machine_info(settings: Settings) -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    info = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu": cpu, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "device": settings.device, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with contextlib.suppress(AttributeError):
        info["affinity"] = sorted(os.sched_getaffinity(0))
    if settings.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(settings.device))
    return info


# ----------------------------------------------------------------------------------------------------- running

def record(section: str, level: str, mechanism: str, op: str, length: int, settings: Settings, *,
           batch: int | None = None, **extra) -> dict:
    """One JSON record; ``status`` is ``ok``, ``skipped`` or ``failed``, with the reason in ``note``."""
    entry = dict(section=section, level=level, mechanism=mechanism, op=op, length=length,
                 batch=settings.batch if batch is None else batch, dtype=settings.dtype, ms=None, times_ms=None,
                 peak_mib=None, ratio=None, ratio_to=None, status="ok", note="")
    entry.update(extra)
    return entry


class Runner:
    """Runs measurements in order, skipping the longer lengths of a mechanism once one failed or once its time
    is predicted (linear or quadratic growth from the last length measured) to exceed the time limit."""

    def __init__(self, settings: Settings, progress):
        self.settings, self.progress = settings, progress
        self.device = torch.device(settings.device)
        self.records: list[dict] = []
        self._last: dict[tuple, tuple[int, float | None, float | None]] = {}  # length, ms, peak MiB

    def autocast(self):
        if self.settings.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.settings.torch_dtype)

    def skip_reason(self, key: tuple, length: int, quadratic: bool) -> str | None:
        if key not in self._last:
            return None
        last_length, last_ms, last_peak = self._last[key]
        if last_ms is None:
            return f"skipped: length {_length(last_length)} failed or was skipped"
        growth = (length / last_length) ** (2 if quadratic else 1)
        if last_ms / 1e3 * growth > self.settings.time_limit:
            return (f"skipped: predicted {last_ms / 1e3 * growth:.0f} s per call > --time-limit "
                    f"{self.settings.time_limit:g} s")
        available = available_mib(self.device)
        if last_peak is not None and available is not None and last_peak * growth > 0.8 * available:
            return f"skipped: predicted peak {last_peak * growth:.0f} MiB > 80% of the {available:.0f} MiB available"
        return None

    def run(self, entry: dict, key: tuple, quadratic: bool, work: Callable[[dict], None]) -> dict:
        """Fill ``entry`` by ``work(entry)`` (which sets ``ms`` etc.), catching failures and slowness."""
        length = entry["length"]
        reason = self.skip_reason(key, length, quadratic)
        if reason is not None:
            entry.update(status="skipped", note=reason)
        else:
            try:
                work(entry)
            except TooSlow as slow:
                entry.update(status="skipped", note=f"skipped: {slow}", ms=None)
            except Exception as error:  # a benchmark reports failures instead of stopping
                entry.update(status="failed", note=f"failed: {type(error).__name__}: {str(error)[:200]}", ms=None)
            finally:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self._last[key] = (length, entry["ms"], entry["peak_mib"])
        self.records.append(entry)
        if self.progress is not None:
            self.progress.set_postfix_str(f"{entry['mechanism']} {entry['op']} {length}", refresh=False)
            self.progress.update(1)
        return entry

    def measure(self, fn: Callable[[], Any], repeats: int | None = None) -> Measurement:
        s = self.settings
        return measure(fn, self.device, repeats=s.repeats if repeats is None else repeats, warmup=s.warmup,
                       time_limit=s.time_limit)


def _fill(entry: dict, result: Measurement) -> None:
    entry.update(ms=result.ms, times_ms=[round(t, 4) for t in result.times_ms], peak_mib=result.peak_mib)


# ------------------------------------------------------------------------------------------- attention section

def _attention_plan(settings: Settings) -> list[tuple[str, str, int]]:
    """(mechanism, pass, length) in run order: SDPA first at each length, so ratios can be taken."""
    names = [OP_NAMES[op] for op in settings.ops] + list(settings.attentions)
    names.sort(key=lambda name: name != SDPA)
    plan = []
    for name in names:
        for length in settings.lengths:
            if name in QUADRATIC and length > settings.max_quadratic_length:
                continue
            plan += [(name, p, length) for p in settings.passes]
    return plan


def _op_inputs(name: str, settings: Settings, length: int, device: torch.device, grad: bool):
    from .ops import orthogonal_basis

    B, H, D, dtype = settings.batch, settings.heads, settings.head_dim, settings.torch_dtype
    shape = (B, H, length, D) if name == SDPA else (B, length, H, D)
    q, k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_(grad) for _ in range(3))
    if name == SDPA:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v)
    from .ops import lavo_attention
    basis = orthogonal_basis(H, settings.rank, D, device=device)
    pos_bias = torch.zeros(H, 2 * settings.window, device=device, requires_grad=grad)
    return (lambda: lavo_attention(q, k, v, basis, window=settings.window, causal=True, pos_bias=pos_bias),
            (q, k, v, pos_bias))


def attention_call(name: str, settings: Settings, length: int, which: str, runner: Runner) -> Callable[[], Any]:
    """A no-argument function running one forward (``fwd``, under no_grad) or forward + backward of ``name``."""
    device, grad = runner.device, which == "fwd+bwd"
    if name in OP_NAMES.values():
        forward, leaves = _op_inputs(name, settings, length, device, grad)
    else:
        from .registry import build_attention
        options = mechanism_options(name, settings, max(settings.lengths))
        layer = build_attention(name, settings.dim, settings.heads, causal=True, **options).to(device)
        x = torch.randn(settings.batch, length, settings.dim, device=device, requires_grad=grad)
        leaves = [x, *layer.parameters()]

        def forward():
            with runner.autocast():
                return layer(x)[0]
    if not grad:
        def call():
            with torch.no_grad():
                forward()
        return call
    grads: dict[torch.dtype, torch.Tensor] = {}

    def step():
        y = forward()
        if y.dtype not in grads:
            grads[y.dtype] = torch.randn(y.shape, device=device).to(y.dtype)
        y.backward(grads[y.dtype])
        # Dropped at the end, not the start: a measured call's peak then includes the gradients it makes, and no
        # earlier call's gradients are freed inside it to make room.
        for leaf in leaves:
            leaf.grad = None
    return step


def run_attention(runner: Runner) -> None:
    s = runner.settings
    sdpa_ms: dict[tuple[str, int], float] = {}
    for name, which, length in _attention_plan(s):
        level = "op" if name in OP_NAMES.values() else "layer"
        entry = record("attention", level, name, which, length, s, heads=s.heads, head_dim=s.head_dim)

        def work(entry, name=name, which=which, length=length):
            _fill(entry, runner.measure(attention_call(name, s, length, which, runner)))

        runner.run(entry, ("attention", name, which), name in QUADRATIC, work)
        if name == SDPA and entry["ms"] is not None:
            sdpa_ms[which, length] = entry["ms"]
        if entry["ms"] is not None and (which, length) in sdpa_ms:
            entry.update(ratio=entry["ms"] / sdpa_ms[which, length], ratio_to=SDPA)


# ---------------------------------------------------------------------------------------------- decode section

def prefill(layer, x: torch.Tensor, settings: Settings):
    """The cache after the context ``x``, without grad. A softmax layer's key/value cache is filled directly past
    ``--max-quadratic-length`` (same contents, without computing the quadratic attention): returns (cache,
    whether the layer really ran)."""
    from .layers.softmax import SoftmaxAttention
    from .ops.softmax import apply_rotary

    with torch.no_grad():
        if isinstance(layer, SoftmaxAttention) and x.shape[1] > settings.max_quadratic_length:
            _, k, v = layer.to_qkv(x).view(*x.shape[:2], 3, layer.heads, layer.head_dim).unbind(2)
            if layer.rotary:
                k = apply_rotary(k, 0)
            return layer.empty_cache(x.shape[0], device=x.device).append(k, v, None), False
        return layer(x)[1], True


def run_decode(runner: Runner) -> None:
    from .registry import build_attention

    s, device = runner.settings, runner.device
    reference: dict[int, float] = {}
    names = sorted(s.decode_attentions, key=lambda name: name != "softmax")
    for name in names:
        for length in s.decode_lengths:
            entry = record("decode", "layer", name, "decode_step", length, s, steps=s.decode_steps,
                           cache_bytes=None, prefill_ms=None)

            def work(entry, name=name, length=length):
                options = mechanism_options(name, s, max(s.decode_lengths) + s.decode_steps + s.warmup + 2)
                layer = build_attention(name, s.dim, s.heads, causal=True, **options).to(device).eval()
                if not getattr(layer, "supports_decoding", False):
                    raise ValueError(f"{name} has no decoding form")
                context = torch.randn(s.batch, length, s.dim, device=device)
                with runner.autocast():
                    start = time.perf_counter()
                    cache, ran = prefill(layer, context, s)
                    _sync(device)
                    if ran:
                        entry["prefill_ms"] = (time.perf_counter() - start) * 1e3
                    else:
                        entry["note"] = "cache filled directly (context past --max-quadratic-length)"
                if cache is None:
                    raise ValueError(f"{name} returned no cache")
                entry["cache_bytes"] = tensor_nbytes(cache)
                token = torch.randn(s.batch, 1, s.dim, device=device)
                state = {"cache": cache}

                def step():
                    with torch.no_grad(), runner.autocast():
                        state["cache"] = layer(token, cache=state["cache"])[1]
                _fill(entry, runner.measure(step, repeats=s.decode_steps))

            runner.run(entry, ("decode", name), False, work)
            if name == "softmax" and entry["ms"] is not None:
                reference[length] = entry["ms"]
            if entry["ms"] is not None and length in reference:
                entry.update(ratio=entry["ms"] / reference[length], ratio_to="softmax")


# ----------------------------------------------------------------------------------------------- model section

def model_for(name: str, settings: Settings, max_length: int):
    from .model import PRESETS, build_model, model_config

    options = mechanism_options(name, settings, max_length)
    shape = {**PRESETS[settings.model_preset], **settings.model_overrides}
    if "rank" in options:  # a rank above the head dim does not exist (tiny preset: D = 48)
        options["rank"] = min(options["rank"], shape["dim"] // shape["heads"])
    position = "rope" if name == "softmax" else "none"
    label = "softmax+rope" if name == "softmax" else name
    config = model_config(settings.model_preset, attention=name, attention_options=options, position=position,
                          **settings.model_overrides)
    return label, build_model(config)


def run_model(runner: Runner) -> None:
    s, device = runner.settings, runner.device
    reference: dict[int, float] = {}
    names = sorted(s.model_attentions, key=lambda name: name != "softmax")
    for name in names:
        for length in s.model_lengths:
            label = "softmax+rope" if name == "softmax" else name
            if name == "softmax" and length > s.max_quadratic_length:
                continue
            entry = record("model", "model", label, "train_step", length, s, batch=s.model_batch,
                           preset=s.model_preset, model_overrides=s.model_overrides, tokens_per_s=None,
                           parameters=None)

            def work(entry, name=name, length=length):
                _, model = model_for(name, s, max(s.model_lengths))
                model.to(device).train()
                entry["parameters"] = sum(p.numel() for p in model.parameters())
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
                ids = torch.randint(model.config.vocab_size, (s.model_batch, length + 1), device=device)

                def step():
                    with runner.autocast():
                        logits, _ = model(ids[:, :-1])
                    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                _fill(entry, runner.measure(step, repeats=s.model_repeats))
                entry["tokens_per_s"] = s.model_batch * length / (entry["ms"] / 1e3)

            runner.run(entry, ("model", name), name == "softmax", work)
            if name == "softmax" and entry["ms"] is not None:
                reference[length] = entry["ms"]
            if entry["ms"] is not None and length in reference:
                entry.update(ratio=entry["ms"] / reference[length], ratio_to="softmax+rope")


# ----------------------------------------------------------------------------------------------- flops section

def run_flops(runner: Runner) -> None:
    s, device = runner.settings, runner.device
    rates: dict[str, float] = {}
    for dtype in dict.fromkeys(["fp32", s.dtype]):
        entry = record("flops", "op", "matmul", "matmul", s.matmul_size, s, batch=1, gflop=None,
                       gflops_per_s=None)
        entry["dtype"] = dtype

        def work(entry, dtype=dtype):
            _fill(entry, runner.measure(matmul(s.matmul_size, DTYPES[dtype], device)))
            entry["gflop"] = 2 * s.matmul_size ** 3 / 1e9
            entry["gflops_per_s"] = entry["gflop"] / (entry["ms"] / 1e3)
            rates[dtype] = entry["gflops_per_s"]

        runner.run(entry, ("flops", "matmul", dtype), False, work)
    name = OP_NAMES["lavo_attention"]
    measured = {(r["op"], r["length"]): r for r in runner.records
                if r["section"] == "attention" and r["mechanism"] == name}
    for which in s.passes:
        for length in s.lengths:
            count = lavo_flops(s.batch, length, s.heads, s.head_dim, s.rank, s.window, backward=which == "fwd+bwd")
            entry = record("flops", "op", name, which, length, s, gflop=count["total"] / 1e9,
                           gflop_local=count["local"] / 1e9, gflop_memory=count["memory"] / 1e9, gflops_per_s=None,
                           matmul_gflops_per_s=rates.get(s.dtype), matmul_gflops_per_s_fp32=rates.get("fp32"))

            def work(entry, which=which, length=length):
                if (which, length) in measured:
                    source = measured[which, length]
                    if source["ms"] is None:
                        raise TooSlow(f"not measured in the attention section ({source['note']})")
                    entry.update(ms=source["ms"], times_ms=source["times_ms"], peak_mib=source["peak_mib"])
                else:
                    _fill(entry, runner.measure(attention_call(name, s, length, which, runner)))
                entry["gflops_per_s"] = entry["gflop"] / (entry["ms"] / 1e3)
                if entry["matmul_gflops_per_s"]:
                    entry.update(ratio=entry["gflops_per_s"] / entry["matmul_gflops_per_s"], ratio_to="matmul")

            runner.run(entry, ("flops", name, which), False, work)


# ------------------------------------------------------------------------------------------------------ output

def _number(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(x)))
    return f"{x:.{max(0, digits - 1 - magnitude)}f}" if magnitude < digits else f"{x:.0f}"


def _length(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _wide_table(records: list[dict], row: Callable[[dict], str], cell: Callable[[dict], str],
                title: str, notes: bool = True) -> list[str]:
    """Rows by ``row(record)``, one column per length; the reasons of skipped or failed records are listed
    below (``notes``), or given in an earlier table of the same records."""
    lengths = sorted({r["length"] for r in records})
    rows: dict[str, dict[int, dict]] = {}
    for r in records:
        rows.setdefault(row(r), {})[r["length"]] = r
    lines = [f"| {title} | " + " | ".join(_length(n) for n in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    with_notes, notes = notes, []
    for name, cells in rows.items():
        texts = []
        for n in lengths:
            r = cells.get(n)
            if r is None:
                texts.append("")
            elif r["status"] != "ok":
                notes.append(f"{name} at {_length(n)}: {r['note']}")
                texts.append(f"— [{len(notes)}]" if with_notes else "—")
            else:
                texts.append(cell(r))
        lines.append(f"| {name} | " + " | ".join(texts) + " |")
    if with_notes and notes:
        lines += [""] + [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    return lines


def _ratio(r: dict) -> str:
    return f" (×{_number(r['ratio'], 2)})" if r.get("ratio") is not None else ""


def markdown(records: list[dict], info: dict, settings: Settings) -> str:
    out = [f"# lavo benchmark ({settings.dtype}, {info['device']}: {info['cpu']}, {info['threads']} threads, "
           f"torch {info['torch']})", ""]
    attention = [r for r in records if r["section"] == "attention"]
    for which in settings.passes:
        part = [r for r in attention if r["op"] == which]
        if not part:
            continue
        out += [f"## Attention, {which}: B={settings.batch}, H={settings.heads}, D={settings.head_dim}; "
                f"ms (× SDPA op at the same length)", ""]
        out += _wide_table(part, lambda r: r["mechanism"], lambda r: _number(r["ms"]) + _ratio(r), "mechanism")
        out += ["", f"## Attention, {which}: peak memory growth, MiB", ""]
        out += _wide_table(part, lambda r: r["mechanism"], lambda r: _number(r["peak_mib"]), "mechanism", False)
        out.append("")
    decode = [r for r in records if r["section"] == "decode"]
    if decode:
        out += ["## Decoding: ms per token step at a context length (× softmax)", ""]
        out += _wide_table(decode, lambda r: r["mechanism"], lambda r: _number(r["ms"]) + _ratio(r), "mechanism")
        out += ["", "## Decoding: cache MiB after the context", ""]
        out += _wide_table(decode, lambda r: r["mechanism"],
                           lambda r: _number(r["cache_bytes"] / MIB if r["cache_bytes"] is not None else None),
                           "mechanism", False)
        out.append("")
    model = [r for r in records if r["section"] == "model"]
    if model:
        shape = f" ({', '.join(f'{k}={v}' for k, v in settings.model_overrides.items())})" \
            if settings.model_overrides else ""
        out += [f"## Model `{settings.model_preset}`{shape}, training step, batch {settings.model_batch}: tokens/s "
                f"(step time × softmax+rope) / peak MiB", ""]
        out += _wide_table(model, lambda r: r["mechanism"],
                           lambda r: f"{_number(r['tokens_per_s'])}{_ratio(r)} / {_number(r['peak_mib'])}",
                           "attention")
        out.append("")
    flops = [r for r in records if r["section"] == "flops"]
    if flops:
        rates = [r for r in flops if r["mechanism"] == "matmul"]
        out += ["## LAVO op FLOP efficiency: GFLOP/s (fraction of the matmul rate)", ""]
        out += [f"matmul {r['length']}x{r['length']} {r['dtype']}: " + (
            f"{_number(r['gflops_per_s'])} GFLOP/s" if r["status"] == "ok" else r["note"]) for r in rates]
        out.append("")
        out += _wide_table([r for r in flops if r["mechanism"] != "matmul"], lambda r: r["op"],
                           lambda r: f"{_number(r['gflops_per_s'])} ({100 * (r['ratio'] or 0):.0f}%)", "pass")
        out.append("")
    return "\n".join(out)


def plots(records: list[dict], directory: Path, settings: Settings) -> list[Path]:
    """PNG plots, log-log, one line per mechanism; returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []

    def plot(name: str, part: list[dict], value: Callable[[dict], float | None], ylabel: str, title: str,
             xlabel: str = "sequence length") -> None:
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in part:
            y = value(r) if r["status"] == "ok" else None
            if y is not None and y > 0:
                lines.setdefault(r["mechanism"], []).append((r["length"], y))
        if not lines:
            return
        figure, axes = plt.subplots(figsize=(8, 4.5))
        for label, points in lines.items():
            points.sort()
            style = "--" if label.endswith("(op)") else "-"
            axes.plot(*zip(*points), style, marker="o", markersize=3, label=label)
        axes.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
        ticks = sorted({n for points in lines.values() for n, _ in points})
        axes.set_xticks(ticks, [_length(n) for n in ticks])
        axes.minorticks_off() if len(ticks) > 1 else None
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        figure.tight_layout()
        path = directory / name
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)

    attention = [r for r in records if r["section"] == "attention"]
    for which in settings.passes:
        part = [r for r in attention if r["op"] == which]
        tag = which.replace("+", "_")
        plot(f"time_{tag}.png", part, lambda r: r["ms"], "ms", f"{which} time ({settings.dtype})")
        plot(f"memory_{tag}.png", part, lambda r: r["peak_mib"], "peak memory growth (MiB)",
             f"{which} peak memory ({settings.dtype})")
    decode = [r for r in records if r["section"] == "decode"]
    plot("decode_step.png", decode, lambda r: r["ms"], "ms per token", "decoding step time", "context length")
    plot("decode_cache.png", decode, lambda r: r["cache_bytes"] / MIB if r.get("cache_bytes") else None,
         "cache (MiB)", "decoding cache size", "context length")
    model = [r for r in records if r["section"] == "model"]
    plot("model_tokens_per_s.png", model, lambda r: r.get("tokens_per_s"), "tokens/s",
         f"training throughput, {settings.model_preset} model")
    return written


# ---------------------------------------------------------------------------------------------------------- CLI

def _list(kind):
    def parse(text: str) -> list:
        return [kind(item.strip()) for item in text.split(",") if item.strip()]
    return parse


def _length_value(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lavo.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Efficiency benchmark of LAVO and the other attention mechanisms: time and peak memory of "
                    "the layers and raw ops, decoding step time and cache size, whole-model training throughput "
                    "and LAVO's FLOP efficiency. Prints markdown tables; see benchmarks/README.md.",
        epilog="Lengths accept a K suffix (1K = 1024). Defaults in brackets are the full run's; --quick uses tiny "
               "sizes for any setting not given.")
    a = parser.add_argument
    a("--sections", type=_list(str), default=list(SECTIONS),
      help=f"comma-separated sections to run, of {','.join(SECTIONS)} [all]")
    a("--quick", action="store_true", help="tiny sizes and few repeats: a smoke run of every section in seconds")
    a("--attentions", type=_list(str), default=None,
      help="attention section: registered mechanisms to measure as layers [all registered]")
    a("--ops", type=_list(str), default=list(OPS), help=f"raw ops to measure, of {','.join(OPS)} [both]")
    a("--passes", type=_list(str), default=list(PASSES), help="fwd, fwd+bwd or both [both]")
    a("--lengths", type=_list(_length_value), default=None, help="sequence lengths [1K,2K,...,64K]")
    a("--max-quadratic-length", type=_length_value, default=None,
      help="longest sequence for softmax and SDPA (attention, model sections; decode fills longer softmax "
           "caches without running the attention) [16K]")
    a("--batch", type=int, default=1, help="batch size of the attention and decode sections [1]")
    a("--heads", type=int, default=None, help="heads H [8]")
    a("--head-dim", type=int, default=None, help="head dim D; the layers' dim is H*D [64]")
    a("--rank", type=int, default=None, help="LAVO's memory rank r [64]")
    a("--window", type=int, default=None, help="LAVO's (and local, long-short) window w [128]")
    a("--dtype", choices=sorted(DTYPES), default="fp32",
      help="fp32, or bf16: ops take bf16 inputs, layers and models run under bf16 autocast [fp32]")
    a("--repeats", type=int, default=None, help="timed calls per measurement; the median is reported [5]")
    a("--warmup", type=int, default=None, help="untimed calls before each measurement [1]")
    a("--time-limit", type=float, default=None,
      help="seconds one call may take; slower measurements and the longer lengths after them are skipped [60]")
    a("--decode-attentions", type=_list(str), default=["lavo", "softmax", "local"],
      help="decode section: mechanisms (need a decoding form) [lavo,softmax,local]")
    a("--decode-lengths", type=_list(_length_value), default=None, help="context lengths [1K,...,64K]")
    a("--decode-steps", type=int, default=None, help="timed single-token steps per context length [32]")
    a("--model-preset", default=None, help="model section: preset of lavo.model.PRESETS [small]")
    a("--model-attentions", type=_list(str), default=None,
      help="model section: attentions (softmax runs with rope) [all registered]")
    a("--model-lengths", type=_list(_length_value), default=None, help="training sequence lengths [1K,4K]")
    a("--model-batch", type=int, default=1, help="model section batch size [1]")
    a("--model-repeats", type=int, default=None, help="timed training steps per measurement [3]")
    a("--matmul-size", type=int, default=None, help="flops section: square matmul size for the peak rate [2048]")
    a("--attention-options", type=json.loads, default={},
      help='JSON options per mechanism on top of the defaults, e.g. \'{"performer": {"features": 128}}\'')
    a("--device", default="cpu", help="cpu or cuda[:N] [cpu]")
    a("--threads", type=int, default=None, help="torch intra-op threads [torch's default]")
    a("--seed", type=int, default=0, help="random seed [0]")
    a("--json", type=Path, default=None, help="write the records and machine info to this JSON file")
    a("--plots", type=Path, default=None, help="write PNG plots into this directory")
    a("--no-progress", action="store_true", help="no progress bar")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    from .registry import available_attentions

    defaults = QUICK if args.quick else FULL
    given = {key: getattr(args, key, None) for key in FULL}  # model_overrides has no option: --quick only
    values = {key: defaults[key] if value is None else value for key, value in given.items()}
    registered = available_attentions()
    for option, names, allowed in (("--sections", args.sections, SECTIONS), ("--ops", args.ops, OPS),
                                   ("--passes", args.passes, PASSES),
                                   ("--attentions", args.attentions or [], registered),
                                   ("--decode-attentions", args.decode_attentions, registered),
                                   ("--model-attentions", args.model_attentions or [], registered)):
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise SystemExit(f"{option}: unknown {unknown}; choose from {', '.join(allowed)}")
    from .model import PRESETS
    if values["model_preset"] not in PRESETS:
        raise SystemExit(f"--model-preset: unknown {values['model_preset']!r}; choose from {', '.join(PRESETS)}")
    if not isinstance(args.attention_options, dict):
        raise SystemExit("--attention-options must be a JSON object of {mechanism: {option: value}}")
    return Settings(sections=args.sections, attentions=args.attentions or registered, ops=args.ops,
                    passes=args.passes, batch=args.batch, dtype=args.dtype, decode_attentions=args.decode_attentions,
                    model_attentions=args.model_attentions or registered, model_batch=args.model_batch,
                    attention_options=args.attention_options, device=args.device, threads=args.threads,
                    seed=args.seed, quick=args.quick, **values)


def run(settings: Settings, *, progress: bool = True) -> tuple[list[dict], dict]:
    """Run the selected sections; returns (records, machine info)."""
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    _import_all()
    gc.collect()
    gc.freeze()  # later collections (one per memory measurement) skip the objects of the imported modules
    info = machine_info(settings)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=_planned(settings), desc="bench", unit="measurement", dynamic_ncols=True, file=sys.stderr)
    runner = Runner(settings, bar)
    sections = {"attention": run_attention, "decode": run_decode, "model": run_model, "flops": run_flops}
    try:
        for name in SECTIONS:
            if name in settings.sections:
                sections[name](runner)
    finally:
        if bar is not None:
            bar.close()
    return runner.records, info


def _import_all() -> None:
    """Import what the measurements import lazily (torch imports its compiler stack on first use of some ops),
    so that those modules' objects are frozen out of the garbage collections made before each measurement."""
    from . import model, ops  # noqa: F401
    from .layers import softmax  # noqa: F401
    from .registry import available_attentions
    available_attentions()
    with contextlib.suppress(Exception):
        import torch._dynamo  # noqa: F401


def _planned(settings: Settings) -> int:
    s, total = settings, 0
    if "attention" in s.sections:
        total += len(_attention_plan(s))
    if "decode" in s.sections:
        total += len(s.decode_attentions) * len(s.decode_lengths)
    if "model" in s.sections:
        total += sum(1 for name in s.model_attentions for n in s.model_lengths
                     if name != "softmax" or n <= s.max_quadratic_length)
    if "flops" in s.sections:
        total += len({"fp32", s.dtype}) + len(s.passes) * len(s.lengths)
    return total


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    records, info = run(settings, progress=not args.no_progress)
    print(markdown(records, info, settings))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": info, "settings": dataclasses.asdict(settings), "records": records}
        args.json.write_text(json.dumps(payload, indent=1))
    if args.plots is not None:
        for path in plots(records, args.plots, settings):
            print(f"plot: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
