"""Several runs of one GPU call trained side by side, each in a process of its own: the workers, the probe that
measures whether more of them finish more work, and the GPU's utilisation while they run.

A `small` model at 16K tokens a step leaves an H200 idle between its kernels (Python and kernel launches take
longer than many of the kernels), so a second process may fill those gaps. The probe measures it instead of
assuming it: 1, 2, ... processes train the next run's model for a few seconds each, and the total tokens per
second decide (:func:`choose_workers`).
"""
from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from lavo.files import write_text

WARMUP_STEPS = 3  # before a probe worker is ready: compilation, autotuning, the allocator's pools
POLL_SECONDS = 0.02


class ProbeFailed(Exception):
    """A probe worker failed or did not answer in time."""


def run_workers(command: list[str], workers: int, results_dir: Path, pack: Callable[[], None]) -> int:
    """Start ``command + ["--worker", "k/n"]`` ``workers`` times at once and wait for them; they share the plan
    through the runs' locks. ``pack()`` is called whenever a results file appears, and at the end. Returns the
    largest exit status."""
    results_dir.mkdir(parents=True, exist_ok=True)
    children = [subprocess.Popen(command + ["--worker", f"{k}/{workers}"]) for k in range(1, workers + 1)]
    packed = None
    try:
        while any(child.poll() is None for child in children):
            time.sleep(1)
            names = sorted(path.name for path in results_dir.glob("*.json"))
            if names != packed:
                pack()
                packed = names
    except BaseException:  # the call ends: the workers had the signal too (their process group), else they get it
        stop_workers(children)
        raise
    finally:
        pack()
    return max(child.returncode for child in children)


def stop_workers(children: list[subprocess.Popen], grace: float = 10.0) -> None:
    """Let the workers write what they were doing and exit; SIGTERM those still running after ``grace``
    seconds, and wait for them."""
    deadline = time.monotonic() + grace
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        child.wait()


def _wait_for(ready: Callable[[], bool], seconds: float, children: list[subprocess.Popen], what: str) -> None:
    """Poll until ``ready()``; :class:`ProbeFailed` once one of ``children`` has failed or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while not ready():
        failed = [child.returncode for child in children if child.poll() not in (None, 0)]
        if failed:
            raise ProbeFailed(f"a probe worker exited with status {failed[0]} while {what}")
        if time.monotonic() > deadline:
            raise ProbeFailed(f"no answer within {seconds:.0f} s while {what}")
        time.sleep(POLL_SECONDS)


def probe_throughput(command: list[str], count: int, seconds: float, tokens_per_step: int, log=print,
                     timeout: float = 300.0) -> dict[int, float]:
    """Tokens per second of all workers together with 1, 2, ..., ``count`` of them training side by side for
    ``seconds`` each; ``command + ["--probe-worker", "k/count", "--probe-dir", DIR]`` starts worker k
    (:func:`probe_worker`). Empty when the probe failed (it says why): ``timeout`` seconds without an answer, or a
    worker that exited with an error; the other workers are then ended at once (they would only wait for phases
    that never come)."""
    with tempfile.TemporaryDirectory(prefix="lavo-probe-") as name:
        folder = Path(name)
        children = [subprocess.Popen(command + ["--probe-worker", f"{k}/{count}", "--probe-dir", name])
                    for k in range(1, count + 1)]
        finished = False
        try:
            _wait_for(lambda: all((folder / f"ready-{k}").exists() for k in range(1, count + 1)), timeout, children,
                      "building and warming up")
            throughput = {}
            for phase in range(1, count + 1):
                start = time.time() + 0.5  # every worker of the phase has seen the file by then
                write_text(folder / f"go-{phase}", f"{start} {start + seconds}")
                done = [folder / f"steps-{phase}-{k}" for k in range(1, phase + 1)]
                _wait_for(lambda: all(path.exists() for path in done), seconds + timeout, children,
                          f"training {phase} at once")
                steps = sum(int(path.read_text()) for path in done)
                throughput[phase] = steps * tokens_per_step / seconds
                log(f"[probe] {phase} at once: {throughput[phase]:,.0f} tokens/s in all")
            finished = True
            return throughput
        except ProbeFailed as error:
            log(f"[probe] {error}")
            return {}
        finally:
            for child in children:
                if finished:  # done with its phases: it exits by itself
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.wait(timeout=30)
                if child.poll() is None:
                    child.kill()
                    child.wait()


def probe_worker(trainer, lr: float, index: int, count: int, folder: Path, timeout: float = 600.0) -> None:
    """Worker ``index`` of :func:`probe_throughput`: warm ``trainer`` up, say so, then in each phase from
    ``index`` to ``count`` train steps from the phase's start while it lasts and write how many."""
    for _ in range(WARMUP_STEPS):
        trainer.train_step(lr)[0].item()
    (folder / f"ready-{index}").touch()
    for phase in range(index, count + 1):
        go = folder / f"go-{phase}"
        _wait_for(go.exists, timeout, [], f"probe worker {index} waited for phase {phase}")
        start, end = map(float, go.read_text().split())
        time.sleep(max(0.0, start - time.time()))
        steps = 0
        while time.time() < end:
            trainer.train_step(lr)[0].item()  # the loss read back each step, as in training
            steps += 1
        write_text(folder / f"steps-{phase}-{index}", str(steps))


def choose_workers(throughput: dict[int, float], run_tokens: int, extra_seconds: float, budget: float,
                   gain: float = 1.1) -> int:
    """How many runs to train at once, from :func:`probe_throughput`'s numbers: each added worker must raise the
    total tokens per second by ``gain``, and one run (``run_tokens`` of training plus ``extra_seconds`` of
    scoring, alone) must still fit in ``budget`` seconds at the share of the GPU it then gets."""
    if 1 not in throughput:
        return 1
    alone = run_tokens / throughput[1] + extra_seconds
    best = 1
    for workers in sorted(n for n in throughput if n > 1):
        slowdown = workers * throughput[1] / throughput[workers]
        if throughput[workers] >= gain * throughput[best] and alone * slowdown <= budget:
            best = workers
    return best


class GpuUtilization:
    """The GPU's mean utilisation in percent (``nvidia-smi``'s: the share of time a kernel was running) while
    the block runs, sampled every ``interval`` seconds; :meth:`mean` is None where nothing could be sampled."""

    COMMAND = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "--id=0"]

    def __init__(self, interval: float = 2.0, command: list[str] | None = None):
        self.interval, self.command, self.samples = interval, command or self.COMMAND, []
        self._stop, self._thread = threading.Event(), None

    def __enter__(self) -> "GpuUtilization":
        if shutil.which(self.command[0]):
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError, IndexError):
                output = subprocess.run(self.command, capture_output=True, text=True, timeout=10).stdout
                self.samples.append(float(output.split()[0]))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mean(self) -> float | None:
        return round(statistics.mean(self.samples), 1) if self.samples else None
