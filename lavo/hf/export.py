"""A trained run as a Hugging Face model directory, and back.

``lavo export RUN_DIR OUT_DIR`` writes ``config.json`` (:class:`~lavo.hf.configuration.LavoLMConfig`, with the
run config under ``lavo_run``), ``model.safetensors``, ``generation_config.json``, and the run's tokenizer as a
``PreTrainedTokenizerFast`` (``tokenizer.json``, ``tokenizer_config.json``): what ``AutoModelForCausalLM`` and
``pipeline("text-generation")`` read, offline; and the run's ``documents.json``.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from ..config import RunConfig
from ..data import Tokenizer, load_tokenizer_file
from ..files import give_default_mode, make_directory, write_json
from ..model import LanguageModel
from ..run import (DOCUMENTS, TOKENIZER, RunError, is_exported, load_run, recorded_documents, resized_weight,
                   run_config_at, weight_differences)
from .modeling import LavoLMForCausalLM
from .tokenization import hub_tokenizer


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the trained run ``run_dir`` to ``out_dir`` as a Hugging Face model directory; return ``out_dir``."""
    out = Path(out_dir)
    if is_exported(run_dir):
        raise ValueError(f"{run_dir} is already an exported model directory: copy it, or export the run it "
                         "came from")
    if out.resolve() == Path(run_dir).resolve():
        raise ValueError(f"{out} is the run directory itself: exporting there would replace the run's "
                         "config.json and weights; choose another directory")
    model, config, tokenizer = load_run(run_dir)  # first: a run that cannot be read leaves no folder behind
    if any(make_directory(out, "the export directory").iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty: choose another directory or pass --overwrite")
    for weights in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        weights.unlink()  # an overwritten export's shards and their index would outlive it beside the new file
    run = config.to_dict()
    del run["train"]["out_dir"]
    ids = dict(bos_token_id=tokenizer.eot_id, eos_token_id=tokenizer.eot_id, pad_token_id=tokenizer.eot_id)
    LavoLMForCausalLM.from_native(model, lavo_run=run, **ids).save_pretrained(out)
    for weights in out.glob("*.safetensors"):
        give_default_mode(weights)
    hub_tokenizer(tokenizer).save_pretrained(out)
    documents = recorded_documents(run_dir)
    if documents is not None:  # so that lavo eval checks an export's held-out documents as it checks the run's
        write_json(out / DOCUMENTS, documents)
    else:  # a run from before runs recorded them: not the overwritten export's, which eval would check against
        (out / DOCUMENTS).unlink(missing_ok=True)
    return out


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off inside, as they were after."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_exported(directory: str | os.PathLike, device: str | torch.device = "cpu"
                  ) -> tuple[LanguageModel, RunConfig | None, Tokenizer]:
    """The native model (eval mode, on ``device``, float32 as a run's model is: ``lavo eval --dtype`` and
    autocast choose what it computes in), the recorded run config (or None) and the tokenizer of a directory
    written by :func:`export_run`, or by ``save_pretrained`` in another dtype."""
    directory = Path(directory)
    if not (directory / TOKENIZER).is_file():
        raise FileNotFoundError(f"{directory} has no {TOKENIZER}: export the run again (`lavo export RUN_DIR "
                                f"{directory} --overwrite`) or copy the run's {TOKENIZER} there")
    with no_progress_bars():  # the CLI reports its own progress; a small model loads at once
        # weights of other shapes than config.json's are reported in the loading info, and refused below with the
        # rest, instead of transformers' error that points to a report in its log
        wrapped, loading = LavoLMForCausalLM.from_pretrained(directory, output_loading_info=True,
                                                             ignore_mismatched_sizes=True)
    resized = sorted(resized_weight(*mismatch) for mismatch in loading["mismatched_keys"])  # (name, saved, model)
    problems = weight_differences(sorted(loading["missing_keys"]), sorted(loading["unexpected_keys"]), resized)
    if problems:  # transformers would leave missing weights as they were allocated, uninitialised
        raise RunError(f"{directory} does not hold the weights of the model its config.json describes "
                       f"({wrapped.config.attention}, dim {wrapped.config.dim}, depth {wrapped.config.depth}): "
                       f"{problems}")
    run = wrapped.config.lavo_run
    config = None if run is None else run_config_at(run, directory)
    tokenizer = load_tokenizer_file(directory / TOKENIZER, "exported" if run is None else run["data"]["tokenizer"])
    return wrapped.lavo.to(device=device, dtype=torch.float32).eval(), config, tokenizer
