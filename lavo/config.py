"""Run configuration: JSON (or TOML) files in three sections, ``data``, ``model`` and ``train``, plus
``--set section.key=value`` overrides (values are read as JSON, else kept as strings). An override replaces the
value it names, a whole table included: ``--set model.attention_options={}`` drops the options of the file.

``--config`` takes a file path or the name of a config bundled with the package (``lavo/configs/``, e.g.
``lavo-tiny-austen``). Files and the demo's per-run settings are combined by :func:`deep_merge`.
"""
from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib  # novermin (Python 3.10 takes the fallback below)
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib

from .model import ModelConfig, model_config
from .settings import (SEED, Allowed, SettingsError, above, at_least, between, check_at_most, check_known,
                       check_settings, matches, one_of, setting)


# a tokenizer name: GPT-2's, or a byte-level BPE trained on the data (more than the 256 bytes and <|endoftext|>)
MAX_BPE_VOCAB = 2**20  # far above what a corpus merges into; the BPE trainer allocates for the size asked
TOKENIZERS = Allowed(lambda v: v == "gpt2" or (re.fullmatch(r"bpe\d+", v) is not None
                                               and 257 < int(v[3:]) <= MAX_BPE_VOCAB),
                     f"gpt2 or bpe<vocab size> with vocab size > 257 and at most {MAX_BPE_VOCAB}, e.g. bpe4096")
DEVICES = matches(r"auto|cpu|cuda(:\d+)?", "auto, cpu, cuda or cuda:N")


@dataclass
class DataConfig:
    source: str = "austen"  # "austen" | "shakespeare" | "python" | a mix "austen+python" | a directory of .txt files
    tokenizer: str = setting("bpe4096", TOKENIZERS)
    data_dir: str = "data"
    holdout: list[str] | None = None  # held-out document names; None: the source's default

    def __post_init__(self):
        check_settings(self, "data")


@dataclass
class TrainConfig:
    out_dir: str = setting("runs/lavo", matches(r"\S.*", "a folder path"))
    train_length: int = setting(256, at_least(1))
    batch_size: int = setting(16, at_least(1))  # windows per process and micro-step
    grad_accum: int = setting(1, at_least(1))
    steps: int = setting(1000, at_least(1))
    lr: float = setting(1e-3, above(0))
    min_lr: float = setting(1e-4, at_least(0))  # at most lr
    warmup: int = setting(50, at_least(0))
    weight_decay: float = setting(0.1, at_least(0))
    beta1: float = setting(0.9, between(0, 1, high_open=True))
    beta2: float = setting(0.95, between(0, 1, high_open=True))
    grad_clip: float = setting(1.0, at_least(0))  # 0: no clipping
    seed: int = setting(0, SEED)
    device: str = setting("auto", DEVICES)
    # bfloat16 or float16: autocast; float16 (for GPUs without bfloat16) also scales the loss against underflow
    dtype: str = setting("float32", one_of("float32", "bfloat16", "float16"))
    compile: bool = False  # torch.compile the training step's forward and backward
    # backward recomputes each block's activations instead of keeping them: less memory, one more forward pass
    activation_checkpointing: bool = False
    log_interval: int = setting(10, at_least(1))
    eval_interval: int = setting(0, at_least(0))  # 0: no validation during training
    eval_batches: int = setting(4, at_least(1))
    checkpoint_interval: int = setting(100, at_least(0))  # 0: only at the end (and on interruption)
    # seconds one call may train (each --resume has its own); then it stops after the step and checkpoints
    time_limit: float | None = setting(None, at_least(0))
    progress: bool = True

    def __post_init__(self):
        check_settings(self, "train")
        check_at_most(self, "train", "min_lr", "lr")


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
        not_tables = [name for name in ("data", "model", "train") if not isinstance(values.get(name, {}), dict)]
        if not_tables:
            raise ValueError(f"config sections {not_tables} must be tables of settings, e.g. "
                             '{"train": {"steps": 100}}')
        sections = {}
        for name, kind in SECTIONS.items():
            given = values.get(name, {})
            check_known(kind, given, name)
            sections[name] = kind(**given)
        model = copy.deepcopy(values.get("model", {"preset": "tiny"}))
        config = cls(data=sections["data"], model=model, train=sections["train"])
        check_attention_builds(config.model_config(vocab_size=model.get("vocab_size", 4096)))
        return config

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        values = dict(self.model)
        preset = values.pop("preset", None)
        if vocab_size is not None:
            if values.get("vocab_size", vocab_size) != vocab_size:
                raise SettingsError(f"model.vocab_size is {values['vocab_size']}, but the tokenizer "
                                    f"({self.data.tokenizer}) has {vocab_size} tokens: the tokenizer sets it, so "
                                    "leave model.vocab_size out")
            values["vocab_size"] = vocab_size
        return model_config(preset, **values)


