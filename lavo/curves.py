"""Training curves: each run's training loss (smoothed) and validation loss from its ``metrics.jsonl``, against
training tokens, steps or elapsed time, as one plot and a table (``lavo curves RUN [RUN ...]``)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .report import number, panel_plot, perplexity, text_table
from .run import METRICS, RunError
from .settings import between, check_settings, setting

X_AXES = {"tokens": "training tokens", "step": "step", "time": "elapsed time (s)"}
X_FIELDS = {"tokens": "tokens", "step": "step", "time": "elapsed"}


@dataclass
class CurveSettings:
    """How the training loss is smoothed (``lavo curves --smooth``): the weight of the past in its exponential
    average, below 1 (at 1 the average would never take in a loss)."""

    smoothing: float = setting(0.9, between(0, 1, high_open=True))

    def __post_init__(self):
        check_settings(self, "curves")


@dataclass
class Curves:
    """One run's record: ``steps`` are its training-step records (step, loss, tokens, elapsed, ...; one each
    ``train.log_interval`` steps, and a call's last step) in order, ``valid`` its validation records (step,
    valid_loss)."""

    name: str
    steps: list[dict]
    valid: list[dict]

    def train_points(self, axis: str, smoothing: float) -> list[tuple[float, float]]:
        """``(x, training loss)``, the loss averaged exponentially over the records before (the weight of the
        past: ``smoothing``), with TensorBoard's correction of the average's start. Non-finite losses (a float16
        step that overflowed) are left out."""
        points, average, count = [], 0.0, 0
        for record in self.steps:
            if not math.isfinite(record["loss"]):
                continue
            count += 1
            average = smoothing * average + (1 - smoothing) * record["loss"]
            points.append((record[X_FIELDS[axis]], average / (1 - smoothing ** count)))
        return points

    def valid_points(self, axis: str) -> list[tuple[float, float]]:
        """``(x, validation loss)``. A validation step need not be a logged one, so its tokens and time are
        interpolated between the logged steps around it (from step 0 at 0 tokens and 0 s)."""
        steps = [0] + [r["step"] for r in self.steps]
        xs = [0] + [r[X_FIELDS[axis]] for r in self.steps]
        return [(float(np.interp(v["step"], steps, xs)), v["valid_loss"]) for v in self.valid
                if v["step"] <= steps[-1]]


def read_curves(run_dir: str | os.PathLike, name: str | None = None) -> Curves:
    """The training and validation records of the run in ``run_dir``."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise RunError(f"{run_dir} has no {METRICS}: give the train.out_dir of a run `lavo train` made (an "
                       "exported model keeps no training record)")
    lines = path.read_text().splitlines()
    records = []
    for line_number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if line_number < len(lines):  # only the last line can be one a killed process left half written
                raise RunError(f"{path}, line {line_number}, is not a JSON record: the file is damaged") from None
    # the logged steps, and a call's last step where its summary (final) goes past them: a call stopped by its time
    # limit or an interruption ends between logged steps
    steps = []
    for record in records:
        if ("lr" in record or record.get("final")) and record["step"] > (steps[-1]["step"] if steps else 0):
            steps.append(record)
    valid = [r for r in records if "valid_loss" in r]
    if not steps:
        raise RunError(f"{path} holds no training step yet")
    return Curves(name or Path(run_dir).name, steps, valid)


def run_names(run_dirs: Sequence[str | os.PathLike]) -> list[str]:
    """Each run's folder name; its path as given where two runs share a folder name, numbered where two are
    given alike."""
    names = [Path(d).resolve().name for d in run_dirs]
    names = [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs)]
    return [name if names.count(name) == 1 else f"{name} #{names[:i].count(name) + 1}"
            for i, name in enumerate(names)]


def curves_table(curves: Sequence[Curves], smoothing: float) -> tuple[list[str], list[list[str]]]:
    """Header and rows: each run's steps, tokens and time, its last smoothed training loss, and its last and
    best validation loss."""
    header = ["run", "steps", "tokens", "time (s)", "smoothed train loss", "valid loss", "valid ppl",
              "best valid (step)"]
    rows = []
    for c in curves:
        last = c.steps[-1]
        trained = c.train_points("step", smoothing)
        valid = c.valid[-1]["valid_loss"] if c.valid else None
        finite = [v for v in c.valid if math.isfinite(v["valid_loss"])]
        best = min(finite, key=lambda v: v["valid_loss"]) if finite else None
        rows.append([c.name, last["step"], f"{last['tokens']:,}", f"{last['elapsed']:.0f}",
                     number(trained[-1][1] if trained else None, 4), number(valid, 4),
                     number(None if valid is None else perplexity(valid), 4),
                     "—" if best is None else f"{number(best['valid_loss'], 4)} ({best['step']})"])
    return header, rows


def plot_curves(curves: Sequence[Curves], path: str | os.PathLike, axis: str = "tokens",
                smoothing: float = 0.9) -> Path | None:
    """Two panels sharing their axes: the smoothed training loss and the validation loss of every run."""
    panels = {f"training loss (smoothed {smoothing:g})": {c.name: c.train_points(axis, smoothing) for c in curves},
              "validation loss": {c.name: c.valid_points(axis) for c in curves}}
    return panel_plot(panels, path, xlabel=X_AXES[axis], ylabel="loss (nats per token)",
                      title="training curves", columns=2, markers=False)


def show_curves(run_dirs: Sequence[str | os.PathLike], *, axis: str = "tokens", smoothing: float = 0.9,
                out_dir: str | os.PathLike | None = None, log=print) -> list[Curves]:
    """Read the runs' records, print the table and, with ``out_dir``, write ``curves.png`` there."""
    if axis not in X_AXES:
        raise ValueError(f"the x axis is one of {', '.join(X_AXES)}; got {axis!r}")
    CurveSettings(smoothing=smoothing)  # a check
    curves = [read_curves(d, name) for d, name in zip(run_dirs, run_names(run_dirs))]
    log(text_table(*curves_table(curves, smoothing)))
    if out_dir is not None:
        path = plot_curves(curves, Path(out_dir) / "curves.png", axis, smoothing)
        log(f"wrote {path}")
    return curves
