"""The ``attention`` section: every registered layer and raw ops (LAVO's, SDPA, and fla's when asked for), forward
and forward + backward, time and peak memory against the sequence length, each as a ratio to the SDPA op at the
same length and pass."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ..ops import lavo_attention, orthogonal_basis
from ..registry import attention_class, build_attention
from .measure import Skipped
from .runner import Ratios, Runner, fill, record
from .settings import Settings, mechanism_options

Inputs = Callable[[Settings, int, torch.device, bool], tuple[Callable[[], torch.Tensor], list]]


def _sdpa(settings: Settings, length: int, device: torch.device, grad: bool):
    """SDPA; on CUDA in 16 bits only when PyTorch runs it with FlashAttention, what the rows beside it are read
    against (asked, not forced: forcing it costs every call a context manager's host time)."""
    q, k, v = _qkv(settings, (settings.batch, settings.heads, length, settings.head_dim), device, grad)
    if device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and hasattr(torch, "_fused_sdp_choice"):
        backend = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True))  # what the call below runs
        if backend != SDPBackend.FLASH_ATTENTION:
            raise Skipped(f"SDPA would run {backend.name}, not FLASH_ATTENTION")
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v]


def _lavo(settings: Settings, length: int, device: torch.device, grad: bool):
    s = settings
    q, k, v = _qkv(s, (s.batch, length, s.heads, s.head_dim), device, grad)
    basis = orthogonal_basis(s.heads, s.rank, s.head_dim, device=device)
    pos_bias = torch.zeros(s.heads, 2 * s.window, device=device, requires_grad=grad)
    return (lambda: lavo_attention(q, k, v, basis, window=s.window, causal=True, pos_bias=pos_bias,
                                   backend=s.backend),
            [q, k, v, pos_bias])


def _fla_op(module: str, name: str):
    """The op ``name`` of the ``fla`` package (flash-linear-attention, ``fla-core``); Skipped without it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise Skipped(f"{module}.{name} is not importable ({type(error).__name__}: {error})") from None


def _fla_window(settings: Settings, length: int, device: torch.device, grad: bool):
    """fla's causal sliding-window softmax attention over the last ``--window`` keys (Triton): an anchor for
    LAVO's local branch, which sees from ``w + 1`` to ``2w`` keys (from the start of the previous window)."""
    attend = _fla_op("fla.ops.attn", "parallel_attn")
    q, k, v = _qkv(settings, (settings.batch, length, settings.heads, settings.head_dim), device, grad)
    return lambda: attend(q, k, v, window_size=settings.window), [q, k, v]


def _fla_linear(settings: Settings, length: int, device: torch.device, grad: bool):
    """fla's chunked causal linear attention (no normaliser): an anchor for a memory read of linear cost."""
    attend = _fla_op("fla.ops.linear_attn", "chunk_linear_attn")
    q, k, v = _qkv(settings, (settings.batch, length, settings.heads, settings.head_dim), device, grad)
    return lambda: attend(q, k, v, normalize=False)[0], [q, k, v]


def _qkv(settings: Settings, shape: tuple, device: torch.device, grad: bool) -> list[torch.Tensor]:
    return [torch.randn(shape, device=device).to(settings.torch_dtype).requires_grad_(grad) for _ in range(3)]


@dataclass(frozen=True)
class RawOp:
    """An op measured on ``q, k, v`` directly (inputs in ``--dtype``, no projections)."""
    label: str
    time_complexity: str
    inputs: Inputs  # (settings, length, device, grad) -> (the call, the tensors whose gradients it makes)


OPS = {"lavo_attention": RawOp("lavo_attention (op)", "linear", _lavo),
       "sdpa": RawOp("sdpa (op)", "quadratic", _sdpa),
       "fla_window": RawOp("fla sliding window (op)", "linear", _fla_window),
       "fla_linear": RawOp("fla chunk linear (op)", "linear", _fla_linear)}
DEFAULT_OPS = ["lavo_attention", "sdpa"]  # the fla anchors need a GPU and the fla package
BY_LABEL = {op.label: op for op in OPS.values()}
SDPA = OPS["sdpa"].label  # the reference: the softmax attention PyTorch makes as fast as it can


def time_complexity(name: str) -> str:
    """How the time of a raw op (by its label) or a registered mechanism grows with the sequence length."""
    return BY_LABEL[name].time_complexity if name in BY_LABEL else attention_class(name).time_complexity


def plan(settings: Settings) -> list[tuple[str, str, int]]:
    """(mechanism or op label, pass, length) in run order: length by length, so a run cut short has measured
    every mechanism at the shorter lengths; SDPA first at each length, so ratios can be taken."""
    names = [OPS[op].label for op in settings.ops] + list(settings.attentions)
    names.sort(key=lambda name: name != SDPA)
    return [(name, which, length) for length in settings.lengths for name in names
            if time_complexity(name) == "linear" or length <= settings.max_quadratic_length
            for which in settings.passes]


def planned(settings: Settings) -> int:
    return len(plan(settings))


def attention_call(name: str, settings: Settings, length: int, which: str, runner: Runner) -> Callable[[], Any]:
    """A no-argument function running one forward (``fwd``, under no_grad) or forward + backward of ``name``."""
    device, grad = runner.device, which == "fwd+bwd"
    if name in BY_LABEL:
        forward, leaves = BY_LABEL[name].inputs(settings, length, device, grad)
    else:
        options = mechanism_options(name, settings, max(settings.lengths))
        layer = build_attention(name, settings.dim, settings.heads, causal=True, **options).to(device)
        x = torch.randn(settings.batch, length, settings.dim, device=device, requires_grad=grad)
        leaves = [x, *layer.parameters()]

        def forward():
            with runner.autocast():
                return layer(x)[0]
    if not grad:
        def call():
            with torch.no_grad():
                forward()
        return call
    grads: dict[torch.dtype, torch.Tensor] = {}

    def step():
        y = forward()
        if y.dtype not in grads:
            grads[y.dtype] = torch.randn(y.shape, device=device).to(y.dtype)
        y.backward(grads[y.dtype])
        # Dropped at the end, not the start: a measured call's peak then includes the gradients it makes, and no
        # earlier call's gradients are freed inside it to make room.
        for leaf in leaves:
            leaf.grad = None
    return step


def run(runner: Runner) -> None:
    s = runner.settings
    ratios = Ratios(SDPA)
    for name, which, length in plan(s):
        level = "op" if name in BY_LABEL else "layer"
        entry = record("attention", level, name, which, length, s, heads=s.heads, head_dim=s.head_dim)

        def work(entry, name=name, which=which, length=length):
            fill(entry, runner.measure(attention_call(name, s, length, which, runner)))

        runner.run(entry, ("attention", name, which), time_complexity(name), work)
        ratios.add(entry, (which, length))
