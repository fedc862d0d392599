"""Training loop: AdamW, warmup + cosine schedule, clipping, accumulation, optional bf16 autocast, DDP.

A run trains into the run directory ``train.out_dir`` (its files: :mod:`lavo.run`). ``train(config,
resume=True)`` continues a run exactly where its checkpoint left it.

Data parallel: started by ``torchrun --nproc_per_node N -m lavo.cli train ...``; each step draws
``N * batch_size`` windows from one seeded stream and every process takes its share, so the sampler state is
the same on every process. Only rank 0 writes.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import RunConfig
from .data import SPLITS, Prepared, check_source, describe_changes, prepare
from .devices import autocast_for, resolve_device
from .files import make_directory
from .layers.base import after_optimizer_step
from .model import LanguageModel, count_parameters, set_learning_rate
from .ops.common import make_current
from .report import perplexity
from .run import (METRICS, MetricsLog, RunError, RunLock, clear_run, has_checkpoint, load_checkpoint,
                  read_run_config, recorded_documents, recover_checkpoint, save_checkpoint, save_run_config,
                  trained_files)


# what a resumed run may change: how long and how it runs, not what it computes (train.steps extends a run)
RESUMABLE_CHANGES = {"out_dir", "steps", "time_limit", "device", "compile", "activation_checkpointing", "progress",
                     "log_interval", "eval_interval", "eval_batches", "checkpoint_interval"}


# ----------------------------------------------------------------------------------------------- helpers

def learning_rate(step: int, config) -> float:
    """The rate of step ``step`` (0-based): linear warmup to ``lr`` over ``warmup`` steps, then cosine decay that
    would reach ``min_lr`` at step ``steps``, one past the last step trained."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def check_split_length(split: str, num_tokens: int, length: int) -> None:
    """Raise unless the ``split`` holds a window of ``length + 1`` tokens (the inputs and their next tokens)."""
    if num_tokens < length + 1:
        add = "add text" if split == "training" else "hold out more text (data.holdout)"
        raise ValueError(f"the {split} split has {num_tokens} tokens, fewer than train_length + 1 = {length + 1}: "
                         f"lower train.train_length or {add}")


class WindowSampler:
    """Random contiguous windows of ``length + 1`` tokens; draw ``i`` is a pure function of ``(seed, i)``."""

    def __init__(self, num_tokens: int, length: int, seed: int, draws: int = 0):
        check_split_length("training", num_tokens, length)
        self.num_tokens, self.length, self.seed, self.draws = num_tokens, length, seed, draws

    def next_offsets(self, count: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.draws])
        self.draws += 1
        return rng.integers(0, self.num_tokens - self.length, size=count)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "draws": self.draws, "length": self.length}

    def load_state_dict(self, state: dict) -> None:
        if state["length"] != self.length:
            raise ValueError(f"checkpoint sampled windows of {state['length']} tokens, config asks {self.length}")
        self.seed, self.draws = state["seed"], state["draws"]


