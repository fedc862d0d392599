r"""One forecasting cell (dataset, input length, horizon, method, seed): train with early stopping on the
validation windows, score MSE and MAE on every test window (standardised values), record it.

A *method* is a registered cross attention (:mod:`lavo.registry`) (the transformer of
:mod:`.model`) or a baseline of :data:`BASELINES`. Results go to one JSON file, a cell at a time as each
finishes; cells already in it are skipped, so an interrupted sweep resumes. Sweeps into one file at once (a
dataset each, say) keep each other's cells: each adds its cell to the file as it is then, under a lock.
"""
from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from ..data import DataError
from ..files import locked_folder, make_directory, write_json
from ..layers.base import after_optimizer_step
from ..model import count_parameters
from ..report import counted
from ..registry import available_cross_attentions, check_options
from ..settings import (SEED, SettingsError, above, at_least, between, check_same_settings, check_settings, one_of,
                        read_results, setting)
from .baselines import DLinear, RepeatLast, SeasonalNaive
from .data import TARGET_COLUMN, Series, Standardised, gather_windows, split_bounds, standardise, window_starts
from .model import Forecaster

BASELINES = ("repeat_last", "seasonal_naive", "dlinear")


@dataclass(frozen=True)
class Settings:
    """Model size and training budget, the same for every transformer cell."""

    dim: int = setting(32, at_least(1))
    heads: int = setting(4, at_least(1))
    layers: int = setting(1, at_least(1))
    hidden: int = setting(64, at_least(1))
    label_len: int = setting(48, at_least(1))  # the decoder's observed steps: the Forecaster needs one
    dropout: float = setting(0.05, between(0, 1, high_open=True))
    batch_size: int = setting(16, at_least(1))
    learning_rate: float = setting(1e-3, above(0))
    max_steps: int = setting(80, at_least(1))
    eval_every: int = setting(20, at_least(1))
    patience: int = setting(2, at_least(1))  # evaluations without a better validation loss before training stops
    val_windows: int = setting(128, at_least(1))  # evenly spaced validation windows scored at each evaluation
    eval_batch: int = setting(32, at_least(1))
    cross_options: dict = field(default_factory=lambda: {"abc": {"slots": 8}, "performer": {"features": 32}})

    def __post_init__(self):
        check_settings(self, "forecast")
        check_cross_options(self.cross_options)


def check_cross_options(cross_options: dict) -> None:
    """Each entry a cross attention's name and a table of its options: under a misspelt name the options would
    be ignored, and the cells trained with the defaults."""
    names = available_cross_attentions()
    for name, options in cross_options.items():
        if name not in names:
            raise SettingsError(f"forecast.cross_options names {name!r}, not a cross attention; choose from "
                                f"{', '.join(names)}")
        if not isinstance(options, dict):
            raise SettingsError(f"forecast.cross_options.{name} must be a table of options; got {options!r}")
        check_options(name, options, "cross attention")


@dataclass(frozen=True)
class Grid:
    """The cells of a sweep: every combination of an input length, a horizon, a method and a seed."""

    input: list[int] = setting(allowed=at_least(1))
    horizon: list[int] = setting(allowed=at_least(1))
    method: list[str] = setting(allowed=one_of(available_cross_attentions, *BASELINES))
    seed: list[int] = setting(allowed=SEED)

    def __post_init__(self):
        check_settings(self, "forecast")

    def cells(self) -> list[tuple[int, int, str, int]]:
        return list(itertools.product(self.input, self.horizon, self.method, self.seed))


def cell_key(data: str, input_len: int, horizon: int, method: str, seed: int) -> str:
    return f"{data}|L{input_len}|H{horizon}|{method}|seed{seed}"


def build_method(method: str, channels: int, input_len: int, horizon: int, steps_per_day: int,
                 settings: Settings) -> torch.nn.Module:
    if method == "repeat_last":
        return RepeatLast(horizon)
    if method == "seasonal_naive":
        return SeasonalNaive(horizon, steps_per_day, input_len)
    if method == "dlinear":
        return DLinear(input_len, horizon)
    if method not in available_cross_attentions():
        raise ValueError(f"unknown method {method!r}; cross attentions: {', '.join(available_cross_attentions())}; "
                         f"baselines: {', '.join(BASELINES)}")
    return Forecaster(channels, input_len, min(settings.label_len, input_len), horizon, cross=method,
                      cross_options=settings.cross_options.get(method, {}), dim=settings.dim, heads=settings.heads,
                      layers=settings.layers, hidden=settings.hidden, dropout=settings.dropout)


