"""Sampling from a trained model: the prompt in one forward pass, then one token at a time through the cache
(constant size for LAVO, a growing key/value cache for softmax). On CUDA, when every layer's cache has a fixed
layout (:meth:`~lavo.model.LanguageModel.step_cache`), the one-token step is captured once as a CUDA graph and
replayed for every token (:class:`StepDecoder`)."""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .layers.base import position_bound
from .ops.common import launching_on
from .report import counted
from .settings import SEED, at_least, between, check_settings, setting


@dataclass
class SamplingSettings:
    """How :func:`generate` samples (``lavo generate`` flags)."""

    max_new_tokens: int = setting(200, at_least(1))
    temperature: float = setting(0.8, at_least(0))  # 0: greedy
    top_k: int | None = setting(50, at_least(0))  # 0 or None: no top-k filter
    top_p: float | None = setting(0.95, between(0, 1, low_open=True))  # 1 or None: no top-p filter
    seed: int = setting(0, SEED)
    num_samples: int = setting(1, at_least(1))

    def __post_init__(self):
        check_settings(self, "sampling")


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the ``top_k`` largest and outside the smallest set of mass ``top_p``."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the most likely token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, generator: torch.Generator, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """``logits [B, V]`` -> next ids ``[B]``; ``temperature == 0`` is greedy. Logits that are not finite are
    refused: greedy search would take an arbitrary token from them, sampling would fail in ``multinomial``."""
    logits = logits.float()
    if not torch.isfinite(logits).all():
        raise ValueError("the model's logits are not finite (nan or inf): its weights may have diverged in "
                         "training, or overflowed in a lower precision")
    if temperature == 0:
        return logits.argmax(-1)
    # shifted so the largest logit is 0, and divided in float64: a tiny temperature then sends the others to
    # -inf, never one to +inf (nor 0 to 0 / 0, as a temperature below float32's range would in float32)
    logits = (logits - logits.amax(-1, keepdim=True)).double()
    logits = filter_logits(logits / temperature, top_k, top_p)
    probs = logits.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def capture_graph(fn: Callable[[], Any], state: list[torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` (CUDA work only, on the current device, updating ``state`` in place) recorded as a CUDA graph, and
    its output (buffers each replay rewrites). One call on a side stream first compiles and allocates what ``fn``
    needs (recording cannot); its effect on ``state`` is undone before recording, which runs nothing."""
    saved = [t.clone() for t in state]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    for t, before in zip(state, saved):
        t.copy_(before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output


class StepDecoder:
    r"""The model's one-token step on fixed-layout caches, from static buffers: the token ids are copied into
    ``ids [B, 1]``, the step writes ``logits [B, 1, vocab]`` and updates the caches and the position in place.
    With ``capture`` (CUDA only) the step is recorded once as a CUDA graph (:func:`capture_graph`) and each
    :meth:`step` replays it: one launch per token instead of dozens per layer. Without, :meth:`step` runs the same
    code eagerly. A generation captures once, for its batch size and the model's dtype.
    """

    def __init__(self, model, cache, capture: bool):
        self.model, self.cache = model, cache  # cache: from model.step_cache
        device = cache.tensors()[0].device
        self.ids = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=device)
        self.position = torch.tensor(cache.position, device=device)
        self.graph = None
        if capture:
            with launching_on(self.ids):  # the cache's GPU, which need not be the current one
                self.graph, self.logits = capture_graph(self._run, self.state())

    def _run(self) -> torch.Tensor:
        logits = self.model.decode_step(self.ids, self.position, self.cache)
        self.position.add_(1)
        return logits

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, 1]`` -> ``logits [B, 1, vocab]`` (with a graph: its output buffer, overwritten next step)."""
        self.ids.copy_(ids)
        if self.graph is None:
            logits = self._run()
        else:
            with launching_on(self.ids):
                self.graph.replay()
            logits = self.logits
        return logits

    def state(self) -> list[torch.Tensor]:
        """What a step updates in place: the caches' tensors and the position."""
        return self.cache.tensors() + [self.position]


def graphed_decoder(model, cache) -> StepDecoder | None:
    """A :class:`StepDecoder` with its CUDA graph for continuing ``cache`` (a model's cache, left as it is), or
    None: off CUDA, when some layer's cache has no fixed layout, or (with a warning) when the step cannot be
    recorded, e.g. because some op of it synchronises with the host; generation then steps through ``cache``."""
    if cache is None or not cache.tensors()[0].is_cuda:
        return None
    fixed = model.step_cache(cache)
    if fixed is None:
        return None
    try:
        return StepDecoder(model, fixed, capture=True)
    except RuntimeError as error:
        warnings.warn(f"decoding without a CUDA graph: the step could not be recorded ({error})", stacklevel=2)
        return None