def windows(tokens: np.ndarray, offsets: np.ndarray, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    batch = np.stack([np.asarray(tokens[o:o + length + 1], dtype=np.int64) for o in offsets])
    batch = torch.from_numpy(batch).to(device)
    return batch[:, :-1], batch[:, 1:]


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- training

@dataclass
class Distributed:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_name: str) -> tuple[Distributed, torch.device]:
    """This process's place among torchrun's (or alone), and its device, made CUDA's current one: kernels that are
    not torch's (Triton's, a CUDA graph's) run on the current device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    env = Distributed() if world == 1 else Distributed(int(os.environ["RANK"]), world,
                                                       int(os.environ.get("LOCAL_RANK", "0")))
    device = resolve_device(device_name, env.local_rank)
    if env.enabled and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    make_current(device)
    return env, device


def valid_loss(model, tokens, length, batches, batch_size, device, autocast) -> float:
    """Mean loss over ``batches * batch_size`` evenly spaced windows of the validation split."""
    count = batches * batch_size
    offsets = np.linspace(0, len(tokens) - length - 1, count).astype(np.int64)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, count, batch_size):
            x, y = windows(tokens, offsets[i:i + batch_size], length, device)
            with autocast():
                logits, _ = model(x)
            total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
    model.train()
    return total / (count * length)


def check_run_directory(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse, before any data work, to train over an earlier run without --resume or --overwrite, or to
    resume one that has weights but no training state; with --overwrite, delete the earlier run's files; with
    --resume, finish or drop a checkpoint write a killed process left half done, and start a run that was
    stopped before its first checkpoint again (only its metrics exist: starting again is resuming it exactly).
    Call it holding the lock."""
    recover_checkpoint(run_dir)
    earlier = trained_files(run_dir)
    if resume and overwrite:
        raise ValueError("--resume continues the run in train.out_dir and --overwrite starts it again: pass one")
    if overwrite:
        clear_run(run_dir)
    elif earlier and not resume:
        raise FileExistsError(f"{run_dir} already holds a run ({', '.join(earlier)}): pass --resume to continue "
                              "it, --overwrite to start again, or choose another --set train.out_dir=...")
    elif resume and earlier == [METRICS]:
        clear_run(run_dir)
    elif resume and earlier and not has_checkpoint(run_dir):
        raise RunError(f"{run_dir} holds {', '.join(earlier)} but no training state (state.pt), so it cannot be "
                       "resumed exactly: start it again with --overwrite, or choose another train.out_dir")


def check_resumed_tokenizer(run_dir: Path, config: RunConfig) -> None:
    """Refuse, before the data is prepared with it, to resume a run with another tokenizer than its own: the
    model's vocabulary is the tokenizer's."""
    saved = read_run_config(run_dir).data.tokenizer
    if config.data.tokenizer != saved:
        raise RunError(f"{run_dir} was trained with data.tokenizer={saved!r}, not {config.data.tokenizer!r}. "
                       f"{resume_advice(run_dir)}")


def resume_advice(run_dir: Path) -> str:
    return ("A resumed run continues with its own settings: give the config and --set it was started with, or "
            f"take its own (--resume {run_dir}, with no --config), or start again with --overwrite or another "
            "train.out_dir")


def agree(env: Distributed, *flags: bool) -> list[bool]:
    """For each flag, whether any process raised it: every process gets the same answers, so that all of them
    stop together (one stopping alone would leave the others waiting on it)."""
    raised = torch.tensor([float(flag) for flag in flags])
    if env.enabled:
        dist.all_reduce(raised, op=dist.ReduceOp.MAX)
    return [bool(flag) for flag in raised]


def every_document(digests: dict[str, dict[str, str]]) -> dict[str, str]:
    """``{name: digest}`` of the documents of every split together."""
    return {name: digest for split in SPLITS for name, digest in digests[split].items()}


def prepare_run(config: RunConfig, env: Distributed, log) -> Prepared:
    """Rank 0 prepares (and caches) the data; the others then map it."""
    data = config.data
    if env.main:
        prepared = prepare(data.source, data.tokenizer, data.data_dir, data.holdout, log=log)
    if env.enabled:
        dist.barrier()
    if not env.main:
        prepared = prepare(data.source, data.tokenizer, data.data_dir, data.holdout, fetch=False, log=log)
    return prepared


class Stopped(KeyboardInterrupt):
    """Training stopped by a signal, after its checkpoint; ``signal``: which (SIGINT or SIGTERM), for the exit
    status (128 + its number)."""

    def __init__(self, number: int):
        super().__init__(number)
        self.signal = number


