"""What a run measures: the settings, their full-run and ``--quick`` values, and each mechanism's options."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SECTIONS = ("attention", "decode", "model", "flops")
PASSES = ("fwd", "fwd+bwd")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

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
    sections: list
    attentions: list
    ops: list
    passes: list
    lengths: list
    max_quadratic_length: int
    batch: int
    heads: int
    head_dim: int
    rank: int
    window: int
    dtype: str
    repeats: int
    warmup: int
    time_limit: float
    decode_attentions: list
    decode_lengths: list
    decode_steps: int
    model_preset: str
    model_overrides: dict
    model_attentions: list
    model_lengths: list
    model_batch: int
    model_repeats: int
    matmul_size: int
    attention_options: dict
    device: str
    threads: int | None
    seed: int
    quick: bool

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def mechanism_options(name: str, settings: Settings, max_length: int) -> dict:
    """Options each mechanism is built with: the paper's window and rank where they apply, cosFormer's horizon
    long enough for the longest sequence, then ``--attention-options`` on top."""
    w, r = settings.window, settings.rank
    defaults = {"lavo": dict(window=w, rank=r), "local": dict(window=w), "longshort": dict(window=w),
                "cosformer": dict(max_length=max_length)}
    return {**defaults.get(name, {}), **settings.attention_options.get(name, {})}


def time_complexity(name: str) -> str:
    """How a registered mechanism's time grows with the sequence length: ``linear`` or ``quadratic``."""
    return "quadratic" if name == "softmax" else "linear"