class Windows:
    """The windows of one split as tensors: ``inputs [N, L, C]``, ``targets [N, H, C]``, ``calendar [N, L+H, 2]``."""

    def __init__(self, data: Standardised, calendar: np.ndarray, split: str, input_len: int, horizon: int,
                 limit: int | None = None):
        starts = window_starts(data.bounds[split], input_len, horizon)
        if limit is not None and len(starts) > limit:
            starts = starts[np.linspace(0, len(starts) - 1, limit).round().astype(int)]
        self.starts = starts
        self.inputs, self.targets, self.calendar = (
            torch.from_numpy(a) for a in gather_windows(data.values, calendar, starts, input_len, horizon))

    def __len__(self) -> int:
        return len(self.starts)


@torch.no_grad()
def predict(model: torch.nn.Module, windows: Windows, batch: int) -> torch.Tensor:
    model.eval()
    return torch.cat([model(windows.inputs[i:i + batch], windows.calendar[i:i + batch])
                      for i in range(0, len(windows), batch)])


def errors(prediction: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    difference = (prediction - targets).double()
    return {"mse": difference.square().mean().item(), "mae": difference.abs().mean().item()}


def fit(model: torch.nn.Module, train: Windows, val: Windows, settings: Settings, seed: int,
        progress: bool) -> dict:
    """Adam on random training windows for at most ``max_steps``, scoring the validation windows every
    ``eval_every`` steps; stops after ``patience`` evaluations without improvement and keeps the best weights."""
    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=settings.learning_rate)
    best, best_state, best_step, waited, step = float("inf"), None, 0, 0, 0
    bar = tqdm(total=settings.max_steps, disable=not progress, leave=False, desc="train")
    while step < settings.max_steps and waited < settings.patience:
        model.train()
        index = torch.randint(len(train), (settings.batch_size,), generator=generator)
        loss = torch.nn.functional.mse_loss(model(train.inputs[index], train.calendar[index]), train.targets[index])
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        after_optimizer_step(model)
        step += 1
        bar.update()
        if step % settings.eval_every == 0 or step == settings.max_steps:
            val_mse = errors(predict(model, val, settings.eval_batch), val.targets)["mse"]
            if not math.isfinite(val_mse):
                bar.close()
                raise ValueError(f"training diverged: the validation MSE is {val_mse} at step {step} (learning rate "
                                 f"{settings.learning_rate:g}); lower it: Settings(learning_rate=...), or "
                                 "`lavo forecast --set learning_rate=...`")
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val_mse:.3f}")
            if val_mse < best:
                best, best_state, best_step, waited = val_mse, copy.deepcopy(model.state_dict()), step, 0
            else:
                waited += 1
    bar.close()
    model.load_state_dict(best_state)
    return {"steps": step, "best_step": best_step, "val_mse": best}


def example_column(series: Series) -> str:
    """The variable a cell's example forecast shows: the dataset's own (:data:`TARGET_COLUMN`), or a series of
    another name's first."""
    column = TARGET_COLUMN.get(series.name)
    return column if column in series.columns else series.columns[0]


def run_cell(series: Series, input_len: int, horizon: int, method: str, seed: int, settings: Settings,
             progress: bool = False) -> dict:
    """Train (when the method has parameters) and score one cell; the result includes the forecast of the
    dataset's example variable on the first test window (the report plots it)."""
    started = time.perf_counter()
    torch.manual_seed(seed)
    data = standardise(series)
    test = Windows(data, series.calendar, "test", input_len, horizon)
    model = build_method(method, len(series.columns), input_len, horizon, series.steps_per_day, settings)
    result = {"parameters": count_parameters(model)}
    if result["parameters"]:
        train = Windows(data, series.calendar, "train", input_len, horizon)
        val = Windows(data, series.calendar, "val", input_len, horizon, limit=settings.val_windows)
        result.update(fit(model, train, val, settings, seed, progress))
    prediction = predict(model, test, settings.eval_batch)
    result.update(errors(prediction, test.targets))
    shown = example_column(series)
    column = series.columns.index(shown)
    example = {"history": test.inputs, "truth": test.targets, "forecast": prediction}
    result["example"] = {"column": shown, "window_start": int(test.starts[0]),
                         **{name: [round(x, 4) for x in t[0, :, column].tolist()]
                            for name, t in example.items()}}
    result.update(test_windows=len(test), wall_s=round(time.perf_counter() - started, 2))
    return result