@contextlib.contextmanager
def signal_handlers(handler: Callable, *numbers: int):
    """``handler`` for the signals ``numbers`` while the block runs, the previous handlers after it; in the main
    thread only (signal handlers live there: in another thread the block runs with the handlers as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, handler) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def sigterm_as_interrupt():
    """While active, SIGTERM (from `timeout` or a job scheduler) interrupts as Ctrl-C does, raising
    :class:`Stopped`, which ends a ``lavo`` command with exit status 143."""
    def stop(number, frame):
        raise Stopped(number)
    return signal_handlers(stop, signal.SIGTERM)


class StopRequests:
    """While active, SIGINT (Ctrl-C) and SIGTERM only set :attr:`requested` (and :attr:`signal`), so training
    stops between two steps and saves exactly where it is; a second Ctrl-C interrupts at once (the previous
    checkpoint stays)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self.signal = signal.SIGINT  # another process's request, agreed on, stops this one as Ctrl-C would
        self.handlers = contextlib.ExitStack()

    def handle(self, number, frame) -> None:
        if self.requested and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested, self.signal = True, number

    def __enter__(self) -> "StopRequests":
        self.handlers.enter_context(signal_handlers(self.handle, *self.SIGNALS))
        return self

    def __exit__(self, *exc) -> None:
        self.handlers.close()


@dataclass
class Progress:
    """How far a run is; saved in its checkpoint, so a resumed run carries on counting."""

    step: int = 0  # optimiser steps done
    tokens: int = 0  # training tokens seen, all processes together
    elapsed: float = 0.0  # seconds spent training
    loss: float = math.nan  # the training loss of the last step


