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
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import RunConfig
from .data import prepare
from .model import LanguageModel, count_parameters
from .run import MetricsLog, has_checkpoint, load_checkpoint, save_checkpoint, save_run_config


# ----------------------------------------------------------------------------------------------- helpers

def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} was asked for but CUDA is not available; use --set train.device=cpu")
    return device


def learning_rate(step: int, config) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``steps``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


class WindowSampler:
    """Random contiguous windows of ``length + 1`` tokens; draw ``i`` is a pure function of ``(seed, i)``."""

    def __init__(self, num_tokens: int, length: int, seed: int, draws: int = 0):
        if num_tokens < length + 1:
            raise ValueError(f"the training split has {num_tokens} tokens, fewer than train_length + 1 = "
                             f"{length + 1}: lower train.train_length or add text")
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
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Distributed(), resolve_device(device_name)
    env = Distributed(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    device = resolve_device(device_name, env.local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return env, device


def _valid_loss(model, tokens, length, batches, batch_size, device, autocast) -> float:
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


def train(config: RunConfig, resume: bool = False, overwrite: bool = False, stop_after: int | None = None,
          log=print) -> dict:
    """Train (or resume) the run described by ``config``; returns a summary (final loss, steps, tokens, ...).

    ``stop_after`` ends this call after that many steps (checkpointing), as an interruption would.
    """
    tc = config.train
    env, device = setup_distributed(tc.device)
    say = log if env.main else (lambda *a, **k: None)
    run_dir = Path(tc.out_dir)
    if env.main:
        if has_checkpoint(run_dir) and not resume and not overwrite:
            raise FileExistsError(f"{run_dir} already holds a checkpoint: pass --resume to continue it, "
                                  "--overwrite to start again, or choose another --set train.out_dir=...")
        run_dir.mkdir(parents=True, exist_ok=True)
        prepared = prepare(config.data.source, config.data.tokenizer, config.data.data_dir, config.data.holdout,
                           log=say)
    if env.enabled:
        dist.barrier()  # rank 0 prepared (and cached) the data; the others now map it
    if not env.main:
        prepared = prepare(config.data.source, config.data.tokenizer, config.data.data_dir, config.data.holdout,
                           fetch=False, log=say)
    model_config = config.model_config(vocab_size=prepared.tokenizer.vocab_size)

    torch.manual_seed(tc.seed)
    model = LanguageModel(model_config).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "pos_bias" not in n
             and "parametrizations" not in n]
    no_decay = [p for n, p in model.named_parameters() if not any(p is q for q in decay)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=tc.lr, betas=(tc.beta1, tc.beta2), fused=device.type == "cuda" or None)
    sampler = WindowSampler(len(prepared.train), tc.train_length, tc.seed)
    step, tokens_seen, elapsed = 0, 0, 0.0

    metrics = MetricsLog(run_dir)
    if resume and has_checkpoint(run_dir):
        state = load_checkpoint(run_dir, model)
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        step, tokens_seen, elapsed = state["step"], state["tokens"], state["elapsed"]
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], device)
        if env.main:
            metrics.forget_after(step)
        say(f"resumed {run_dir} at step {step}")
    elif resume:
        say(f"no checkpoint in {run_dir}; starting a new run")

    if env.main:
        save_run_config(run_dir, config, model_config, prepared.tokenizer)
        say(f"model: {model_config.attention} {model_config.attention_options or ''} position={model_config.position}"
            f", {count_parameters(model) / 1e6:.2f}M parameters "
            f"({count_parameters(model, exclude_embedding=True) / 1e6:.2f}M without embeddings)")
    if env.enabled:
        model_ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index]
                                                              if device.type == "cuda" else None)
    else:
        model_ddp = model
    dtype = {"float32": None, "bfloat16": torch.bfloat16}
    if tc.dtype not in dtype:
        raise ValueError(f"train.dtype must be float32 or bfloat16, got {tc.dtype!r}")

    def autocast():
        if dtype[tc.dtype] is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype[tc.dtype])

    tokens_per_step = tc.batch_size * tc.grad_accum * env.world * tc.train_length
    end = tc.steps if stop_after is None else min(tc.steps, step + stop_after)
    progress = None
    if env.main and tc.progress:
        from tqdm import tqdm
        progress = tqdm(total=tc.steps, initial=step, desc=run_dir.name, unit="step", dynamic_ncols=True)

    def record(entry: dict) -> None:
        if env.main:
            metrics.write(entry)

    def checkpoint() -> None:
        if env.main:
            rng = {"torch": torch.get_rng_state(),
                   "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
            save_checkpoint(run_dir, model, {"step": step, "tokens": tokens_seen, "elapsed": elapsed,
                                             "optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(),
                                             "rng": rng})

    model.train()
    loss_value, last = float("nan"), None
    window_start, window_tokens = time.perf_counter(), 0
    started = time.perf_counter() - elapsed
    try:
        while step < end:
            lr = learning_rate(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            total = torch.zeros((), device=device)
            for micro in range(tc.grad_accum):
                offsets = sampler.next_offsets(tc.batch_size * env.world)
                x, y = windows(prepared.train.tokens, offsets[env.rank::env.world], tc.train_length, device)
                sync = micro == tc.grad_accum - 1 or not env.enabled
                with (contextlib.nullcontext() if sync else model_ddp.no_sync()):
                    with autocast():
                        logits, _ = model_ddp(x)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                    (loss / tc.grad_accum).backward()
                total += loss.detach() / tc.grad_accum
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip) if tc.grad_clip > 0 else None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if env.enabled:
                dist.all_reduce(total)
                total /= env.world
            step += 1
            last = total
            tokens_seen += tokens_per_step
            window_tokens += tokens_per_step
            elapsed = time.perf_counter() - started
            if step % tc.log_interval == 0 or step == end:
                loss_value = total.item()
                now = time.perf_counter()
                speed = window_tokens / max(now - window_start, 1e-9)
                window_start, window_tokens = now, 0
                record({"step": step, "loss": loss_value, "lr": lr, "tokens": tokens_seen,
                        "tokens_per_s": round(speed, 1), "elapsed": round(elapsed, 2),
                        "grad_norm": None if norm is None else round(norm.item(), 4)})
                if progress is not None:
                    progress.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{speed:,.0f}")
            if progress is not None:
                progress.update(1)
            if tc.eval_interval and (step % tc.eval_interval == 0 or step == tc.steps) and env.main:
                valid = _valid_loss(model, prepared.valid.tokens, tc.train_length, tc.eval_batches,
                                    tc.batch_size, device, autocast)
                record({"step": step, "valid_loss": valid, "valid_ppl": math.exp(valid)})
                say(f"step {step}: valid loss {valid:.4f} (ppl {math.exp(valid):.2f})")
            if tc.checkpoint_interval and step % tc.checkpoint_interval == 0 and step < end:
                checkpoint()
            if tc.time_limit is not None:
                over = torch.tensor(float(elapsed > tc.time_limit))
                if env.enabled:
                    dist.all_reduce(over, op=dist.ReduceOp.MAX)
                if over.item():
                    say(f"time limit of {tc.time_limit:.0f}s reached at step {step}")
                    break
    except KeyboardInterrupt:
        say(f"interrupted at step {step}; saving a checkpoint (resume with --resume)")
        checkpoint()
        raise
    finally:
        if progress is not None:
            progress.close()
    if last is not None:
        loss_value = last.item()
    checkpoint()
    summary = {"step": step, "loss": loss_value, "tokens": tokens_seen, "elapsed": round(elapsed, 2),
               "parameters": count_parameters(model), "world_size": env.world}
    if env.enabled:
        digests = [None] * env.world
        dist.all_gather_object(digests, weights_digest(model))
        summary["rank_digests"] = digests
    record({"final": True, **summary})
    metrics.close()
    if env.enabled:
        dist.barrier()
    return summary
