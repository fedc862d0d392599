"""The ``model`` section: training throughput (forward, loss, backward, clipping, AdamW step) and peak memory of
the whole language model for a preset, per attention, each as a ratio to the quadratic attention (softmax, with
rotary positions) at the same length; with ``--model-checkpointing``, each model also with activation
checkpointing (a row of its own)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..model import PRESETS, build_model, count_parameters, model_config
from ..registry import attention_class
from .runner import Ratios, Runner, fill, record
from .settings import Settings, full_attention, mechanism_options, quadratic


def position(name: str) -> str:
    """Rotary positions for the attentions that take them; the others carry their own or none."""
    return "rope" if attention_class(name).accepts_rotary else "none"


def label(name: str, checkpointed: bool = False) -> str:
    return (f"{name}+rope" if position(name) == "rope" else name) + (", checkpointed" if checkpointed else "")


def model_for(name: str, settings: Settings, max_length: int):
    options = mechanism_options(name, settings, max_length)
    shape = {**PRESETS[settings.model_preset], **settings.model_overrides}
    if "rank" in options:  # LAVO's orthogonal basis has at most D vectors (tiny preset: D = 48 < the run's 64)
        options["rank"] = min(options["rank"], shape["dim"] // shape["heads"])
    config = model_config(settings.model_preset, attention=name, attention_options=options, position=position(name),
                          **settings.model_overrides)
    return build_model(config)


def plan(settings: Settings) -> list[tuple[str, bool, int]]:
    """(attention, checkpointed, length) in run order: full attention first (the reference of the ratios), each
    attention without activation checkpointing, then with it when ``--model-checkpointing``; quadratic ones only
    up to ``--max-quadratic-length``."""
    names = sorted(settings.model_attentions, key=lambda name: not full_attention(name))
    variants = (False, True) if settings.model_checkpointing else (False,)
    return [(name, checkpointed, length) for name in names for checkpointed in variants
            for length in settings.model_lengths if not quadratic(name) or length <= settings.max_quadratic_length]


def planned(settings: Settings) -> int:
    return len(plan(settings))


def train_step(name: str, length: int, runner: Runner, checkpointed: bool = False) -> tuple[Callable[[], None], int]:
    """One training step of the model with attention ``name`` at ``length`` (forward, loss, backward, clipping,
    AdamW step; ``checkpointed``: every block's activations recomputed in backward) as a no-argument function, and
    the model's parameter count. With ``--model-compile`` the model is compiled here, by one untimed step, so that
    no measurement's time limit meets the compilation."""
    s, device = runner.settings, runner.device
    model = model_for(name, s, max(s.model_lengths)).to(device).train()
    model.set_activation_checkpointing(checkpointed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(model.config.vocab_size, (s.model_batch, length + 1), device=device)
    forward = torch.compile(model) if s.model_compile else model

    def step():
        with runner.autocast():
            logits = forward(ids[:, :-1])[0]  # as `lavo train`: the layers' caches are not kept
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if s.model_compile:
        step()
    return step, count_parameters(model)


def run(runner: Runner) -> None:
    s = runner.settings
    steps = plan(s)
    reference = steps[0][0] if steps and full_attention(steps[0][0]) else None
    # a checkpointed step against the reference's checkpointed step, so that a ratio compares attentions only
    ratios = {checkpointed: Ratios(None if reference is None else label(reference, checkpointed))
              for checkpointed in (False, True)}
    for name, checkpointed, length in steps:
        entry = record("model", "model", label(name, checkpointed), "train_step", length, s, batch=s.model_batch,
                       compiled=s.model_compile, checkpointed=checkpointed, preset=s.model_preset,
                       model_overrides=s.model_overrides, tokens_per_s=None, parameters=None)

        def work(entry, name=name, length=length, checkpointed=checkpointed):
            step, entry["parameters"] = train_step(name, length, runner, checkpointed)
            fill(entry, runner.measure(step, repeats=s.model_repeats))
            entry["tokens_per_s"] = s.model_batch * length / (entry["ms"] / 1e3)

        runner.run(entry, ("model", name, checkpointed), attention_class(name).time_complexity, work)
        ratios[checkpointed].add(entry, length)