def check_kept_attention_options(file_values: dict, values: dict) -> None:
    """When ``--set model.attention=...`` changed the attention of a config file that gave it options, refuse
    the file's options the new attention does not take, saying how to drop them (``--set
    model.attention=softmax`` over ``lavo-tiny-austen`` keeps its LAVO window)."""
    from .registry import available_attentions, check_options

    file_model, model = file_values.get("model"), values.get("model")
    if not (isinstance(file_model, dict) and isinstance(model, dict) and file_model.get("attention_options")):
        return
    attention = model.get("attention", ModelConfig.attention)
    if (model.get("attention_options") != file_model["attention_options"]
            or attention == file_model.get("attention", ModelConfig.attention)
            or attention not in available_attentions()):
        return  # the options were set here too, or belong to the file's own attention: the usual checks speak
    try:
        check_options(attention, model["attention_options"])
    except ValueError as error:
        raise SettingsError(f"model.attention_options {model['attention_options']} come from the config file, "
                            f"for its attention {file_model.get('attention', ModelConfig.attention)!r}: {error}. "
                            "--set model.attention_options={} drops them") from error


def check_attention_builds(config: ModelConfig) -> None:
    """Build one attention layer of ``config`` (on the CPU, leaving the global RNG alone), so that a bad
    attention option is reported when the config loads rather than after the data is prepared."""
    import torch

    from .model import Block
    try:
        with torch.random.fork_rng(devices=[]):
            Block(config)
    except (TypeError, ValueError) as error:
        raise SettingsError(f"model.attention_options {config.attention_options} do not build a "
                            f"{config.attention!r} layer of dim {config.dim} with {config.heads} heads: {error}"
                            ) from error


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
        values = set_at(values, parts, parse_value(text))
    return values


def set_at(values: dict, path: list[str], value: Any) -> dict:
    """A copy of ``values`` with ``value`` at the key ``path`` names, replacing what was there, a table too
    (``model.attention_options={}`` empties the options a file set), and creating the sections on the way."""
    merged = copy.deepcopy(values)
    section, where = merged, ""
    for part in path[:-1]:
        where += part
        if not isinstance(section.setdefault(part, {}), dict):
            raise ValueError(f"{where} is a setting ({section[part]!r}), not a section")
        section, where = section[part], where + "."
    section[path[-1]] = value
    return merged


BUNDLED = Path(__file__).parent / "configs"


def bundled_configs() -> list[str]:
    """Names of the configs that ship with the package (``lavo/configs/*.json``)."""
    return sorted(path.stem for path in BUNDLED.glob("*.json"))


def bundled_run_configs() -> list[str]:
    """Names of the bundled configs that ``lavo train`` takes: all but the demo's (those with ``runs``)."""
    return [name for name in bundled_configs() if "runs" not in json.loads((BUNDLED / f"{name}.json").read_text())]


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
    kind, parse = ("TOML", tomllib.loads) if path.suffix == ".toml" else ("JSON", json.loads)
    try:
        values = parse(path.read_text())
    except ValueError as error:  # tomllib.TOMLDecodeError is one too
        raise ValueError(f"{path} is not valid {kind}: {error}") from error
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a table of sections (data, model, train), not a {type(values).__name__}")
    return values


def load_config(name: str | os.PathLike | None = None, overrides: list[str] = ()) -> RunConfig:
    """The run config of a file (path or bundled name; None: every default) with ``--set`` overrides applied."""
    values = read_config_file(name) if name is not None else {}
    if "runs" in values:
        raise ValueError(f"{name} is a demo config (one model per entry of its runs section): give it to `lavo demo "
                         f"--config {name}`; lavo train takes a run config ({', '.join(bundled_run_configs())}, or "
                         "a file with the sections data, model, train)")
    merged = apply_overrides(values, list(overrides))
    check_kept_attention_options(values, merged)
    return RunConfig.from_dict(merged)
