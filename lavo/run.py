"""A run directory: a trained model with everything needed to load it, so it can be moved or copied anywhere.

    config.json        the run config (sections data, model, train): the model section resolved to every
                       ModelConfig field (vocab size included), data paths absolute, and no ``train.out_dir``:
                       the run is wherever this directory is
    tokenizer.json     a copy of the tokenizer the run trained with (GPT-2's too)
    documents.json     the documents of each split, each with a digest of its text: evaluation checks that it
                       scores those (a folder source may change after training)
    model.safetensors  the weights
    state.pt           optimiser, step, sampler and RNG states, to resume; loads with ``weights_only=True``
    metrics.jsonl      one JSON record per logged step, validation, and end of each training call

Every file but the append-only ``metrics.jsonl`` is written atomically (:mod:`lavo.files`). The weights and the
state form one checkpoint: both carry the same checkpoint id, and :func:`save_checkpoint` commits the pair by
replacing ``state.pt`` (see there), so a process killed at any moment leaves the previous checkpoint or the new
one, never a mixture. While a process trains into the directory it holds ``.lock`` (:class:`RunLock`).
"""
from __future__ import annotations

import fcntl
import io
import json
import os
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save as save_weights

from .config import RunConfig, apply_overrides, deep_merge
from .data import Tokenizer, is_builtin, load_tokenizer_file
from .files import atomic_write, fsync_path, read_saved_state, remove_orphans, write_json, write_text
from .model import LanguageModel, ModelConfig
from .registry import UnknownAttention

CONFIG, TOKENIZER, DOCUMENTS, WEIGHTS, STATE, METRICS = (
    "config.json", "tokenizer.json", "documents.json", "model.safetensors", "state.pt", "metrics.jsonl")
PENDING = ".model.safetensors.next"  # the next checkpoint's weights, until its state.pt commits them
LOCK = ".lock"
RUN_FILES = (WEIGHTS, STATE, METRICS)  # what a run directory that has trained holds
EXPORTED_MODEL_TYPE = "lavo_lm"  # `model_type` in the config.json of a directory written by `lavo export`


class RunError(RuntimeError):
    """A run directory that cannot be used as asked; the message names the file and what to do."""


def save_run_config(run_dir: str | os.PathLike, config: RunConfig, model_config: ModelConfig,
                    tokenizer: Tokenizer, digests: dict[str, dict[str, str]]) -> None:
    """``config.json`` and ``tokenizer.json``: what :func:`load_run` needs besides the weights; and
    ``documents.json``: ``digests``, those of the documents of each split (:func:`lavo.data.document_digests`).
    The held-out names are also ``data.holdout``, so that the run's evaluation scores those even after the source
    has changed (a folder's default, its last ~10%, moves when files are added), and refuses them if they were
    edited."""
    values = config.to_dict()
    values["model"] = model_config.to_dict()
    del values["train"]["out_dir"]
    data = values["data"]
    data["holdout"] = list(digests["valid"])
    # absolute, so that the run finds its data from any working directory (`lavo eval --data-dir` overrides)
    data["data_dir"] = str(Path(data["data_dir"]).resolve())
    if not is_builtin(data["source"]):
        data["source"] = str(Path(data["source"]).resolve())
    write_json(Path(run_dir) / CONFIG, values)
    write_json(Path(run_dir) / DOCUMENTS, digests)
    tokenizer.save(Path(run_dir) / TOKENIZER)


def recorded_documents(run_dir: str | os.PathLike) -> dict[str, dict[str, str]] | None:
    """The document digests a run recorded (``documents.json``), or None for a run from before they were."""
    path = Path(run_dir) / DOCUMENTS
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise RunError(f"{path} is not valid JSON ({error}): delete it to score the run's documents as they are "
                       "now, unchecked") from error


def run_config_at(values: dict, run_dir: str | os.PathLike) -> RunConfig:
    """The run config ``values`` (as ``config.json`` holds them) with ``train.out_dir`` set to ``run_dir``."""
    return RunConfig.from_dict(deep_merge(values, {"train": {"out_dir": str(run_dir)}}))