class Trainer:
    """The model, optimiser and sampler of one run, and the steps that train it.

    Building it seeds torch and initialises the model exactly as a fresh run does, so a resumed run (which then
    loads its checkpoint over it) and an uninterrupted one follow the same path.
    """

    def __init__(self, config: RunConfig, env: Distributed, device: torch.device, data: Prepared, log=print):
        tc = config.train
        self.config, self.tc, self.env, self.device, self.data, self.log = config, tc, env, device, data, log
        self.run_dir = Path(tc.out_dir)
        self.autocast = autocast_for(tc.dtype, device)
        self.model_config = config.model_config(vocab_size=data.tokenizer.vocab_size)
        torch.manual_seed(tc.seed)
        self.model = LanguageModel(self.model_config).to(device)
        self.model.set_activation_checkpointing(tc.activation_checkpointing)
        # AdamW's fused step, on the GPU and on the CPU alike
        self.optimizer = torch.optim.AdamW(self.model.parameter_groups(tc.weight_decay, tc.lr), lr=tc.lr,
                                           betas=(tc.beta1, tc.beta2), fused=device.type in ("cuda", "cpu") or None)
        # float16 gradients underflow unless the loss is scaled up; a step with inf or NaN gradients is skipped
        # and the scale lowered. Off (every call passes through) in the other dtypes.
        self.scaler = torch.amp.GradScaler(device.type, enabled=tc.dtype == "float16")
        self.sampler = WindowSampler(len(data.train), tc.train_length, tc.seed)
        check_split_length("validation", len(data.valid), tc.train_length)  # before training, not at the first check
        self.progress = Progress()
        self.metrics = MetricsLog(self.run_dir)
        self.replica = self.model  # what the steps call: the model, or its DDP or compiled wrapper
        self.bar = None  # the progress bar, while run() runs
        self.window_start, self.window_tokens = time.perf_counter(), 0  # throughput since the last record
        self.call_started = self.window_start  # when this call's run() began: what train.time_limit counts from

    def restore(self) -> None:
        """Continue from the run directory's checkpoint: weights, optimiser, sampler, counters and RNG. Refuses
        a checkpoint made with another tokenizer or other training data."""
        if not has_checkpoint(self.run_dir):
            self.log(f"no checkpoint in {self.run_dir}; starting a new run")
            return
        saved = self.check_resumed_settings()
        state = load_checkpoint(self.run_dir, self.model)
        self.check_same_data(state)
        self.check_same_world_size(state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state.get("scaler", {}))
        self.sampler.load_state_dict(state["sampler"])
        self.progress = Progress(state["step"], state["tokens"], state["elapsed"], state.get("loss", math.nan))
        torch.set_rng_state(state["rng"]["torch"])
        if self.device.type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        if self.env.main:
            self.metrics.forget_after(self.progress.step)
        self.log(f"resumed {self.run_dir} at step {self.progress.step}")
        if saved.train.steps != self.tc.steps:
            step = self.progress.step
            now, before = (f"{learning_rate(step, tc):.3g}" for tc in (self.tc, saved.train))
            self.log(f"train.steps is {self.tc.steps}, the run's was {saved.train.steps}: the learning-rate schedule "
                     f"now decays to step {self.tc.steps}"
                     + (f", so the rate at step {step} is {now} instead of {before}" if now != before else ""))

    def check_resumed_settings(self) -> RunConfig:
        """Refuse to resume with model or training settings other than the run's own (``config.json``): the
        checkpoint holds what they made. Only :data:`RESUMABLE_CHANGES` may differ. Returns the run's config."""
        saved = read_run_config(self.run_dir)
        before = {"model": saved.model_config().to_dict(), "train": asdict(saved.train)}
        now = {"model": self.model_config.to_dict(), "train": asdict(self.tc)}
        changed = [f"{section}.{key}={now[section][key]!r} (the run's: {value!r})"
                   for section, values in before.items() for key, value in values.items()
                   if key not in RESUMABLE_CHANGES and now[section][key] != value]
        if changed:
            raise RunError(f"{self.run_dir} was trained with other settings than asked now: {'; '.join(changed)}. "
                           f"{resume_advice(self.run_dir)}")
        return saved

    def check_same_data(self, state: dict) -> None:
        data = self.data
        for key, now, what in (("tokenizer_sha256", data.tokenizer.sha256, "tokenizer"),
                               ("data_fingerprint", data.manifest["fingerprint"], "training data")):
            if state.get(key, now) != now:
                raise RunError(
                    f"{self.run_dir} was trained with another {what} ({key} {state[key][:12]}) than the one "
                    f"prepared now in {data.directory} ({now[:12]}): {self.describe_data_change()}, or start "
                    "again with --overwrite")

    def check_same_world_size(self, state: dict) -> None:
        """Refuse another number of processes: each takes ``batch_size`` windows of the sampler's order, so the
        batch and the data each step sees depend on it."""
        world = state.get("world_size", self.env.world)  # checkpoints from before it was saved: not checked
        if world != self.env.world:
            how = "lavo train" if world == 1 else f"torchrun --nproc_per_node {world} -m lavo.cli train"
            raise RunError(f"{self.run_dir} was trained by {world} process{'es' if world > 1 else ''}, and is "
                           f"resumed by {self.env.world}: each takes train.batch_size windows a step, so its batches "
                           f"and data order would change. Resume it with {how}")

    def describe_data_change(self) -> str:
        """What differs between the documents the run recorded and those prepared now, and what to do about it."""
        recorded, now = recorded_documents(self.run_dir), self.data.digests
        if recorded is None or recorded == now:  # a run from before documents.json, or only the tokenizer changed
            return ("the texts, the held-out documents or the tokenizer changed since. Resume with the data "
                    "settings of its config.json")
        if every_document(recorded) == every_document(now):
            return (f"the same documents, other ones held out ({', '.join(now['valid'])}; the run's: "
                    f"{', '.join(recorded['valid'])}). Resume with the data settings of its config.json")
        changes = "; ".join(f"{split}: {change}" for split in SPLITS
                            if (change := describe_changes(recorded[split], now[split])))
        return f"its documents are not those it recorded ({changes}). Put them back as they were"

    def start(self) -> None:
        """Write the run's config and tokenizer, describe the model, and wrap it for data parallelism."""
        config, model = self.model_config, self.model
        if self.env.main:
            save_run_config(self.run_dir, self.config, config, self.data.tokenizer, self.data.digests)
            self.log(f"model: {config.attention} {config.attention_options or ''} position={config.position}, "
                     f"{count_parameters(model) / 1e6:.2f}M parameters "
                     f"({count_parameters(model, exclude_embedding=True) / 1e6:.2f}M without embeddings)")
        if self.env.enabled:
            self.replica = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if self.tc.compile:  # training windows all have one shape, so this compiles once
            if self.env.enabled and torch.__version__ < "2.6":
                # Before 2.6, Dynamo's DDP optimizer refuses graphs with higher-order ops, which the CPU path's
                # autograd.Functions become; without it the graph syncs gradients as one bucket.
                torch._dynamo.config.optimize_ddp = False
            self.replica = torch.compile(self.replica)
            if self.env.main:  # the bar would otherwise sit at its first step, with no word of why
                self.log("train.compile: the first step compiles the model (torch.compile), so it takes longer "
                         "than the others")

    @property
    def tokens_per_step(self) -> int:
        return self.tc.batch_size * self.tc.grad_accum * self.env.world * self.tc.train_length

    def train_step(self, lr: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimiser step over ``grad_accum`` micro-batches; returns the mean loss (over the processes too)
        and the gradient norm before clipping (None without clipping)."""
        tc, env = self.tc, self.env
        set_learning_rate(self.optimizer, lr)
        total = torch.zeros((), device=self.device)
        # one draw a step, dealt out by micro-batch, then process: every split of the step's windows into
        # batch_size x grad_accum x processes trains on the same windows
        offsets = self.sampler.next_offsets(tc.batch_size * env.world * tc.grad_accum).reshape(tc.grad_accum, -1)
        for micro in range(tc.grad_accum):
            x, y = windows(self.data.train.tokens, offsets[micro, env.rank::env.world], tc.train_length, self.device)
            sync = micro == tc.grad_accum - 1 or not env.enabled  # DDP averages gradients on the last one only
            with (contextlib.nullcontext() if sync else self.replica.no_sync()):
                with self.autocast():
                    logits = self.replica(x)[0]  # the layers' caches are not kept through the backward
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                self.scaler.scale(loss / tc.grad_accum).backward()
            total += loss.detach() / tc.grad_accum
        self.scaler.unscale_(self.optimizer)  # clipping and the recorded norm see the true gradients
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip) if tc.grad_clip > 0 else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        after_optimizer_step(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        if env.enabled:
            dist.all_reduce(total)
            total /= env.world
        return total, norm

    def record(self, entry: dict) -> None:
        if self.env.main:
            self.metrics.write(entry)

    def log_step(self, loss: torch.Tensor, norm: torch.Tensor | None, lr: float) -> None:
        """Record the step's loss, learning rate and the throughput since the last record."""
        loss_value = loss.item()
        now = time.perf_counter()
        speed = self.window_tokens / max(now - self.window_start, 1e-9)
        self.window_start, self.window_tokens = now, 0
        p = self.progress
        entry = {"step": p.step, "loss": loss_value, "lr": lr, "tokens": p.tokens, "tokens_per_s": round(speed, 1),
                 "elapsed": round(p.elapsed, 2), "grad_norm": None if norm is None else round(norm.item(), 4)}
        if self.scaler.is_enabled():  # float16: the scale for the next step, halved after a skipped one
            entry["loss_scale"] = self.scaler.get_scale()
        self.record(entry)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{speed:,.0f}")

    def off_the_clock(self, work: Callable[[], None]) -> None:
        """Do ``work`` (validation, a checkpoint) without counting its time in the training throughput."""
        begin = time.perf_counter()
        work()
        self.window_start += time.perf_counter() - begin

    def validate(self) -> None:
        tc = self.tc
        valid = valid_loss(self.model, self.data.valid.tokens, tc.train_length, tc.eval_batches, tc.batch_size,
                           self.device, self.autocast)
        self.record({"step": self.progress.step, "valid_loss": valid, "valid_ppl": perplexity(valid)})
        self.say(f"step {self.progress.step}: valid loss {valid:.4f} (ppl {perplexity(valid):.2f})")

    def say(self, message: str) -> None:
        """Log a line above the progress bar rather than onto it."""
        if self.bar is None:
            self.log(message)
            return
        from tqdm import tqdm
        with tqdm.external_write_mode():
            self.log(message)

    def checkpoint(self) -> None:
        if not self.env.main:
            return
        p = self.progress
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
        save_checkpoint(self.run_dir, self.model, {
            "step": p.step, "tokens": p.tokens, "elapsed": p.elapsed, "loss": p.loss,
            "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(), "rng": rng, "world_size": self.env.world,
            "tokenizer_sha256": self.data.tokenizer.sha256, "data_fingerprint": self.data.manifest["fingerprint"]})

    def stop_reason(self, stops: StopRequests) -> str | None:
        """``"interrupt"``, ``"time"`` or None: whether to stop now, agreed by every process (so that all of
        them stop after the same step)."""
        tc = self.tc
        late = tc.time_limit is not None and time.perf_counter() - self.call_started > tc.time_limit
        interrupted, late = agree(self.env, stops.requested, late)
        if interrupted:
            return "interrupt"
        if late:
            self.say(f"time limit of {tc.time_limit:g} s for this call reached at step {self.progress.step}")
            return "time"
        return None

    def run(self, end: int) -> dict:
        """Train up to step ``end`` (or the time limit), logging, validating and checkpointing on the way; save a
        final checkpoint and return the summary. Ctrl-C (or SIGTERM) finishes the current step, saves a
        checkpoint and the summary there, and raises :class:`Stopped` (a ``KeyboardInterrupt``)."""
        tc, p = self.tc, self.progress
        if p.step >= end:
            self.log(f"{self.run_dir} is already trained to step {p.step} (train.steps is {tc.steps}): nothing "
                     "to do; raise train.steps to train further")
            # a call stopped between its last checkpoint and its summary: write it (every process, as one)
            if agree(self.env, self.metrics.final_step() != p.step)[0]:
                return self.finish()
            self.metrics.close()
            return self.summary()
        if self.env.main and tc.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=tc.steps, initial=p.step, desc=self.run_dir.name, unit="step", dynamic_ncols=True)
        self.model.train()
        self.window_start, self.window_tokens = time.perf_counter(), 0
        self.call_started = time.perf_counter()
        started = self.call_started - p.elapsed
        stop = None
        try:
            with StopRequests() as stops:
                while p.step < end and stop is None:
                    self.take_step(end, started)
                    stop = self.stop_reason(stops)
                    due = tc.checkpoint_interval and p.step % tc.checkpoint_interval == 0 and p.step < end
                    if due and stop is None:
                        self.off_the_clock(self.checkpoint)
                if stop == "interrupt":
                    self.say(f"interrupted after step {p.step}; saving a checkpoint (resume with --resume)")
                self.checkpoint()  # still under the handlers: a Ctrl-C now waits for the checkpoint
                if stop != "interrupt" and agree(self.env, stops.requested)[0]:  # asked for during it
                    stop = "interrupt"
                    self.say(f"interrupted during the checkpoint of step {p.step}, which is saved (resume with "
                             "--resume)")
        finally:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
        summary = self.finish()
        if stop == "interrupt":
            raise Stopped(stops.signal)
        return summary

    def take_step(self, end: int, started: float) -> None:
        """One training step and its bookkeeping: the counters, the log record (every ``log_interval`` steps and
        at ``end``), the progress bar, and validation when due. ``started``: the ``perf_counter`` reading at which
        the run's training time was zero (this call's start less what earlier calls trained)."""
        tc, p = self.tc, self.progress
        lr = learning_rate(p.step, tc)
        try:
            loss, norm = self.train_step(lr)
        except torch.cuda.OutOfMemoryError as error:
            raise RunError(self.out_of_memory(p.step + 1)) from error
        p.step += 1
        p.tokens += self.tokens_per_step
        p.loss = loss.item()
        if not math.isfinite(p.loss):
            self.check_diverged()
        self.window_tokens += self.tokens_per_step
        p.elapsed = time.perf_counter() - started
        if p.step % tc.log_interval == 0 or p.step == end:
            self.log_step(loss, norm, lr)
        if self.bar is not None:
            self.bar.update(1)
        # at train.steps, not at end: a call cut short by stop_after validates as the uninterrupted run would
        if tc.eval_interval and (p.step % tc.eval_interval == 0 or p.step == tc.steps) and self.env.main:
            self.off_the_clock(self.validate)

    def check_diverged(self) -> None:
        """After a step whose loss is not finite: stop, before such weights are saved, if the step made them so.
        A float16 step that overflowed is skipped by the loss scaler and leaves them finite: training goes on."""
        if all(torch.isfinite(p).all() for p in self.model.parameters()):
            return
        tc = self.tc
        raise RunError(f"training diverged at step {self.progress.step}: the loss is {self.progress.loss} and the "
                       f"weights are no longer finite. They are not saved: {self.run_dir}'s last checkpoint, if "
                       f"any, is from before. Train again (--overwrite) with a lower train.lr (now {tc.lr:g}) or "
                       f"a longer train.warmup (now {tc.warmup})")

    def out_of_memory(self, step: int) -> str:
        """What to do when training step ``step`` ran out of GPU memory."""
        tc, ways = self.tc, []
        if not tc.activation_checkpointing:
            ways.append("set train.activation_checkpointing=true (a resumed run may turn it on: --resume goes on "
                        "from the last checkpoint)")
        if tc.dtype == "float32":
            ways.append("train under autocast, train.dtype=bfloat16 (float16 on GPUs before Ampere)")
        if tc.batch_size > 1:
            ways.append(f"start again with a smaller train.batch_size ({tc.batch_size}) and a train.grad_accum "
                        f"({tc.grad_accum}) as much larger, the same windows in smaller pieces")
        else:
            ways.append(f"start again with a shorter train.train_length ({tc.train_length})")
        windows = f"{tc.batch_size} window{'s' if tc.batch_size > 1 else ''}"
        return (f"training step {step} ran out of GPU memory with {windows} of {tc.train_length} tokens per "
                f"micro-batch. To fit: " + "; or ".join(ways))

    def summary(self) -> dict:
        p = self.progress
        return {"step": p.step, "loss": p.loss, "tokens": p.tokens, "elapsed": round(p.elapsed, 2),
                "parameters": count_parameters(self.model), "world_size": self.env.world}

    def finish(self) -> dict:
        """The summary of this call, also the final record of ``metrics.jsonl``; with several processes it holds
        each one's weight digest (they must agree)."""
        summary, env = self.summary(), self.env
        if env.enabled:
            digests = [None] * env.world
            dist.all_gather_object(digests, weights_digest(self.model))
            summary["rank_digests"] = digests
        self.record({"final": True, **summary})
        self.metrics.close()
        if env.enabled:
            dist.barrier()
        return summary


