"""The ``decode`` section: per-token step time and cache bytes against the context length, for causal layers
with a decoding form, each as a ratio to the step of the quadratic mechanism (softmax, whose cache is every key
and value) at the same context.

A layer whose cache has a fixed layout (:meth:`~lavo.layers.base.Mechanism.step_cache`: LAVO's paper memory) is
measured in three forms: ``name`` steps through the cache it returns, ``name (step)`` through its fixed-layout
cache (with ``--backend``: LAVO's fused step kernel for ``triton``), and on CUDA ``name (graph)`` replays a CUDA
graph of that step."""
from __future__ import annotations

import time

import torch

from ..cache import KVCache
from ..generate import capture_graph
from ..layers.base import Mechanism
from ..ops.softmax import apply_rotary
from ..registry import attention_class, build_attention
from .measure import MIB, Skipped, available_mib, sync
from .runner import Ratios, Runner, fill, record
from .settings import Settings, full_attention, mechanism_options


def prefill(layer, x: torch.Tensor, settings: Settings):
    """The cache after the context ``x``, without grad; returns (cache, whether the layer really ran).

    A quadratic layer keeps every key and value (a :class:`~lavo.cache.KVCache`): past
    ``--max-quadratic-length`` its cache is filled directly from its projections (same contents, without
    computing the quadratic attention)."""
    with torch.no_grad():
        if layer.time_complexity == "quadratic" and x.shape[1] > settings.max_quadratic_length:
            _, k, v = layer.to_qkv(x).view(*x.shape[:2], 3, layer.heads, layer.head_dim).unbind(2)
            if layer.accepts_rotary and layer.rotary:
                k = apply_rotary(k, 0)
            # in the keys' dtype (bfloat16 under autocast), as the layer's own forward keeps them
            cache = layer.empty_cache(x.shape[0], device=x.device, dtype=k.dtype)
            if not isinstance(cache, KVCache):
                raise ValueError(f"a context past --max-quadratic-length fills only a KVCache directly, "
                                 f"not {type(cache).__name__}")
            return cache.append(k, v, None), False
        return layer(x)[1], True


def forms(name: str, device: torch.device) -> list[str]:
    """How ``name``'s decoding is measured on ``device``: through its cache, and through a fixed-layout one when
    it has it (also from a CUDA graph on CUDA)."""
    if attention_class(name)._step_cache is Mechanism._step_cache:
        return ["cache"]
    return ["cache", "step", "graph"] if device.type == "cuda" else ["cache", "step"]


def label(name: str, form: str) -> str:
    return name if form == "cache" else f"{name} ({form})"


def planned(settings: Settings) -> int:
    device = torch.device(settings.device)
    return sum(len(forms(name, device)) for name in settings.decode_attentions) * len(settings.decode_lengths)


def run(runner: Runner) -> None:
    s = runner.settings
    names = sorted(s.decode_attentions, key=lambda name: not full_attention(name))
    ratios = Ratios(names[0] if names and full_attention(names[0]) else None)
    for name in names:
        for form in forms(name, runner.device):
            for length in s.decode_lengths:
                entry = record("decode", "layer", label(name, form), "decode_step", length, s, steps=s.decode_steps,
                               cache_bytes=None, cache_bound_bytes=None, prefill_ms=None)
                # A step's time grows with the cache, at most linearly in the context.
                runner.run(entry, ("decode", name, form), "linear",
                           lambda entry, name=name, form=form, length=length: _measure(runner, entry, name, form,
                                                                                       length))
                if form != "graph":  # a replayed graph against softmax's eager step would time the launches
                    ratios.add(entry, length)


def _measure(runner: Runner, entry: dict, name: str, form: str, length: int) -> None:
    s, device = runner.settings, runner.device
    options = mechanism_options(name, s, max(s.decode_lengths) + s.decode_steps + s.warmup + 2)
    layer = build_attention(name, s.dim, s.heads, causal=True, **options).to(device).eval()
    bound = entry["cache_bound_bytes"] = layer.cache_nbytes(s.batch, length, s.torch_dtype)
    available = available_mib(device)
    if available is not None and bound / MIB > 0.8 * available:
        raise Skipped(f"the cache's {bound / MIB:.0f} MiB > 80% of the {available:.0f} MiB available")
    context = torch.randn(s.batch, length, s.dim, device=device)
    with runner.autocast():
        start = time.perf_counter()
        cache, ran = prefill(layer, context, s)
        sync(device)
        if ran:
            entry["prefill_ms"] = (time.perf_counter() - start) * 1e3
        else:
            entry["note"] = "cache filled directly (context past --max-quadratic-length)"
    if form != "cache":
        if not layer.has_step_layout:
            raise Skipped("this layer's cache has no fixed layout (a memory variant)")
        cache = layer.step_cache(cache)
    entry["cache_bytes"] = cache.nbytes()
    token = torch.randn(s.batch, 1, s.dim, device=device)
    state = {"cache": cache}

    def step():
        with torch.no_grad(), runner.autocast():
            state["cache"] = layer(token, cache=state["cache"])[1]
    if form == "graph":
        step = capture_graph(step, cache.tensors())[0].replay
    fill(entry, runner.measure(step, repeats=s.decode_steps))