def load_results(path: Path | None) -> dict:
    """The grid recorded in ``path``; an empty one when there is no file (or no path)."""
    if path is None or not path.is_file():
        return {"settings": None, "cells": {}}
    return read_results(path, ("settings", "cells"), "`lavo forecast`", "name another file")


def check_cells(series: Series, grid: Grid, settings: Settings) -> None:
    """Every cell's windows and model, before the first cell trains: a horizon too long for a split, or an input
    shorter than the seasonal baseline's period, would otherwise end the sweep after the cells before it."""
    bounds = split_bounds(len(series.values)).values()
    for L, H, method in itertools.product(grid.input, grid.horizon, grid.method):
        try:
            for split in bounds:
                window_starts(split, L, H)
            build_method(method, len(series.columns), L, H, series.steps_per_day, settings)
        except (DataError, ValueError) as error:
            raise ValueError(f"{series.name}, input {L}, horizon {H}, {method}: {error}") from error


def iter_cells(series: Series, input_lens: list[int], horizons: list[int], methods: list[str], seeds: list[int],
               settings: Settings, results_path: str | Path | None = None, progress: bool = True,
               log=print) -> Iterator[tuple[str, dict]]:
    """``(key, result)`` of every cell of the grid as it finishes, skipping those already in ``results_path``
    (written after each cell) that were scored on the same data (``data_sha256``: :meth:`Series.sha256`); ``log``
    is told of those trained again. The settings must match the file's. Every cell is checked before the first
    one runs."""
    grid = Grid(input_lens, horizons, methods, seeds)
    check_cells(series, grid, settings)
    results_path = None if results_path is None else Path(results_path)
    if results_path is not None:  # before any cell trains: a folder, or a file under one, cannot take the results
        if results_path.is_dir():
            raise ValueError(f"the results file {results_path} is a folder: name a file in it, e.g. "
                             f"{results_path / 'results.json'}")
        make_directory(results_path.parent, "the results file's folder")
    results = load_results(results_path)
    check_recorded_settings(results_path, results, settings)
    data_sha256 = series.sha256()
    cells = {cell_key(series.name, *cell): cell for cell in grid.cells()}
    stale = [key for key in cells
             if key in results["cells"] and results["cells"][key].get("data_sha256") != data_sha256]
    if stale:
        log(f"note: {counted(len(stale), 'cell')} of {results_path} were scored on other {series.name} data (no "
            f"data_sha256, or another one): trained again")
    for key, (L, H, method, seed) in tqdm(cells.items(), disable=not progress, desc=series.name):
        if results["cells"].get(key, {}).get("data_sha256") != data_sha256:
            cell = run_cell(series, L, H, method, seed, settings, progress=progress) | {"data_sha256": data_sha256}
            if seed != 0:
                del cell["example"]  # one example forecast per method is enough for the plot
            if results_path:
                results = record_cell(results_path, key, cell, settings)
            else:
                results["cells"][key] = cell
        yield key, results["cells"][key]


def check_recorded_settings(path: Path | None, results: dict, settings: Settings) -> None:
    """Refuse ``settings`` unless they are those the results file recorded, if it recorded any."""
    if results["settings"] is not None:
        check_same_settings(path, results["settings"], asdict(settings), "use another file")


def record_cell(path: Path, key: str, cell: dict, settings: Settings) -> dict:
    """The results file with ``cell`` added, read again under a lock: another sweep into the same file meanwhile
    (another dataset's, say) keeps the cells it recorded, and this one skips those of its grid."""
    with locked_folder(path.parent):
        results = load_results(path)
        check_recorded_settings(path, results, settings)
        results["settings"] = asdict(settings)
        results["cells"][key] = cell
        write_json(path, results)
    return results


def run_cells(series: Series, input_lens: list[int], horizons: list[int], methods: list[str], seeds: list[int],
              settings: Settings, results_path: str | Path | None = None, progress: bool = True) -> dict[str, dict]:
    """:func:`iter_cells`' results, ``{key: result}``, once every cell has finished."""
    return dict(iter_cells(series, input_lens, horizons, methods, seeds, settings, results_path, progress))