def train(config: RunConfig, resume: bool = False, overwrite: bool = False, stop_after: int | None = None,
          log=print) -> dict:
    """Train (or resume) the run described by ``config``; returns a summary (final loss, steps, tokens, ...).

    ``stop_after`` ends this call after that many steps (checkpointing), as an interruption would.
    """
    env, device = setup_distributed(config.train.device)
    say = log if env.main else (lambda *args, **kwargs: None)
    run_dir = Path(config.train.out_dir)
    check_source(config.data.source)  # a misspelt source is named as such, before the run directory is judged
    lock = contextlib.nullcontext()
    if env.main:
        make_directory(run_dir, "train.out_dir")
        lock = RunLock(run_dir)
    with lock:
        refused = None
        if env.main:
            try:
                check_run_directory(run_dir, resume, overwrite)
                if resume and has_checkpoint(run_dir):
                    check_resumed_tokenizer(run_dir, config)
            except (RunError, ValueError, OSError) as error:
                refused = error
        if agree(env, refused is not None)[0]:
            raise refused or RunError(f"process 0 refused {run_dir} (its message says why)")
        data = prepare_run(config, env, say)
        trainer = Trainer(config, env, device, data, say)
        if resume:
            trainer.restore()
        trainer.start()
        steps = config.train.steps
        return trainer.run(steps if stop_after is None else min(steps, trainer.progress.step + stop_after))
