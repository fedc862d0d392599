"""Perplexity at several context lengths on held-out text.

At each length ``L`` the first ``N`` tokens of the split (``N`` a multiple of the longest length) are cut into
``N / L`` non-overlapping segments, each scored from an empty context (as ``fairseq-eval-lm --context-window 0``),
so every length scores exactly the same ``N`` target tokens and the numbers compare. A long segment is fed
through the model's cache in chunks, so LAVO's memory stays constant and softmax never builds a full
``L x L`` score matrix.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .data import DataError, Document, is_builtin, read_documents, read_split, read_text, text_digest, tokenize
from .data.sources import check_parts
from .devices import autocast_for, resolve_device
from .files import write_json
from .layers.base import position_bound
from .report import counted, line_plot, perplexity, text_table
from .run import RunError, WEIGHTS, checkpoint_id, is_exported, load_model_dir, recorded_documents
from .settings import above, at_least, check_settings, one_of, setting


DEFAULT_MULTIPLES = [1, 2, 4, 8]
SCORED = {"valid": "held-out tokens", "train": "training tokens"}  # what the table says each split scored


@dataclass
class EvalSettings:
    """The lengths and batching of an evaluation (``lavo eval`` flags, the demo's ``eval`` section)."""

    multiples: list[float] | None = setting(factory=DEFAULT_MULTIPLES.copy, allowed=above(0))
    lengths: list[int] | None = setting(None, at_least(1))  # given: used instead of multiples
    max_tokens: int | None = setting(None, at_least(1))
    batch_size: int = setting(8, at_least(1))
    chunk_size: int | None = setting(512, at_least(0))  # 0 or None: each segment in one forward pass
    dtype: str = setting("float32", one_of("float32", "bfloat16", "float16"))  # autocast to it, unless float32

    def __post_init__(self):
        check_settings(self, "eval")

    def lengths_for(self, train_length: int) -> list[int]:
        """The evaluation lengths: ``lengths``, else ``multiples`` of ``train_length``."""
        if self.lengths is not None:
            return self.lengths
        lengths = [int(round(m * train_length)) for m in self.multiples or DEFAULT_MULTIPLES]
        if min(lengths) < 1:
            raise ValueError(f"eval.multiples {self.multiples} of the training length {train_length} give a "
                             f"length below 1 ({lengths}): use larger multiples")
        return lengths


def shared_length(num_tokens: int, lengths: list[int], max_tokens: int | None = None) -> int:
    """``N``: the number of target tokens scored at every length, a multiple of every length."""
    longest = math.lcm(*lengths)  # every length must divide N (e.g. 384 and 4096), or some targets go unscored
    available = num_tokens - 1  # the last token is only ever a target
    if max_tokens is not None:
        available = min(available, max_tokens)
    n = available // longest * longest
    if n == 0:
        # --max-tokens is to blame only where the text alone would have held the lengths
        limit = (f"--max-tokens {max_tokens} allows fewer" if max_tokens is not None and num_tokens - 1 >= longest
                 else f"the evaluation text has {counted(num_tokens, 'token')}")
        fix = ("use lengths that divide one another (e.g. powers of two)" if longest > max(lengths) else
               "use shorter lengths" + (" or a larger --max-tokens" if limit.startswith("--max-tokens") else ""))
        raise ValueError(f"lengths {lengths} score the same targets at every length, a multiple of their least "
                         f"common multiple {longest}, so at least {longest + 1} tokens; {limit}: {fix}")
    return n


@torch.no_grad()
def segment_nll(model, segments: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Summed negative log-likelihood of ``segments [B, L + 1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``),
    each from an empty context; chunks of ``chunk_size`` positions go through the model's cache."""
    inputs, targets = segments[:, :-1], segments[:, 1:]
    length = inputs.shape[1]
    if chunk_size is None or length <= chunk_size or not getattr(model, "supports_decoding", False):
        chunk_size = length
    total = torch.zeros(segments.shape[0], dtype=torch.float64, device=segments.device)
    cache = None
    for start in range(0, length, chunk_size):
        logits, cache = model(inputs[:, start:start + chunk_size], cache=cache)
        nll = F.cross_entropy(logits.float().transpose(1, 2), targets[:, start:start + chunk_size], reduction="none")
        total += nll.sum(1).double()
    return total


def segment_starts(num_tokens: int, n: int, lengths: list[int], length: int, spread: bool) -> list[int]:
    """Where the segments of ``length`` start: ``N = n`` targets scored at every length, in windows of
    ``lcm(lengths)`` targets that each length splits alike; the windows follow each other from the start of the
    text, or (``spread``) are spaced evenly over all ``num_tokens`` of it, so that a text of several documents
    is sampled throughout rather than by its first ones."""
    window = math.lcm(*lengths)
    count = n // window
    if spread and count > 1:
        firsts = np.linspace(0, num_tokens - window - 1, count).astype(np.int64).tolist()
    else:
        firsts = [k * window for k in range(count)]
    return [first + i * length for first in firsts for i in range(window // length)]


@torch.no_grad()
def perplexity_by_length(model, tokens: np.ndarray, lengths: list[int], *, batch_size: int = 8,
                         chunk_size: int | None = 512, max_tokens: int | None = None, device="cpu",
                         progress: bool = False, spread: bool = False,
                         into: dict[int, dict] | None = None) -> dict[int, dict]:
    """``{L: {"loss", "ppl", "tokens", "segments"}}`` over the same ``N`` targets for every ``L``: the first ones,
    or windows of them spread over the whole text (:func:`segment_starts`). ``into``: the dict to fill and
    return, each length added as soon as it is scored, so that a caller stopped midway (Ctrl-C) keeps those."""
    EvalSettings(lengths=list(lengths), batch_size=batch_size, chunk_size=chunk_size, max_tokens=max_tokens)  # a check
    lengths = sorted(set(int(length) for length in lengths))
    chunk_size = chunk_size or None
    n = shared_length(len(tokens), lengths, max_tokens)
    if spread and n == math.lcm(*lengths):
        # a larger --max-tokens helps only where it was given and the text holds more than one window
        more = "a larger --max-tokens or " if max_tokens is not None and (len(tokens) - 1) // n > 1 else ""
        warnings.warn(f"spread: only one window of {n} targets (the lengths' least common multiple) is scored, so "
                      f"it is the text's first: use {more}shorter lengths to spread them",
                      stacklevel=3)  # the caller's line: torch.no_grad's wrapper stands between
    stream = torch.from_numpy(np.asarray(tokens if spread else tokens[:n + 1], dtype=np.int64))
    was_training = model.training
    model.eval()
    results = {} if into is None else into
    try:
        for length in lengths:
            offsets = segment_starts(len(tokens), n, lengths, length, spread)
            count = len(offsets)
            nll = 0.0
            starts = list(range(0, count, batch_size))
            iterator = starts
            if progress:
                from tqdm import tqdm
                iterator = tqdm(starts, desc=f"length {length}", leave=False, dynamic_ncols=True)
            for first in iterator:
                rows = offsets[first:first + batch_size]
                segments = torch.stack([stream[j:j + length + 1] for j in rows]).to(device)
                nll += segment_nll(model, segments, chunk_size).sum().item()
            loss = nll / n
            results[length] = {"loss": loss, "ppl": perplexity(loss), "tokens": n, "segments": count}
    finally:
        model.train(was_training)
    return results


def scored_tokens(split: str, text: str | None) -> str:
    """Which tokens an evaluation scored, as the table and the plot say it."""
    return f"tokens of {text}" if text else SCORED[split]


def format_table(results: dict[str, dict[int, dict]], scored: str = SCORED["valid"],
                 same_text: bool = True) -> str:
    """Perplexity table: one row per model, one column per length; ``scored`` says which tokens, and
    ``same_text`` whether every run scored the same ones."""
    lengths = sorted({length for per_model in results.values() for length in per_model})
    rows = [[name] + [f"{per_model[length]['ppl']:.2f}" if length in per_model else "-" for length in lengths]
            for name, per_model in results.items()]
    tokens = ", ".join(map(str, sorted({p["tokens"] for per_model in results.values() for p in per_model.values()})))
    where = (f"the same {tokens} {scored} at every length" if same_text else
             f"{tokens} {scored}, not the same ones for every run (other documents or tokenizers), but for each run "
             "the same at every length")
    return (text_table(["model"] + [f"L={length}" for length in lengths], rows) +
            f"\n(perplexity on {where}; segments scored from an empty context)")


def save_plot(results: dict[str, dict[int, dict]], path: str | os.PathLike,
              train_length: int | None = None, scored: str = SCORED["valid"]) -> Path | None:
    """Perplexity against evaluation length, one line per model (log-2 length axis); ``scored`` says which
    tokens."""
    series = {name: [(length, r["ppl"]) for length, r in per_model.items()] for name, per_model in results.items()}
    return line_plot(series, path, xlabel="evaluation length (tokens)", ylabel="perplexity",
                     title=f"perplexity vs length ({scored})",
                     vline=(train_length, "training length") if train_length else None)


def text_documents(path: str | os.PathLike, log=None) -> list[Document]:
    """A plain-text file, or every ``.txt`` file of a folder (sorted by name), as documents; ``log`` is told of
    the files a folder leaves out (in subfolders, or named ``.TXT``), as for a folder source."""
    path = Path(path)
    if path.is_dir():
        return read_documents(path, log, fix="give --text a .txt file, or a folder of them")
    if path.is_file():
        text = read_text(path)
        if not text.strip():  # as a folder leaves out such a file: it holds no text to score
            raise DataError(f"--text {path} is empty or holds only whitespace: nothing to score")
        return [Document(path.stem, text)]
    raise DataError(f"--text {path}: no such file or folder")


def check_text_alone(text: str | None, split: str, parts: list[str] | None) -> None:
    """Refuse ``text`` with a ``split`` or ``parts`` other than the defaults: those choose among a run's own
    documents, which a given text replaces, so they would be ignored."""
    chosen = ([f"--split {split}"] if split != "valid" else []) + ([f"--parts {','.join(parts)}"] if parts else [])
    if text is not None and chosen:
        raise ValueError(f"--text {text} scores that text in place of a run's documents, so {' and '.join(chosen)} "
                         "would be ignored: leave out one or the other")


def run_documents(config, split: str, data_dir: str | None, parts: list[str] | None = None,
                  recorded: dict[str, dict[str, str]] | None = None) -> list[Document]:
    """The split ``split`` of a run's data (from ``data_dir``, default the run's own); ``parts``: only the
    documents of those parts of a mixed source. ``recorded``: the run's document digests
    (:func:`~lavo.run.recorded_documents`), against which the documents read now are checked."""
    data = config.data
    if parts is not None:  # before reading, so that its error has none of the reading's advice
        check_parts(data.source, parts)
    try:
        return read_split(data.source, data_dir or data.data_dir, data.holdout, split, parts,
                          None if recorded is None else recorded[split])
    except DataError as error:
        where = ("if the run's data is elsewhere: `lavo eval --data-dir FOLDER`" if is_builtin(data.source) else
                 "the run read its texts from that folder: put them back as they were, or score a file or folder "
                 "with --text, which scores all of it, not only the held-out documents")
        raise DataError(f"{error} ({where})") from error


class LoadedModel(NamedTuple):
    """A model to score, as :func:`~lavo.run.load_model_dir` loads it, under the name its table row shows."""

    name: str
    path: str
    model: Any
    config: Any  # the run config; None for an exported model that does not record it
    tokenizer: Any
    step: int | None  # the training step of the checkpoint scored; None for an exported model


def checkpoint_step(directory: str) -> int | None:
    """The step a run directory's weights were saved at; None for an exported model (it records none)."""
    if is_exported(directory):
        return None
    step = checkpoint_id(Path(directory) / WEIGHTS)[0]
    return None if step is None else int(step)


def load_scored(name: str, directory: str, device) -> LoadedModel:
    """The model of ``directory`` with the step of its checkpoint, read on both sides of the load so that a
    training run checkpointing meanwhile cannot put another step's number on the weights."""
    step = checkpoint_step(directory) if Path(directory, WEIGHTS).is_file() else None
    loaded = LoadedModel(name, directory, *load_model_dir(directory, device), step)
    if checkpoint_step(directory) != step:
        raise RunError(f"{directory} saved a new checkpoint while it was being loaded: evaluate it again")
    return loaded


def load_models(run_dirs: list[str], device) -> list[LoadedModel]:
    """Each directory's model, named by its folder, or by its path when two folders share a name; a directory
    given twice (its rows would be one) is refused."""
    seen = set()
    for run in run_dirs:
        resolved = Path(run).resolve()
        if resolved in seen:
            raise ValueError(f"{run} is given twice: give each run once")
        seen.add(resolved)
    names = [Path(run).name for run in run_dirs]
    if len(set(names)) < len(names):
        names = [str(run) for run in run_dirs]
    return [load_scored(name, run, device) for name, run in zip(names, run_dirs)]


def tokens_per_run(loaded: list[LoadedModel], text: str | None, split: str, data_dir: str | None,
                   parts: list[str] | None, log=print) -> dict[str, np.ndarray]:
    """What each run scores: the file or folder ``text``, else the split ``split`` of its own data (checked against
    the documents it recorded), tokenised with its tokenizer (once for runs that share both)."""
    given = text_documents(text, log) if text else None
    cache: dict[tuple, np.ndarray] = {}
    tokens = {}
    for run in loaded:
        documents = given or run_documents(run.config, split, data_dir, parts, recorded_documents(run.path))
        key = (run.tokenizer.sha256, tuple((doc.name, text_digest(doc.text)) for doc in documents))
        if key not in cache:
            cache[key] = tokenize(documents, run.tokenizer)
        tokens[run.name] = cache[key]
    return tokens


def check_position_bounds(loaded: list[LoadedModel], longest: int) -> None:
    """Refuse, before anything is scored, a length some run's layers cannot read (cosFormer's ``max_length``)."""
    for run in loaded:
        bound = position_bound(run.model)
        if bound is not None and longest > bound.limit:
            raise ValueError(f"{run.name} reads at most {bound.limit} positions (its {bound.layer}), fewer than the "
                             f"length {longest}: evaluate it at lengths up to {bound.limit}, or train it with a "
                             "larger model.attention_options.max_length")


def write_results(out_dir: str, loaded: list[LoadedModel], results: dict[str, dict[int, dict]], *, split: str,
                  parts: list[str] | None, text: str | None, spread: bool, dtype: str,
                  train_length: int | None, log=print) -> None:
    """``results.json`` (what was scored, how, and the results) and ``perplexity.png`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"split": split if text is None else None, "parts": parts if text is None else None, "text": text,
               "spread": spread, "dtype": dtype,
               "runs": {run.name: str(run.path) for run in loaded},
               "steps": {run.name: run.step for run in loaded},
               "results": {name: {str(k): v for k, v in r.items()} for name, r in results.items()}}
    write_json(out / "results.json", payload)
    plot = save_plot(results, out / "perplexity.png", train_length=train_length, scored=scored_tokens(split, text))
    log(f"wrote {out / 'results.json'} and {plot}")


def report_interrupted(results: dict[str, dict[int, dict]], per_run: int, scored: str, same_text: bool,
                       out_dir: str | None, log=print) -> None:
    """After Ctrl-C: the table of the lengths scored so far, and (on stderr) how many of all, ``per_run`` lengths
    for each run; nothing is written to ``out_dir``, so that a partial evaluation is never taken for a whole one."""
    finished = {name: per_model for name, per_model in results.items() if per_model}
    if finished:
        log(format_table(finished, scored, same_text=same_text))
    done = sum(map(len, results.values()))
    each = f" ({per_run} for each of {len(results)} runs)" if len(results) > 1 else ""
    kept = f"; {out_dir} is left as it was" if out_dir is not None else ""
    print(f"interrupted: the table holds the {done} of {counted(per_run * len(results), 'length')}{each} scored "
          f"before it{kept}", file=sys.stderr)


def check_out_dir(out_dir: str) -> None:
    """Refuse, before anything is scored, an ``out_dir`` that cannot be a folder: it, or the nearest of its
    parents that exists, is a file."""
    path = Path(out_dir)
    nearest = next(p for p in (path, *path.parents) if p.exists())
    if not nearest.is_dir():
        problem = " is a file" if nearest == path else f": {nearest} is a file, so the folder cannot be made there"
        raise ValueError(f"--out {out_dir}{problem}: give a folder for results.json and perplexity.png")


def evaluate_runs(run_dirs: list[str], *, lengths: list[int] | None = None, multiples: list[float] | None = None,
                  split: str = "valid", parts: list[str] | None = None, text: str | None = None,
                  batch_size: int = 8, chunk_size: int | None = 512,
                  max_tokens: int | None = None, spread: bool = False, data_dir: str | None = None,
                  device: str = "auto", dtype: str = "float32", out_dir: str | None = None, progress: bool = True,
                  log=print) -> dict[str, dict[int, dict]]:
    """Score trained runs (run directories or directories written by ``lavo export``) on the split ``split`` of
    each run's data (read from ``data_dir``, default the run's own; ``parts``: only the documents of those parts
    of a mixed source), or on the plain text ``text`` (a file or a
    folder of ``.txt`` files), tokenised with each run's tokenizer; print the table, write ``results.json`` and
    ``perplexity.png``. ``spread``: the scored targets are windows spread over the whole text rather than its
    first ``max_tokens`` (:func:`segment_starts`). ``dtype``: ``"bfloat16"`` or ``"float16"`` scores under
    autocast (the losses are still summed in float64)."""

    settings = EvalSettings(multiples=multiples, lengths=lengths, max_tokens=max_tokens, batch_size=batch_size,
                            chunk_size=chunk_size, dtype=dtype)
    device = resolve_device(device)
    autocast = autocast_for(dtype, device, "--dtype")
    check_text_alone(text, split, parts)
    if out_dir is not None:
        check_out_dir(out_dir)
    loaded = load_models(run_dirs, device)
    missing_config = [run.path for run in loaded if run.config is None]
    if missing_config and text is None:
        raise DataError(f"{', '.join(map(str, missing_config))} do not record the data they trained on: score a "
                        "text with --text FILE")
    tokens = tokens_per_run(loaded, text, split, data_dir, parts, log)
    same_text = len({hashlib.sha256(t.tobytes()).digest() for t in tokens.values()}) == 1
    if not same_text:
        log("warning: the runs score different texts (other data, held-out documents or tokenizers): "
            "perplexities do not compare")
    train_length = next((run.config.train.train_length for run in loaded if run.config is not None), None)
    if settings.lengths is None and train_length is None:
        raise ValueError("the models do not record their training length: give --lengths")
    lengths = settings.lengths_for(train_length)
    check_position_bounds(loaded, max(lengths))
    results = {run.name: {} for run in loaded}
    try:
        for run in loaded:
            if progress:
                at_step = "" if run.step is None else f" (checkpoint of step {run.step})"
                log(f"scoring {run.name}{at_step} at lengths {', '.join(map(str, lengths))}")
            with autocast():
                perplexity_by_length(run.model, tokens[run.name], lengths, batch_size=batch_size,
                                     chunk_size=chunk_size, max_tokens=max_tokens, device=device, progress=progress,
                                     spread=spread, into=results[run.name])
    except KeyboardInterrupt:
        report_interrupted(results, len(set(lengths)), scored_tokens(split, text), same_text, out_dir, log)
        raise
    log(format_table(results, scored_tokens(split, text), same_text=same_text))
    if out_dir is not None:
        write_results(out_dir, loaded, results, split=split, parts=parts, text=text, spread=spread, dtype=dtype,
                      train_length=train_length, log=log)
    return results
