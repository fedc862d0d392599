"""Where and in which precision a command runs: the device a name asks for, and autocast to a 16-bit dtype."""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch

from .run import RunError


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """``"auto"``: this process's GPU when there is one, else the CPU; ``"cuda"``: the GPU of ``local_rank``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but no CUDA device is available: choose the CPU "
                         "(--device cpu; for lavo train, --set train.device=cpu)")
    return device


AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_for(dtype: str, device: torch.device,
                 setting: str = "train.dtype") -> Callable[[], contextlib.AbstractContextManager]:
    """A context factory: autocast to ``dtype`` (``"bfloat16"`` or ``"float16"``), nothing for float32. Refuses
    bfloat16 on a GPU without it (before Ampere), where it would be emulated, slowly, or fail; warns of float16 on
    the CPU. ``setting``: what the messages call the choice."""
    if dtype == "float32":
        return contextlib.nullcontext
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"{setting} must be float32, bfloat16 or float16, got {dtype!r}")
    if dtype == "bfloat16" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        raise RunError(f"{setting}=bfloat16 needs a GPU with bfloat16 arithmetic (NVIDIA Ampere or later); "
                       f"{torch.cuda.get_device_name(device)} has none: use {setting}=float16 or float32")
    if dtype == "float16" and device.type == "cpu":
        warnings.warn(f"{setting}=float16 on the CPU is slow: most CPUs have no fast float16 arithmetic; use "
                      "float32 there (or bfloat16, on a CPU with bfloat16 instructions)", stacklevel=2)
    return lambda: torch.autocast(device.type, dtype=AUTOCAST_DTYPES[dtype])
