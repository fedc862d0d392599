"""A run directory: a trained model with everything needed to load it, so it can be moved or copied anywhere.

    config.json        the run config (sections data, model, train): the model section resolved to every
                       ModelConfig field (vocab size included), data paths absolute, and no ``train.out_dir``:
                       the run is wherever this directory is
    tokenizer.json     a copy of the tokenizer the run trained with (GPT-2's too)
    model.safetensors  the weights
    state.pt           optimiser, step, sampler and RNG states, to resume; loads with ``weights_only=True``
    metrics.jsonl      one JSON record per logged step, validation, and end of each training call

Every file but the append-only ``metrics.jsonl`` is written atomically (:mod:`lavo.files`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import RunConfig, deep_merge
from .data import BUILTIN_SOURCES, Tokenizer, load_tokenizer_file
from .files import atomic_write, write_json, write_text
from .model import LanguageModel, ModelConfig

CONFIG, TOKENIZER, WEIGHTS, STATE, METRICS = (
    "config.json", "tokenizer.json", "model.safetensors", "state.pt", "metrics.jsonl")
EXPORTED_MODEL_TYPE = "lavo_lm"  # `model_type` in the config.json of a directory written by `lavo export`


def save_run_config(run_dir: str | os.PathLike, config: RunConfig, model_config: ModelConfig,
                    tokenizer: Tokenizer) -> None:
    """``config.json`` and ``tokenizer.json``: what :func:`load_run` needs besides the weights."""
    values = config.to_dict()
    values["model"] = model_config.to_dict()
    del values["train"]["out_dir"]
    data = values["data"]
    # absolute, so that the run finds its data from any working directory (`lavo eval --data-dir` overrides)
    data["data_dir"] = str(Path(data["data_dir"]).resolve())
    if data["source"] not in BUILTIN_SOURCES:
        data["source"] = str(Path(data["source"]).resolve())
    write_json(Path(run_dir) / CONFIG, values)
    tokenizer.save(Path(run_dir) / TOKENIZER)


def run_config_at(values: dict, run_dir: str | os.PathLike) -> RunConfig:
    """The run config ``values`` (as ``config.json`` holds them) with ``train.out_dir`` set to ``run_dir``."""
    return RunConfig.from_dict(deep_merge(values, {"train": {"out_dir": str(run_dir)}}))


def read_run_config(run_dir: str | os.PathLike) -> RunConfig:
    """The run config of a run directory, with ``train.out_dir`` set to where the directory is now."""
    return run_config_at(json.loads((Path(run_dir) / CONFIG).read_text()), run_dir)


def load_run(run_dir: str | os.PathLike, device: str | torch.device = "cpu"
             ) -> tuple[LanguageModel, RunConfig, Tokenizer]:
    """The model (in eval mode, on ``device``), the run config and the tokenizer of a run directory."""
    run_dir = Path(run_dir)
    missing = [name for name in (CONFIG, TOKENIZER, WEIGHTS) if not (run_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir} is not a trained run (it has no {', '.join(missing)}): train one with "
                                f"`lavo train --set train.out_dir={run_dir}`")
    config = read_run_config(run_dir)
    model = LanguageModel(config.model_config())
    model.load_state_dict(load_file(str(run_dir / WEIGHTS)))
    tokenizer = load_tokenizer_file(run_dir / TOKENIZER, config.data.tokenizer)
    return model.to(device).eval(), config, tokenizer


def is_exported(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` was written by ``lavo export`` (a Hugging Face model directory) rather than being a
    run directory: its ``config.json`` names the model type ``lavo_lm``."""
    path = Path(directory) / CONFIG
    return path.is_file() and json.loads(path.read_text()).get("model_type") == EXPORTED_MODEL_TYPE


def load_model_dir(directory: str | os.PathLike, device: str | torch.device = "cpu"
                   ) -> tuple[LanguageModel, RunConfig | None, Tokenizer]:
    """:func:`load_run` for a run directory or one written by ``lavo export`` (which needs the extra ``hf``); the
    run config is None for an exported model that does not record the run it came from."""
    if not is_exported(directory):
        return load_run(directory, device)
    try:
        from .hf import load_exported
    except ImportError as error:
        raise ValueError(f"{directory} is a Hugging Face model directory: reading it needs transformers "
                         "(`pip install 'lavo[hf]'`)") from error
    return load_exported(directory, device)


def save_checkpoint(run_dir: str | os.PathLike, model: LanguageModel, state: dict) -> None:
    """The weights (safetensors) then the training state (torch), each written atomically."""
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    atomic_write(Path(run_dir) / WEIGHTS,
                 lambda tmp: save_file(weights, str(tmp), metadata={"step": str(state["step"])}))
    atomic_write(Path(run_dir) / STATE, lambda tmp: torch.save(state, tmp))


def has_checkpoint(run_dir: str | os.PathLike) -> bool:
    return (Path(run_dir) / STATE).exists()


def load_checkpoint(run_dir: str | os.PathLike, model: LanguageModel) -> dict:
    """Load the checkpoint's weights into ``model``; return the training state saved with them."""
    state = torch.load(Path(run_dir) / STATE, map_location="cpu", weights_only=True)
    model.load_state_dict(load_file(str(Path(run_dir) / WEIGHTS)))
    return state


class MetricsLog:
    """``metrics.jsonl``, appended and flushed one record at a time."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / METRICS
        self.file = None

    def forget_after(self, step: int) -> None:
        """Drop the records of steps after ``step``: a resumed run is about to log them again."""
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= step]
            write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, entry: dict) -> None:
        if self.file is None:
            self.file = open(self.path, "a")
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
