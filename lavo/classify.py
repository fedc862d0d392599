"""Sequence classification with a non-causal encoder over any mechanism, and its training on ListOps.

token embedding (+ positions) -> depth x Block(causal=False) -> LayerNorm -> mean over the real (non-pad)
tokens -> linear head. The blocks, initialisation, optimizer groups and learning-rate schedule are the language
model's (:mod:`lavo.model`, :func:`lavo.train.learning_rate`); only the causal flag and the head differ.

:func:`train_listops` trains one model on a seeded ListOps task, validates every ``eval_interval`` steps, scores
the test split at the end and writes ``results.json`` (a finished ``results.json`` makes a rerun of the same
settings skip). Until then ``checkpoint.pt`` holds its state, saved at every validation point and on Ctrl-C, and
a rerun resumes from it.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .files import atomic_write, make_directory, read_saved_state, write_json
from .layers.base import after_optimizer_step
from .listops import CLASSES, VOCAB, ListOpsSpec, Split, make_splits
from .model import (Block, ModelConfig, add_positions, count_parameters, initialise, parameter_groups,
                    set_learning_rate)
from .settings import (SEED, SettingsError, above, at_least, check_at_most, check_known, check_same_settings,
                       check_settings, read_results, setting)
from .train import Stopped, StopRequests, learning_rate


class SequenceClassifier(nn.Module):
    """``forward(ids [B, T], padding_mask [B, T] | None) -> logits [B, classes]`` (True in the mask = token)."""

    def __init__(self, config: ModelConfig, classes: int):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, causal=False) for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, classes)
        initialise(self, self.blocks, config)

    def forward(self, ids: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        if ids.dim() != 2:
            raise ValueError(f"ids must have shape [B, T], got {tuple(ids.shape)}")
        x = self.dropout(add_positions(self.embed(ids), self.config))
        for block in self.blocks:
            x, _ = block(x, padding_mask=padding_mask)
        x = self.norm(x)
        if padding_mask is None:
            return self.head(x.mean(1))
        weights = padding_mask.to(x.dtype)[..., None]
        return self.head((x * weights).sum(1) / weights.sum(1).clamp_min(1))


@dataclass
class ListOpsRun:
    """Everything one ListOps run depends on (written to results.json with the results)."""

    attention: str = "lavo"
    attention_options: dict = field(default_factory=dict)
    # every mechanism gets absolute positions, as in LRA: without them a non-causal softmax, Performer or ABC
    # layer sees a bag of tokens, and LAVO stayed at the majority class (docs/DESIGN.md, decision 11)
    position: str = "sinusoidal"
    dim: int = setting(64, at_least(1))
    depth: int = setting(2, at_least(1))
    heads: int = setting(4, at_least(1))
    mlp_ratio: int = setting(4, at_least(1))
    spec: ListOpsSpec = ListOpsSpec()
    train_size: int = setting(20000, at_least(1))
    valid_size: int = setting(1000, at_least(1))
    test_size: int = setting(1000, at_least(1))
    steps: int = setting(1000, at_least(1))
    batch_size: int = setting(32, at_least(1))
    lr: float = setting(1e-3, above(0))
    min_lr: float = setting(1e-4, at_least(0))  # at most lr
    warmup: int = setting(100, at_least(0))
    weight_decay: float = setting(0.01, at_least(0))
    clip: float = setting(1.0, above(0))  # the largest gradient norm
    eval_interval: int = setting(100, at_least(1))
    seed: int = setting(0, SEED)

    def __post_init__(self):
        check_settings(self, "listops")
        check_at_most(self, "listops", "min_lr", "lr")
        if self.dim % self.heads:  # named as these settings, before the model's check names its own
            raise SettingsError(f"listops.dim ({self.dim}) must be divisible by listops.heads ({self.heads})")

    @classmethod
    def from_dict(cls, values: dict) -> "ListOpsRun":
        check_known(cls, values, "listops")
        values = dict(values)
        if "spec" in values:
            if not isinstance(values["spec"], dict):
                raise SettingsError(f"listops.spec must be a table; got {values['spec']!r}")
            check_known(ListOpsSpec, values["spec"], "listops.spec")
            values["spec"] = ListOpsSpec(**values["spec"])
        return cls(**values)

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=len(VOCAB), dim=self.dim, depth=self.depth, heads=self.heads,
                           attention=self.attention, attention_options=dict(self.attention_options),
                           position=self.position, mlp_ratio=self.mlp_ratio)

    def build_model(self) -> SequenceClassifier:
        return SequenceClassifier(self.model_config(), CLASSES)


@torch.no_grad()
def accuracy(model: SequenceClassifier, split: Split, batch_size: int) -> float:
    """Fraction of ``split`` whose value the model ranks first (batches of similar lengths, for speed)."""
    was_training = model.training
    model.eval()
    order = torch.argsort(split.lengths)
    correct = 0
    for start in range(0, len(split), batch_size):
        ids, mask, labels = split.batch(order[start:start + batch_size])
        correct += int((model(ids, mask).argmax(-1) == labels).sum())
    model.train(was_training)
    return correct / len(split)


def train_step(run: ListOpsRun, model: nn.Module, optimizer: torch.optim.Optimizer,
               batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], step: int) -> float:
    """One optimizer step (0-based ``step``) at the scheduled learning rate; returns the batch's loss."""
    set_learning_rate(optimizer, learning_rate(step, run))
    ids, mask, labels = batch
    loss = F.cross_entropy(model(ids, mask), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), run.clip)
    optimizer.step()
    after_optimizer_step(model)
    if not math.isfinite(loss.item()):
        raise ValueError(f"{run.attention}: training diverged at step {step + 1}, its loss {loss.item()}; weights "
                         f"after it are not saved: train with a lower lr (now {run.lr:g}) in another --out folder")
    return loss.item()