def read_run_config(run_dir: str | os.PathLike, overrides: list[str] = ()) -> RunConfig:
    """The run config of a run directory, with ``train.out_dir`` set to where the directory is now and ``--set``
    ``overrides`` on top (``lavo train --resume RUN_DIR``: how long and how it runs; the trainer refuses other
    changes)."""
    path = Path(run_dir) / CONFIG
    if any(item.split("=", 1)[0].strip() == "train.out_dir" for item in overrides):
        raise ValueError(f"the run resumed is the one in {run_dir}: leave out --set train.out_dir")
    try:
        values = json.loads(path.read_text())
        return run_config_at(apply_overrides(values, list(overrides)), run_dir)
    except UnknownAttention:
        raise  # the config is fine; the package that registers its mechanism is not imported or installed
    except FileNotFoundError as error:
        raise RunError(f"{path} is missing: restore it, or train the run again with --overwrite") from error
    except (ValueError, TypeError, AttributeError) as error:
        raise RunError(f"{path} is not a valid run config ({error}): restore it, or train the run again "
                       "with --overwrite") from error


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises its own error type, or OSError for a truncated file
        raise RunError(f"{path} is not a readable safetensors file ({error}): it is damaged; train the run "
                       "again, or resume it from its checkpoint") from error


def load_weights(model: LanguageModel, path: Path, config_path: Path) -> None:
    """Load ``path`` into ``model``, or say how the file and the model of ``config_path`` differ."""
    weights = read_weights(path)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    resized = sorted(resized_weight(name, weights[name].shape, expected[name].shape)
                     for name in set(weights) & set(expected) if weights[name].shape != expected[name].shape)
    problems = weight_differences(missing, unexpected, resized)
    if problems:
        raise RunError(f"{path} does not hold the weights of the model {config_path} describes "
                       f"({model.config.attention}, dim {model.config.dim}, depth {model.config.depth}): {problems}")
    model.load_state_dict(weights)


def resized_weight(name: str, saved: torch.Size, expected: torch.Size) -> str:
    """``"name (320, 32) (model: (330, 32))"``: a weight saved in another shape than the model's."""
    return f"{name} {tuple(saved)} (model: {tuple(expected)})"


def weight_differences(missing: list[str], unexpected: list[str], resized: list[str]) -> str:
    """``"missing a, b, c ...; unexpected ..."``: the first names of each kind; empty when all lists are."""
    return "; ".join(f"{label} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                     for label, names in (("missing", missing), ("unexpected", unexpected), ("resized", resized))
                     if names)


def load_run(run_dir: str | os.PathLike, device: str | torch.device = "cpu"
             ) -> tuple[LanguageModel, RunConfig, Tokenizer]:
    """The model (in eval mode, on ``device``), the run config and the tokenizer of a run directory."""
    run_dir = Path(run_dir)
    missing = [name for name in (CONFIG, TOKENIZER, WEIGHTS) if not (run_dir / name).is_file()]
    if missing and (trainer := RunLock.holder(run_dir)) is not None:
        raise FileNotFoundError(f"{run_dir} is being trained (pid {trainer}) and has no checkpoint yet: wait for its "
                                "first one (train.checkpoint_interval steps)")
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory: give one that `lavo train` (its train.out_dir) or "
                                "`lavo export` wrote")
    if missing:
        raise FileNotFoundError(f"{run_dir} is not a trained run (it has no {', '.join(missing)}): train one with "
                                f"`lavo train --set train.out_dir={run_dir}`")
    config = read_run_config(run_dir)
    model = LanguageModel(config.model_config())
    load_weights(model, run_dir / WEIGHTS, run_dir / CONFIG)
    tokenizer = load_tokenizer_file(run_dir / TOKENIZER, config.data.tokenizer,
                                    "restore it (the prepared data the run trained on holds a copy, unless the "
                                    "tokenizer is gpt2's), or train the run again")
    if tokenizer.vocab_size != model.config.vocab_size:
        raise RunError(f"{run_dir / TOKENIZER} has {tokenizer.vocab_size} tokens, but the model of "
                       f"{run_dir / CONFIG} has {model.config.vocab_size}: the files come from different runs")
    return model.to(device).eval(), config, tokenizer


def checkpoint_id(path: Path) -> tuple[str | None, str | None]:
    """``(step, checkpoint id)`` recorded in a weights file's metadata."""
    try:
        with safe_open(str(path), "pt") as weights:
            metadata = weights.metadata() or {}
    except Exception as error:
        raise RunError(f"{path} is not a readable safetensors file ({error}): it is damaged; restore it, or "
                       "train the run again with --overwrite") from error
    return metadata.get("step"), metadata.get("checkpoint")


