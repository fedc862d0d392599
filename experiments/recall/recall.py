"""Probe 1: multi-query associative recall (as in the Zoology study), with the gap between pairs and queries set.

A sequence is ``P`` key-value pairs, ``G`` filler tokens, then the ``P`` keys again in a random order, each
followed by its value:

    k1 v1 k2 v2 ... kP vP | f f ... f (G) | k_s1 v_s1 k_s2 v_s2 ...

The model is scored on the value after each queried key (the only targets). A query's distance to its pair is
between ``G + 2`` and ``G + 4P - 2`` tokens. Every model trains on the same stream of sequences, each batch of
one cell (P, G) drawn uniformly, and is scored per cell on the same held-out sequences.

    python experiments/recall/recall.py --config experiments/recall/config.json --out experiments/recall
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lavo.files import write_json
from lavo.model import build_model, count_parameters


@dataclass(frozen=True)
class Vocabulary:
    """Token ids: keys ``[0, keys)``, values after them, then fillers."""

    keys: int
    values: int
    fillers: int

    @property
    def size(self) -> int:
        return self.keys + self.values + self.fillers


def recall_batch(rng: np.random.Generator, vocab: Vocabulary, batch: int, pairs: int, gap: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` sequences of one cell: ids ``[batch, 4 pairs + gap]`` and targets of the same shape, -1 except
    at each queried key, where the target is its value."""
    if pairs > vocab.keys:
        raise ValueError(f"{pairs} pairs need as many distinct keys; the vocabulary has {vocab.keys}")
    keys = np.argsort(rng.random((batch, vocab.keys)), 1)[:, :pairs]  # distinct keys per sequence
    values = vocab.keys + rng.integers(0, vocab.values, (batch, pairs))
    fillers = vocab.keys + vocab.values + rng.integers(0, vocab.fillers, (batch, gap))
    order = np.argsort(rng.random((batch, pairs)), 1)
    rows = np.arange(batch)[:, None]
    context = np.stack([keys, values], 2).reshape(batch, 2 * pairs)
    queries = np.stack([keys[rows, order], values[rows, order]], 2).reshape(batch, 2 * pairs)
    ids = np.concatenate([context, fillers, queries], 1)
    targets = np.full_like(ids, -1)
    start = 2 * pairs + gap
    targets[:, start:start + 2 * pairs:2] = values[rows, order]  # the value follows each queried key
    return ids, targets


def accuracy(model, ids: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of the queried keys after which the model's most likely next token is the key's value."""
    with torch.no_grad():
        logits, _ = model(ids)
    scored = targets >= 0
    return (logits.argmax(-1)[scored] == targets[scored]).float().mean().item()


def probe_model(model_settings: dict, config: dict, vocab: Vocabulary) -> tuple[torch.nn.Module, dict]:
    """The model of ``model_settings`` (seeded) and its training settings: a model's ``"train"`` entry overrides
    the shared ones (e.g. a learning rate it needs)."""
    settings = dict(model_settings)
    train = {**config["train"], **settings.pop("train", {})}
    torch.manual_seed(train["seed"])
    return build_model({"vocab_size": vocab.size, **config["model"], **settings}), train


def train_one(name: str, model_settings: dict, config: dict, vocab: Vocabulary, log=print) -> dict:
    """Train one model on the mixture of cells and score it on every cell; returns its record."""
    model, train = probe_model(model_settings, config, vocab)
    optimizer = torch.optim.AdamW(model.parameter_groups(train["weight_decay"], train["lr"]), lr=train["lr"])
    cells = [(p, g) for p in config["pairs"] for g in config["gaps"]]
    rng = np.random.default_rng(train["seed"])  # the same training stream for every model
    start = time.perf_counter()
    for step in range(train["steps"]):
        warmup = min(1.0, (step + 1) / train["warmup"])
        lr = train["lr"] * warmup * 0.5 * (1 + math.cos(math.pi * step / train["steps"]))
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        pairs, gap = cells[rng.integers(len(cells))]
        ids, targets = (torch.from_numpy(a) for a in recall_batch(rng, vocab, train["batch_size"], pairs, gap))
        logits, _ = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % train["log_interval"] == 0 or step == train["steps"] - 1:
            log(f"{name} step {step} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    train_seconds = time.perf_counter() - start
    model.eval()
    test_rng = np.random.default_rng(train["seed"] + 1)  # the same test sequences for every model
    scores = {}
    for pairs, gap in cells:
        batch = recall_batch(test_rng, vocab, config["test_sequences"], pairs, gap)
        ids, targets = (torch.from_numpy(a) for a in batch)
        scores[f"{pairs},{gap}"] = round(accuracy(model, ids, targets), 4)
    return {"settings": model_settings, "parameters": count_parameters(model),
            "train_seconds": round(train_seconds, 1), "final_loss": round(loss.item(), 4), "accuracy": scores}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, help="folder of results.json (models already in it are skipped)")
    parser.add_argument("--only", nargs="*", help="train only these models")
    parser.add_argument("--log", choices=("print", "quiet"), default="print")
    args = parser.parse_args(argv)
    log = print if args.log == "print" else (lambda message: None)
    config = json.loads(Path(args.config).read_text())
    vocab = Vocabulary(**config["vocabulary"])
    out = Path(args.out)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results.update(config=config, chance=round(1 / vocab.values, 4))
    results.setdefault("models", {})
    for name, settings in config["models"].items():
        if (args.only and name not in args.only) or name in results["models"]:
            continue
        results["models"][name] = train_one(name, settings, config, vocab, log)
        write_json(results_path, results)  # after each model: an interrupted sweep keeps what it finished
    write_json(results_path, results)


if __name__ == "__main__":
    main()
