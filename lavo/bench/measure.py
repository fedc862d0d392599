"""One measurement: ``--warmup`` untimed calls, ``--repeats`` timed calls (the median is reported), then one
untimed call whose peak memory is measured.

Peak memory on CPU is the growth of the process's resident set during the call (``/proc/self/clear_refs`` resets
the high-water mark ``VmHWM``; ``None`` where that is not possible); on CUDA it is ``max_memory_allocated`` above
the memory allocated before the call.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

MIB = 2 ** 20


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


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that the wall clock covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


class Skipped(Exception):
    """The measurement is not taken: a call took longer than the time limit, or its memory would not fit."""


@dataclass
class Measurement:
    ms: float
    times_ms: list
    peak_mib: float | None


def timed_within(fn: Callable[[], Any], device: torch.device, time_limit: float) -> float:
    """Seconds of one call; raises :class:`Skipped` when they exceed ``time_limit``."""
    seconds = _timed(fn, device)
    if seconds > time_limit:
        raise Skipped(f"one call took {seconds:.3g} s > --time-limit {time_limit:g} s")
    return seconds


def measure(fn: Callable[[], Any], device: torch.device, *, repeats: int, warmup: int, time_limit: float,
            first_call_limit: float | None = None) -> Measurement:
    """Warm-up calls, ``repeats`` timed calls, then one call under :class:`PeakMemory` (last, so that even
    without warm-up it never holds the first call's one-time allocations); median time in ms. Raises
    :class:`Skipped` as soon as a call exceeds ``time_limit`` seconds (the first call: ``first_call_limit``, when
    given: it may compile)."""
    limits = iter([max(time_limit, first_call_limit or 0.0)])

    def call() -> float:
        return timed_within(fn, device, next(limits, time_limit))

    for _ in range(warmup):
        call()
    times = [call() * 1e3 for _ in range(max(1, repeats))]
    with PeakMemory(device) as peak:
        call()
    return Measurement(statistics.median(times), times, peak.mib)


def ramp_up(device: torch.device, seconds: float = 1.0) -> None:
    """Keep a GPU busy for ``seconds`` of matrix products: an idle GPU runs at a low clock, at which the first
    measurements would be timed."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize(device)


def source_commit() -> dict:
    """The git commit of the code being measured and whether the package's files differ from it (``commit``
    None outside a git checkout, unless the environment names it: ``LAVO_SOURCE_COMMIT``, for a copy of a
    commit's files made without its git history, as on a machine the tree is sent to)."""
    package = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run(["git", *args], cwd=package, capture_output=True, text=True, timeout=30)
            if done.returncode == 0:
                return done.stdout.strip()
        return None

    commit = git("rev-parse", "HEAD")
    if commit is None and os.environ.get("LAVO_SOURCE_COMMIT"):
        return {"commit": os.environ["LAVO_SOURCE_COMMIT"], "dirty": None}
    changes = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return {"commit": commit, "dirty": None if commit is None or changes is None else bool(changes)}


def machine_info(device: str) -> dict:
    """What the numbers were measured on: versions, CPU, threads, affinity, GPU, date, and the code's commit."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    info = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu": cpu, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S"), **source_commit()}
    with contextlib.suppress(AttributeError):
        info["affinity"] = sorted(os.sched_getaffinity(0))
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info
