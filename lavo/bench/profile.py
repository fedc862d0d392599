"""The ``profile`` section (asked for by name, not in a default run): where the time of a call goes, by kernel on
CUDA (torch's profiler through CUPTI: Triton's kernels under their own names) and by PyTorch operator on the CPU.
It profiles the raw ops of ``--ops`` and the layers of ``--attentions`` at ``--lengths`` in ``--passes``, and the
training step of the models of ``--model-attentions`` at ``--model-lengths``: what to look at when a time in the
other sections is off its target."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from . import attention, model
from .measure import sync, timed_within
from .runner import Runner, record

TOP = 12  # rows kept per profile; the rest are summed into one


def planned(settings) -> int:
    return len(attention.plan(settings)) + len(model.plan(settings))


def kernel_table(events, on_device: bool, repeats: int) -> tuple[list[dict], float]:
    """Rows ``{name, calls, ms, share}`` per step, longest first (the first :data:`TOP`, then one row for the
    rest), and the total ms per step. On CUDA the rows are the device's kernels and copies only: the operators
    that launched them would count the same time again."""
    if on_device:
        rows = [(e.key, e.count, e.self_device_time_total) for e in events if e.device_type != DeviceType.CPU]
    else:
        rows = [(e.key, e.count, e.self_cpu_time_total) for e in events]
    rows = sorted((row for row in rows if row[2] > 0), key=lambda row: -row[2])
    total = sum(row[2] for row in rows)
    kept = rows[:TOP]
    if len(rows) > TOP:
        rest = rows[TOP:]
        kept.append((f"({len(rest)} others)", sum(row[1] for row in rest), sum(row[2] for row in rest)))
    table = [dict(name=name, calls=count / repeats, ms=us / 1e3 / repeats, share=us / total if total else None)
             for name, count, us in kept]
    return table, total / 1e3 / repeats


def profiled(fn: Callable[[], Any], runner: Runner) -> dict:
    """Profile ``--repeats`` calls of ``fn`` after ``--warmup`` (at least one: compilation, autotuning):
    the kernel table, the wall ms per call under the profiler and the share of it the table's time covers."""
    s, device = runner.settings, runner.device
    for _ in range(max(1, s.warmup)):
        timed_within(fn, device, s.time_limit)
    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_device
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(s.repeats):
            fn()
        sync(device)
        wall_ms = (time.perf_counter() - start) * 1e3 / s.repeats
    kernels, busy_ms = kernel_table(prof.key_averages(), on_device, s.repeats)
    return dict(kernels=kernels, ms=wall_ms, busy_ms=busy_ms, busy=busy_ms / wall_ms)


def run(runner: Runner) -> None:
    s = runner.settings
    # (level, label, pass, length, time complexity, a function building the call)
    targets = [("op" if name in attention.BY_LABEL else "layer", name, which, length, attention.time_complexity(name),
                lambda name=name, which=which, length=length: attention.attention_call(name, s, length, which,
                                                                                     runner))
               for name, which, length in attention.plan(s)]
    targets += [("model", model.label(name, checkpointed), "train_step", length, attention.time_complexity(name),
                 lambda name=name, length=length, checkpointed=checkpointed:
                 model.train_step(name, length, runner, checkpointed)[0])
                for name, checkpointed, length in model.plan(s)]
    for level, label, which, length, complexity, build in targets:
        entry = record("profile", level, label, which, length, s, batch=s.model_batch if level == "model" else None,
                       kind="kernel" if runner.device.type == "cuda" else "operator", kernels=None, busy_ms=None,
                       busy=None)

        def work(entry, build=build):
            entry.update(profiled(build(), runner))

        runner.run(entry, ("profile", level, label, which), complexity, work)