def config_values(directory: str | os.PathLike) -> dict:
    """The ``config.json`` of ``directory`` as read, or ``{}`` when there is none or it is unreadable
    (:func:`read_run_config` says what is wrong with it)."""
    try:
        values = json.loads((Path(directory) / CONFIG).read_text())
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def is_exported(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` was written by ``lavo export`` (a Hugging Face model directory) rather than being a
    run directory: its ``config.json`` names the model type ``lavo_lm``."""
    return config_values(directory).get("model_type") == EXPORTED_MODEL_TYPE


def is_run(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a run directory (trained or not): its ``config.json`` has the sections ``data``,
    ``model`` and ``train``."""
    return {"data", "model", "train"} <= set(config_values(directory))


def load_model_dir(directory: str | os.PathLike, device: str | torch.device = "cpu"
                   ) -> tuple[LanguageModel, RunConfig | None, Tokenizer]:
    """:func:`load_run` for a run directory or one written by ``lavo export`` (which needs the extra ``hf``); the
    run config is None for an exported model that does not record the run it came from."""
    if not is_exported(directory):
        return load_run(directory, device)
    try:
        from .hf import load_exported
    except ImportError as error:
        how = " (`pip install -e '.[hf]'`)" if error.name == "transformers" else f", which failed to import: {error}"
        raise ValueError(f"{directory} is a Hugging Face model directory: reading it needs transformers{how}"
                         ) from error
    return load_exported(directory, device)


def save_checkpoint(run_dir: str | os.PathLike, model: LanguageModel, state: dict) -> None:
    """Write the weights and the training state as one checkpoint.

    The weights go to ``.model.safetensors.next``; then ``state.pt``, carrying the same checkpoint id, replaces
    the previous one: that replacement is the commit. Last, the new weights replace ``model.safetensors``. A
    process killed before the commit leaves the previous checkpoint (and a stale ``.next`` file); killed after
    it, the new state and its weights in ``.next``, which :func:`recover_checkpoint` moves into place.
    On a failed write (a full disk) the previous checkpoint is left as it was and :class:`RunError` says so.
    """
    run_dir = Path(run_dir)
    ident = uuid.uuid4().hex
    # Serialised in memory, then written from Python, so that a full disk raises OSError: safetensors' writer and
    # torch.save's (even into a file object) raise errors of their own there, which name no disk. Both together
    # take about three times the parameters' bytes (the weights, and the state with AdamW's two moments).
    weight_bytes = save_weights({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                                metadata={"step": str(state["step"]), "checkpoint": ident})
    state_bytes = io.BytesIO()
    torch.save({**state, "checkpoint": ident}, state_bytes)
    try:
        atomic_write(run_dir / PENDING, lambda tmp: tmp.write_bytes(weight_bytes))
        atomic_write(run_dir / STATE, lambda tmp: tmp.write_bytes(state_bytes.getbuffer()))
    except OSError as error:
        (run_dir / PENDING).unlink(missing_ok=True)
        raise RunError(f"could not write the checkpoint of step {state['step']} to {run_dir} ({error}); the "
                       "previous checkpoint there is intact: free some space and resume with --resume") from error
    os.replace(run_dir / PENDING, run_dir / WEIGHTS)
    fsync_path(run_dir)


def read_state(run_dir: Path) -> dict:
    return read_saved_state(run_dir / STATE, "a readable training state",
                            "the run cannot be resumed exactly: start it again with --overwrite", RunError)


def recover_checkpoint(run_dir: str | os.PathLike) -> None:
    """Finish or drop a checkpoint write that a killed process left half done (call it holding the lock):
    weights committed by ``state.pt`` but not yet moved into place are moved; uncommitted ones are deleted;
    so are orphaned temporary files."""
    run_dir = Path(run_dir)
    remove_orphans(run_dir)
    pending = run_dir / PENDING
    if not pending.exists():
        return
    committed = (run_dir / STATE).exists() and checkpoint_id(pending)[1] == read_state(run_dir).get("checkpoint")
    if committed:
        os.replace(pending, run_dir / WEIGHTS)
    else:
        pending.unlink()


def load_checkpoint(run_dir: str | os.PathLike, model: LanguageModel) -> dict:
    """Load the checkpoint's weights into ``model``; return the training state saved with them. Refuses weights
    and state that are not from the same checkpoint (run :func:`recover_checkpoint` first)."""
    run_dir = Path(run_dir)
    state = read_state(run_dir)
    if not (run_dir / WEIGHTS).is_file():
        raise RunError(f"{run_dir} has a training state ({STATE}) but no {WEIGHTS}: the run cannot be resumed; "
                       "start it again with --overwrite")
    step, ident = checkpoint_id(run_dir / WEIGHTS)
    if (step, ident) != (str(state["step"]), state.get("checkpoint")):
        raise RunError(f"{run_dir / WEIGHTS} (step {step}) and {run_dir / STATE} (step {state['step']}) are not "
                       "from the same checkpoint, so the run cannot continue exactly: start it again with "
                       "--overwrite")
    load_weights(model, run_dir / WEIGHTS, run_dir / CONFIG)
    return state


def has_checkpoint(run_dir: str | os.PathLike) -> bool:
    return (Path(run_dir) / STATE).exists()


def trained_files(run_dir: str | os.PathLike) -> list[str]:
    """The files of an earlier training in ``run_dir`` (weights, state, metrics)."""
    return [name for name in RUN_FILES if (Path(run_dir) / name).exists()]


def clear_run(run_dir: str | os.PathLike) -> None:
    """Delete an earlier training's weights, state and metrics (``--overwrite``), so that nothing of it mixes
    with the new run even if the new one stops before its first checkpoint."""
    for name in (*RUN_FILES, PENDING):
        (Path(run_dir) / name).unlink(missing_ok=True)


class RunLock:
    """An exclusive lock on a run directory while a process trains into it: ``fcntl.flock`` on ``.lock``,
    released by :meth:`release` or by the operating system when the process ends, however it ends."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK
        self.descriptor: int | None = None

    def acquire(self) -> "RunLock":
        while True:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(descriptor, 32).decode(errors="replace").strip() or "unknown"
                os.close(descriptor)
                raise RunError(f"{self.path.parent} is being trained by another process (pid {holder}, which "
                               f"holds {self.path}): wait for it to end, or choose another train.out_dir") from None
            try:  # the file we locked must still be the one at the path (a releasing process deletes it)
                same = os.stat(self.path).st_ino == os.fstat(descriptor).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(descriptor)
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        self.descriptor = descriptor
        return self

    @staticmethod
    def holder(run_dir: str | os.PathLike) -> int | None:
        """The pid of the process that holds the lock of ``run_dir`` now, or None: a lock that ``/proc/locks``
        lists (Linux; None elsewhere). Read, not probed: a probe holding the lock even briefly could turn a
        starting trainer away, and the pid a killed trainer left in the file may belong to another process now."""
        try:
            status = (Path(run_dir) / LOCK).stat()
            locks = Path("/proc/locks").read_text()
        except OSError:
            return None
        file_id = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
        for line in locks.splitlines():  # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2147215 0 EOF"
            fields = line.split()
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == file_id:
                return int(fields[4])
        return None

    def release(self) -> None:
        if self.descriptor is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.descriptor)  # closing the last descriptor releases the lock
            self.descriptor = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class MetricsLog:
    """``metrics.jsonl``, appended and flushed one record at a time."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / METRICS
        self.file = None

    def forget_after(self, step: int) -> None:
        """Drop the records of steps after ``step``: a resumed run is about to log them again."""
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if self.step_of(line) <= step]
            write_text(self.path, "".join(line + "\n" for line in kept))

    def final_step(self) -> int | None:
        """The step of the last summary record (``"final": true``), None when there is none."""
        if not self.path.exists():
            return None
        finals = [entry["step"] for line in self.path.read_text().splitlines()
                  if (entry := self.parse(line)) and entry.get("final")]
        return finals[-1] if finals else None

    @staticmethod
    def parse(line: str) -> dict | None:
        """A record, or None for a line a killed process left half written."""
        try:
            return json.loads(line)
        except ValueError:
            return None

    @classmethod
    def step_of(cls, line: str) -> float:
        """A record's step; infinite for a line a killed process left half written (so it is dropped)."""
        entry = cls.parse(line)
        return float("inf") if entry is None else entry.get("step", 0)

    def write(self, entry: dict) -> None:
        if self.file is None:
            self.file = open(self.path, "a")
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
