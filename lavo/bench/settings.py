"""What a run measures: the settings, their full-run and ``--quick`` values, and each mechanism's options."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import attention_class
from ..settings import SEED, above, at_least, matches, setting

DEFAULT_SECTIONS = ("attention", "decode", "model", "flops")
SECTIONS = DEFAULT_SECTIONS + ("profile",)  # the profile runs when asked for
PASSES = ("fwd", "fwd+bwd")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Full-run and --quick values of the settings the user did not give.
FULL = dict(lengths=[2 ** i for i in range(10, 17)], max_quadratic_length=16384, repeats=5, warmup=1,
            decode_lengths=[2 ** i for i in range(10, 17)], decode_steps=32, model_preset="small",
            model_lengths=[1024, 4096], model_repeats=3, matmul_size=2048, time_limit=60.0, heads=8, head_dim=64,
            rank=64, window=128, model_overrides={})
QUICK = dict(lengths=[128, 256], max_quadratic_length=256, repeats=2, warmup=1, decode_lengths=[128, 256],
             decode_steps=4, model_preset="tiny", model_lengths=[64], model_repeats=1, matmul_size=256,
             time_limit=30.0, heads=2, head_dim=16, rank=16, window=32,
             model_overrides=dict(dim=64, heads=2, depth=2, vocab_size=512))


@dataclass
class Settings:
    """What a run measures; the allowed values declared here are checked on the command-line flags."""

    sections: list
    attentions: list
    ops: list
    passes: list
    lengths: list
    max_quadratic_length: int
    batch: int = setting(allowed=at_least(1))
    heads: int = setting(allowed=at_least(1))
    head_dim: int = setting(allowed=at_least(1))
    rank: int = setting(allowed=at_least(1))
    window: int = setting(allowed=at_least(1))
    dtype: str
    repeats: int = setting(allowed=at_least(1))
    warmup: int = setting(allowed=at_least(0))
    time_limit: float = setting(allowed=above(0))
    decode_attentions: list
    decode_lengths: list
    decode_steps: int = setting(allowed=at_least(1))
    model_preset: str
    model_overrides: dict
    model_attentions: list
    model_lengths: list
    model_batch: int = setting(allowed=at_least(1))
    model_repeats: int = setting(allowed=at_least(1))
    model_compile: bool
    model_checkpointing: bool
    matmul_size: int = setting(allowed=at_least(1))
    attention_options: dict
    device: str = setting(allowed=matches(r"cpu|cuda(:\d+)?", "cpu, cuda or cuda:N"))
    backend: str
    threads: int | None = setting(allowed=at_least(1))
    seed: int = setting(allowed=SEED)
    quick: bool

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def mechanism_options(name: str, settings: Settings, max_length: int) -> dict:
    """Options a mechanism is built with: of the run's ``window`` and ``rank`` (the paper's), ``max_length``
    (a horizon long enough for the longest sequence) and ``backend``, those the mechanism has an option of that
    name for, then its ``--attention-options`` on top."""
    shared = dict(window=settings.window, rank=settings.rank, max_length=max_length, backend=settings.backend)
    defaults = {option: shared[option] for option in attention_class(name).option_names() if option in shared}
    return {**defaults, **settings.attention_options.get(name, {})}


def having_option(option: str, names: list[str]) -> list[str]:
    """The mechanisms of ``names`` that have a constructor option named ``option``."""
    return [name for name in names if option in attention_class(name).option_names()]


def quadratic(name: str) -> bool:
    """Whether the time of the registered mechanism ``name`` grows with the square of the sequence length."""
    return attention_class(name).time_complexity == "quadratic"


def full_attention(name: str) -> bool:
    """Whether ``name`` is quadratic and keeps every key and value to decode (softmax): what the decode and model
    sections compare the others with. A quadratic mechanism without a decoding form (long-short's landmarks)
    is not."""
    cls = attention_class(name)
    return cls.time_complexity == "quadratic" and cls.supports_decoding