def check_prompt(model, prompt: list[int] | torch.Tensor, max_new_tokens: int) -> list[int]:
    """``prompt`` as a list of ids, refused by name when it is empty, holds an id the model has no embedding for,
    or is too long, with the tokens to come, for the positions the model reads
    (:func:`~lavo.layers.base.position_bound`)."""
    if isinstance(prompt, torch.Tensor) and prompt.dim() > 1:  # e.g. [1, T], as a model's input_ids
        raise ValueError(f"the prompt must be a flat list (or 1-D tensor) of token ids, got a tensor of shape "
                         f"{tuple(prompt.shape)}: give one prompt, e.g. prompt[0] (num_samples samples it "
                         "several times)")
    try:
        ids = [operator.index(i) for i in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
    except TypeError:
        raise ValueError("the prompt must be a flat list (or 1-D tensor) of token ids") from None
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab_size is not None and not all(0 <= i < vocab_size for i in ids):
        outside = sorted({i for i in ids if not 0 <= i < vocab_size})
        raise ValueError(f"the prompt holds token ids outside the model's vocabulary of {vocab_size}: {outside[:5]}")
    check_room(model, len(ids), max_new_tokens)
    return ids


def check_room(model, prompt_length: int, new_tokens: int) -> None:
    """Refuse, before anything is generated, a prompt and new tokens that need more positions than a layer of
    ``model`` reads (:func:`~lavo.layers.base.position_bound`); the last new token is never fed."""
    bound = position_bound(model)
    if bound is None or prompt_length + new_tokens - 1 <= bound.limit:
        return
    reads = f"this model reads at most {bound.limit} positions (its {bound.layer})"
    if prompt_length > bound.limit:  # no number of new tokens fits: only a shorter prompt helps
        raise ValueError(f"{reads}: a {prompt_length}-token prompt is longer than that, so nothing can follow it; "
                         f"give at most {bound.limit} tokens of prompt")
    raise ValueError(f"{reads}: after a {prompt_length}-token prompt it can generate at most "
                     f"{counted(bound.limit - prompt_length + 1, 'token')}, not {new_tokens}")


@torch.no_grad()
def generate(model, prompt: list[int] | torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, stop_id: int | None = None,
             num_samples: int = 1, device: torch.device | str | None = None,
             on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """``num_samples`` continuations of ``prompt`` (token ids), each at most ``max_new_tokens`` long (a sample that
    reaches ``stop_id`` ends with it). ``device``: where the prompt goes, by default the model's. ``on_token(sample,
    token)`` is called for each token as it is sampled, in order, e.g. to print a long sample as it grows. The
    model samples in eval mode and is left in the mode it was in."""
    settings = SamplingSettings(max_new_tokens, temperature, top_k, top_p, seed, num_samples)  # checks them
    prompt = check_prompt(model, prompt, max_new_tokens)
    if device is None:
        device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        return _sample(model, prompt, settings, stop_id, device, on_token)
    finally:
        model.train(training)


def _sample(model, prompt: list[int], s: SamplingSettings, stop_id: int | None, device,
            on_token: Callable[[int, int], None] | None) -> list[list[int]]:
    generator = torch.Generator().manual_seed(s.seed)
    use_cache = getattr(model, "supports_decoding", False)
    # The prompt is read once, however many samples: its rows would all be the same. Then each sample gets a row.
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    logits, cache = model(ids)
    rows = torch.zeros(s.num_samples, dtype=torch.long, device=device)
    ids, logits = ids[rows], logits[:, -1:][rows]
    if cache is not None:
        cache = cache.select(rows)
    decoder = graphed_decoder(model, cache) if use_cache else None
    out = [[] for _ in range(s.num_samples)]
    done = torch.zeros(s.num_samples, dtype=torch.bool)
    for step in range(s.max_new_tokens):
        next_ids = sample_next(logits[:, -1], generator, s.temperature, s.top_k, s.top_p)
        for i, token in enumerate(next_ids.tolist()):
            if not done[i]:
                out[i].append(token)
                done[i] = stop_id is not None and token == stop_id
                if on_token is not None:
                    on_token(i, token)
        if done.all() or step == s.max_new_tokens - 1:  # the last token is not fed: nothing reads its logits
            break
        if decoder is not None:
            logits = decoder.step(next_ids[:, None])
        elif use_cache:
            logits, cache = model(next_ids[:, None], cache=cache)
        else:  # no decoding form: run the whole sequence again
            ids = torch.cat([ids, next_ids[:, None]], 1)
            logits, _ = model(ids)
    return out
