"""The ``decode`` section: per-token step time and cache bytes against the context length, for causal layers
with a decoding form, each as a ratio to softmax's step at the same context."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from ..layers.softmax import SoftmaxAttention
from ..ops.rotary import apply_rotary
from ..registry import build_attention
from .measure import sync
from .runner import Ratios, Runner, fill, record
from .settings import Settings, mechanism_options


def tensor_nbytes(obj: Any) -> int:
    """Bytes of every tensor reachable from ``obj`` through dataclasses, named tuples, tuples, lists, sets and
    dict values; each tensor object counts once (a tensor referenced twice is stored once). Other objects (ints,
    None, strings) count zero."""
    seen: set[int] = set()

    def walk(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return 0
            seen.add(id(x))
            return x.numel() * x.element_size()
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return sum(walk(getattr(x, f.name)) for f in dataclasses.fields(x))
        if isinstance(x, (tuple, list, set, frozenset)):
            return sum(walk(item) for item in x)
        if isinstance(x, dict):
            return sum(walk(item) for item in x.values())
        return 0

    return walk(obj)


def prefill(layer, x: torch.Tensor, settings: Settings):
    """The cache after the context ``x``, without grad. A softmax layer's key/value cache is filled directly past
    ``--max-quadratic-length`` (same contents, without computing the quadratic attention): returns (cache,
    whether the layer really ran)."""
    with torch.no_grad():
        if isinstance(layer, SoftmaxAttention) and x.shape[1] > settings.max_quadratic_length:
            _, k, v = layer.to_qkv(x).view(*x.shape[:2], 3, layer.heads, layer.head_dim).unbind(2)
            if layer.rotary:
                k = apply_rotary(k, 0)
            return layer.empty_cache(x.shape[0], x.device).append(k, v, None), False
        return layer(x)[1], True


def planned(settings: Settings) -> int:
    return len(settings.decode_attentions) * len(settings.decode_lengths)


def run(runner: Runner) -> None:
    s, device = runner.settings, runner.device
    ratios = Ratios("softmax")
    names = sorted(s.decode_attentions, key=lambda name: name != "softmax")
    for name in names:
        for length in s.decode_lengths:
            entry = record("decode", "layer", name, "decode_step", length, s, steps=s.decode_steps,
                           cache_bytes=None, prefill_ms=None)

            def work(entry, name=name, length=length):
                options = mechanism_options(name, s, max(s.decode_lengths) + s.decode_steps + s.warmup + 2)
                layer = build_attention(name, s.dim, s.heads, causal=True, **options).to(device).eval()
                if not getattr(layer, "supports_decoding", False):
                    raise ValueError(f"{name} has no decoding form")
                context = torch.randn(s.batch, length, s.dim, device=device)
                with runner.autocast():
                    start = time.perf_counter()
                    cache, ran = prefill(layer, context, s)
                    sync(device)
                    if ran:
                        entry["prefill_ms"] = (time.perf_counter() - start) * 1e3
                    else:
                        entry["note"] = "cache filled directly (context past --max-quadratic-length)"
                if cache is None:
                    raise ValueError(f"{name} returned no cache")
                entry["cache_bytes"] = tensor_nbytes(cache)
                token = torch.randn(s.batch, 1, s.dim, device=device)
                state = {"cache": cache}

                def step():
                    with torch.no_grad(), runner.autocast():
                        state["cache"] = layer(token, cache=state["cache"])[1]
                fill(entry, runner.measure(step, repeats=s.decode_steps))

            # A step's time grows with the cache, at most linearly in the context.
            runner.run(entry, ("decode", name), "linear", work)
            ratios.add(entry, length)
