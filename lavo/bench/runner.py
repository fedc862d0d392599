"""Running measurements in order: one JSON record each, failures and slowness reported instead of raised, and the
longer lengths of a mechanism skipped once they are predicted to be too slow or too large."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..report import length_label
from .measure import Measurement, Skipped, available_mib, measure
from .settings import Settings

GROWTH = {"linear": 1, "quadratic": 2}  # exponent of the sequence length in a call's time and memory
# What the first call of a series may take: it also compiles (Triton's kernels for the shapes' specialisation,
# cuBLAS's and flash's start-up), which must not skip the series; later calls, and longer lengths, do not.
FIRST_CALL_SECONDS = 120.0


def record(section: str, level: str, mechanism: str, op: str, length: int, settings: Settings, *,
           batch: int | None = None, **extra) -> dict:
    """One JSON record; ``status`` is ``ok``, ``skipped`` or ``failed``, with the reason in ``note``."""
    entry = dict(section=section, level=level, mechanism=mechanism, op=op, length=length,
                 batch=settings.batch if batch is None else batch, dtype=settings.dtype, ms=None, times_ms=None,
                 peak_mib=None, ratio=None, ratio_to=None, status="ok", note="")
    entry.update(extra)
    return entry


def fill(entry: dict, result: Measurement) -> None:
    entry.update(ms=result.ms, times_ms=[round(t, 4) for t in result.times_ms], peak_mib=result.peak_mib)


class Runner:
    """Runs measurements in order, skipping the longer lengths of a mechanism once one failed or once its time
    or memory is predicted (growing as the mechanism's time complexity from the last length measured) to exceed
    the time limit or the memory available. ``on_record(records)`` is called after each record."""

    def __init__(self, settings: Settings, progress, on_record: Callable[[list[dict]], None] | None = None):
        self.settings, self.progress, self.on_record = settings, progress, on_record
        self.device = torch.device(settings.device)
        self.records: list[dict] = []
        self._last: dict[tuple, tuple[int, float | None, float | None]] = {}  # length, ms, peak MiB
        self._first_of_series = True  # whether the measurement running is its series' first

    def autocast(self):
        if self.settings.dtype == "fp32":
            return contextlib.nullcontext()
        # No cast cache: it lives for one context, one call here, and a CUDA graph cannot record with it.
        return torch.autocast(self.device.type, dtype=self.settings.torch_dtype, cache_enabled=False)

    def skip_reason(self, key: tuple, length: int, time_complexity: str) -> str | None:
        if key not in self._last:
            return None
        last_length, last_ms, last_peak = self._last[key]
        if last_ms is None:
            return f"skipped: length {length_label(last_length)} failed or was skipped"
        growth = (length / last_length) ** GROWTH[time_complexity]
        if last_ms / 1e3 * growth > self.settings.time_limit:
            return (f"skipped: predicted {last_ms / 1e3 * growth:.3g} s per call > --time-limit "
                    f"{self.settings.time_limit:g} s")
        available = available_mib(self.device)
        if last_peak is not None and available is not None and last_peak * growth > 0.8 * available:
            return f"skipped: predicted peak {last_peak * growth:.3g} MiB > 80% of the {available:.0f} MiB available"
        return None

    def run(self, entry: dict, key: tuple, time_complexity: str, work: Callable[[dict], None]) -> dict:
        """Fill ``entry`` by ``work(entry)`` (which sets ``ms`` etc.), catching failures and slowness.
        ``key`` names the series whose earlier lengths predict this one."""
        length = entry["length"]
        self._first_of_series = key not in self._last
        reason = self.skip_reason(key, length, time_complexity)
        if reason is not None:
            entry.update(status="skipped", note=reason)
        else:
            try:
                work(entry)
            except Skipped as reason:
                entry.update(status="skipped", note=f"skipped: {reason}", ms=None)
            except Exception as error:  # a benchmark reports failures instead of stopping
                entry.update(status="failed", note=f"failed: {type(error).__name__}: {str(error)[:200]}", ms=None)
            finally:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self._last[key] = (length, entry["ms"], entry["peak_mib"])
        self.records.append(entry)
        if self.on_record is not None:
            self.on_record(self.records)
        if self.progress is not None:
            self.progress.set_postfix_str(f"{entry['mechanism']} {entry['op']} {length}", refresh=False)
            self.progress.update(1)
        return entry

    def measure(self, fn: Callable[[], Any], repeats: int | None = None) -> Measurement:
        s = self.settings
        return measure(fn, self.device, repeats=s.repeats if repeats is None else repeats, warmup=s.warmup,
                       time_limit=s.time_limit, first_call_limit=FIRST_CALL_SECONDS if self._first_of_series else None)


class Ratios:
    """Times relative to a ``reference`` series measured before the others at each point (a length, or a pass
    and a length): ``ratio = ms / the reference's ms``; no ratios when ``reference`` is None."""

    def __init__(self, reference: str | None):
        self.reference, self._ms = reference, {}

    def add(self, entry: dict, point) -> None:
        if entry["ms"] is None:
            return
        if entry["mechanism"] == self.reference:
            self._ms[point] = entry["ms"]
        if point in self._ms:
            entry.update(ratio=entry["ms"] / self._ms[point], ratio_to=self.reference)