CHECKPOINT = "checkpoint.pt"  # an unfinished run's state, removed once results.json is written


def save_checkpoint(path: Path, run: ListOpsRun, model: nn.Module, optimizer: torch.optim.Optimizer,
                    sampler: torch.Generator, state: dict) -> None:
    """Everything the next step depends on, so a resumed run takes the steps an uninterrupted one would: the
    weights, the optimizer, both random generators, and the curve with the losses its next point averages."""
    saved = {**state, "losses": state["losses"][-run.eval_interval:], "run": asdict(run),
             "model": model.state_dict(), "optimizer": optimizer.state_dict(), "sampler": sampler.get_state(),
             "torch_rng": torch.get_rng_state()}
    atomic_write(path, lambda tmp: torch.save(saved, tmp))


def load_checkpoint(path: Path, run: ListOpsRun, model: nn.Module, optimizer: torch.optim.Optimizer,
                    sampler: torch.Generator, advice: str) -> dict:
    """Load ``path`` (written by :func:`save_checkpoint` for the same settings) into the model, the optimizer
    and the generators; return the training state (step, curve, losses, train_seconds)."""
    saved = read_saved_state(path, "a checkpoint of `lavo listops`", advice)
    check_same_settings(path, saved["run"], asdict(run), advice)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    sampler.set_state(saved["sampler"])
    torch.set_rng_state(saved["torch_rng"])
    return {key: saved[key] for key in ("step", "curve", "losses", "train_seconds")}


def train_listops(run: ListOpsRun, out_dir: str | Path, progress: bool = True, log=print) -> dict:
    """Train ``run`` on its seeded splits, write ``out_dir/results.json`` and return it; a finished
    ``results.json`` of the same settings is returned as it is (the run is skipped), one of other settings is
    refused. ``out_dir/checkpoint.pt`` is saved at every validation point and when Ctrl-C (or SIGTERM) stops
    the run after its current step; a rerun resumes from it, to the numbers an uninterrupted run gives."""
    from tqdm import tqdm
    folder = make_directory(out_dir, "--out")  # a file there is named before any training
    out, checkpoint = folder / "results.json", folder / CHECKPOINT
    torch.manual_seed(run.seed)
    model = run.build_model()  # first, so that a bad setting fails as such, before results are compared or drawn
    elsewhere = f"train into another --out folder, or delete {Path(out_dir)} to train this run there"
    if out.exists():
        results = read_results(out, ("run",), "`lavo listops`", elsewhere)
        check_same_settings(out, results["run"], asdict(run), elsewhere)
        log(f"[skip] {out} exists")
        return results
    optimizer = torch.optim.AdamW(parameter_groups(model, run.weight_decay, run.lr), betas=(0.9, 0.98))
    sampler = torch.Generator().manual_seed(run.seed)
    state = {"step": 0, "curve": [], "losses": [], "train_seconds": 0.0}
    if checkpoint.exists():
        state = load_checkpoint(checkpoint, run, model, optimizer, sampler, elsewhere)
        log(f"resuming from {checkpoint} after step {state['step']}")
    splits = make_splits({"train": run.train_size, "valid": run.valid_size, "test": run.test_size},
                         run.seed, run.spec)
    train, curve, losses = splits["train"], state["curve"], state["losses"]
    started = time.perf_counter() - state["train_seconds"]

    def save() -> None:
        state["train_seconds"] = time.perf_counter() - started
        save_checkpoint(checkpoint, run, model, optimizer, sampler, state)

    with StopRequests() as stops:
        for step in tqdm(range(state["step"], run.steps), initial=state["step"], total=run.steps,
                         disable=not progress, desc=run.attention, mininterval=10):
            losses.append(train_step(run, model, optimizer, train.batch(
                torch.randint(len(train), (run.batch_size,), generator=sampler)), step))
            state["step"] = step + 1
            at_curve_point = (step + 1) % run.eval_interval == 0 or step + 1 == run.steps
            if at_curve_point:
                recent = losses[-run.eval_interval:]
                curve.append({"step": step + 1, "train_loss": sum(recent) / len(recent),
                              "valid_accuracy": accuracy(model, splits["valid"], 2 * run.batch_size)})
                log(f"{run.attention} step {step + 1}: train loss {curve[-1]['train_loss']:.4f}, "
                    f"valid accuracy {curve[-1]['valid_accuracy']:.4f}")
            if at_curve_point or stops.requested:  # a process killed outright loses at most eval_interval steps
                save()
            if stops.requested and step + 1 < run.steps:
                log(f"interrupted after step {step + 1}; saved {checkpoint}: run the same command again to resume")
                raise Stopped(stops.signal)
    train_seconds = time.perf_counter() - started
    results = {
        "run": asdict(run),
        "parameters": count_parameters(model),
        "train_seconds": round(train_seconds, 1),
        "curve": curve,
        "valid_accuracy": curve[-1]["valid_accuracy"],
        "best_valid_accuracy": max(point["valid_accuracy"] for point in curve),
        "test_accuracy": accuracy(model, splits["test"], 2 * run.batch_size),
        "test_majority_accuracy": splits["test"].majority_accuracy(),
        "mean_train_length": float(train.lengths.float().mean()),
    }
    write_json(out, results)
    checkpoint.unlink()
    return results
