"""Run configuration: JSON (or TOML) files in three sections, ``data``, ``model`` and ``train``, plus
``--set section.key=value`` overrides (values are read as JSON, else kept as strings).

``--config`` takes a file path or the name of a config bundled with the package (``lavo/configs/``, e.g.
``lavo-tiny-austen``). Files, overrides and the demo's per-run settings are all combined by :func:`deep_merge`.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .model import ModelConfig, model_config


@dataclass
class DataConfig:
    source: str = "austen"  # "austen" | "shakespeare" | a directory of .txt files
    tokenizer: str = "bpe4096"  # "gpt2" | "bpe<vocab size>"
    data_dir: str = "data"
    holdout: list | None = None  # held-out document names; None: the source's default


@dataclass
class TrainConfig:
    out_dir: str = "runs/lavo"
    train_length: int = 256
    batch_size: int = 16  # windows per process and micro-step
    grad_accum: int = 1
    steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "float32"  # "float32" | "bfloat16" (autocast)
    log_interval: int = 10
    eval_interval: int = 0  # 0: no validation during training
    eval_batches: int = 4
    checkpoint_interval: int = 100
    time_limit: float | None = None  # seconds; stop early (and checkpoint) when reached
    progress: bool = True


SECTIONS = {"data": DataConfig, "train": TrainConfig}


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: dict = field(default_factory=lambda: {"preset": "tiny"})  # preset name + any ModelConfig field
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return {"data": asdict(self.data), "model": copy.deepcopy(self.model), "train": asdict(self.train)}

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        unknown = sorted(set(values) - {"data", "model", "train"})
        if unknown:
            raise ValueError(f"unknown config sections {unknown}; sections: data, model, train")
        sections = {}
        for name, kind in SECTIONS.items():
            given = values.get(name, {})
            known = {f.name for f in fields(kind)}
            bad = sorted(set(given) - known)
            if bad:
                raise ValueError(f"unknown {name} settings {bad}; known: {', '.join(sorted(known))}")
            sections[name] = kind(**given)
        model = copy.deepcopy(values.get("model", {"preset": "tiny"}))
        config = cls(data=sections["data"], model=model, train=sections["train"])
        config.model_config(vocab_size=model.get("vocab_size", 4096))  # validate early
        return config

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        values = dict(self.model)
        preset = values.pop("preset", None)
        if vocab_size is not None:
            values["vocab_size"] = vocab_size
        return model_config(preset, **values)


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def deep_merge(base: dict, update: dict, where: str = "") -> dict:
    """A copy of ``base`` with ``update`` merged in: nested dicts merge key by key, other values replace.

    A dict cannot replace a plain value (``model.attention.window=32`` is a mistake for
    ``model.attention_options.window=32``), so that raises ``ValueError``."""
    merged = copy.deepcopy(base)
    for key, value in update.items():
        path = f"{where}{key}"
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value, f"{path}.")
        elif isinstance(value, dict) and key in merged:
            raise ValueError(f"{path} is a setting ({merged[key]!r}), not a section")
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_overrides(values: dict, overrides: list[str], allow_top_level: bool = False) -> dict:
    """``["train.steps=10", "model.attention_options.window=32"]`` merged into a nested dict (a copy)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 and not allow_top_level:
            raise ValueError(f"--set keys name a section and a setting, e.g. train.steps=100; got {key!r}")
        update = parse_value(text)
        for part in reversed(parts):
            update = {part: update}
        values = deep_merge(values, update)
    return values


BUNDLED = Path(__file__).parent / "configs"


def bundled_configs() -> list[str]:
    """Names of the configs that ship with the package (``lavo/configs/*.json``)."""
    return sorted(path.stem for path in BUNDLED.glob("*.json"))


def find_config(name: str | os.PathLike) -> Path:
    """A config file: ``name`` itself if it is a file, else the bundled config of that name (``.json`` optional)."""
    path = Path(name)
    if path.is_file():
        return path
    if path.parent == Path("."):
        bundled = BUNDLED / (path.name if path.suffix == ".json" else f"{path.name}.json")
        if bundled.is_file():
            return bundled
    raise FileNotFoundError(f"config {str(name)!r} is neither a file nor a bundled config "
                            f"({', '.join(bundled_configs())})")


def read_config_file(name: str | os.PathLike) -> dict:
    path = find_config(name)
    if path.suffix == ".toml":
        import tomllib
        return tomllib.loads(path.read_text())
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


def load_config(name: str | os.PathLike | None = None, overrides: list[str] = ()) -> RunConfig:
    """The run config of a file (path or bundled name; None: every default) with ``--set`` overrides applied."""
    values = read_config_file(name) if name is not None else {}
    return RunConfig.from_dict(apply_overrides(values, list(overrides)))
