"""A GPT-style decoder whose attention is any mechanism of the registry.

token embedding (+ sinusoidal positions) -> depth x [LayerNorm -> attention -> residual; LayerNorm -> MLP ->
residual] -> LayerNorm -> logits through the (tied) embedding matrix.

``forward(ids, padding_mask=None, cache=None) -> (logits, cache)``: the returned :class:`ModelCache` holds every
layer's cache and the absolute position, so a sequence can be continued in any chunking (decoding, or scoring a
long text piece by piece).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .cache import Cache, check_kind
from .layers.base import Mechanism, check_returned_cache, reset_initialised
from .registry import attention_class, available_attentions, build_attention, check_options
from .settings import above, at_least, between, check_known, check_settings, one_of, setting

POSITIONS = ("none", "sinusoidal", "rope")


@dataclass
class ModelConfig:
    """The settings of a :class:`LanguageModel` (the ``model`` section of a run config), checked when built:
    ``attention`` is a registered mechanism's name and ``attention_options`` its keyword options; ``position``
    ``"none"``, ``"sinusoidal"`` (added to the embeddings) or ``"rope"`` (``rotary=True`` to the attention); the
    MLP's hidden size is ``mlp_ratio * dim``; linear and embedding weights are drawn from ``Normal(0, init_std)``
    (:func:`initialise`)."""

    vocab_size: int = setting(4096, at_least(2))
    dim: int = setting(256, at_least(1))
    depth: int = setting(4, at_least(1))
    heads: int = setting(4, at_least(1))
    attention: str = "lavo"
    attention_options: dict = setting(factory=dict)
    # "none" | "sinusoidal" (added to the embeddings) | "rope" (rotary=True to attention)
    position: str = setting("none", one_of(*POSITIONS))
    mlp_ratio: int = setting(4, at_least(1))
    dropout: float = setting(0.0, between(0, 1, high_open=True))
    init_std: float = setting(0.02, above(0))

    def __post_init__(self):
        check_settings(self, "model")
        if self.dim % self.heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.heads ({self.heads})")
        if self.position == "sinusoidal" and self.dim % 2:
            raise ValueError(f"sinusoidal positions need an even model.dim, got {self.dim}")
        check_options(self.attention, self.attention_options)
        if self.position == "rope" and not attention_class(self.attention).accepts_rotary:
            rotary = [name for name in available_attentions() if attention_class(name).accepts_rotary]
            raise ValueError(f"position='rope' rotates queries and keys inside the attention, and "
                             f"{self.attention!r} does not take rotary positions (those that do: "
                             f"{', '.join(rotary)}); use position='none' or 'sinusoidal'")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        check_known(cls, values, "model")
        return cls(**values)


PRESETS: dict[str, dict] = {
    # about 2.6M parameters with a 4096-token vocabulary: trains in minutes on two CPU cores
    "tiny": dict(dim=192, depth=4, heads=4),
    # about 27M parameters with a 4096-token vocabulary (51M with GPT-2's)
    "small": dict(dim=512, depth=8, heads=8),
}


def model_config(preset: str | None = None, **overrides) -> ModelConfig:
    """A preset's settings with ``overrides`` on top (any field)."""
    values: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        values.update(PRESETS[preset])
    values.update(overrides)
    return ModelConfig.from_dict(values)


def sinusoidal_positions(start: int, length: int, dim: int, device=None) -> torch.Tensor:
    """``[length, dim]`` sine/cosine features of positions ``start .. start + length - 1`` (``start``: an int or a
    0-d tensor)."""
    position = (start + torch.arange(length, device=device))[:, None].to(torch.float32)
    frequency = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    angle = position * frequency
    return torch.stack([angle.sin(), angle.cos()], -1).flatten(1)[:, :dim]  # an odd dim drops the last cosine


def feed_forward(dim: int, hidden: int) -> nn.Sequential:
    """The blocks' MLP: ``dim -> hidden -> dim`` with a GELU between."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


@dataclass(frozen=True)
class ModelCache(Cache):
    """Decoding state of the whole model: one cache per layer and the number of positions consumed."""

    layers: tuple
    position: int


def add_positions(x: torch.Tensor, config: ModelConfig, start: int | torch.Tensor = 0) -> torch.Tensor:
    """``x [B, T, dim]`` plus the sinusoidal features of positions ``start ..`` when ``config.position`` asks for
    them (otherwise ``x`` unchanged)."""
    if config.position != "sinusoidal":
        return x
    # scaled to the token embeddings' size at initialisation (RMS init_std); at amplitude 1 they were ~35x
    # larger and swamped the tokens (a small model stayed at the unigram loss)
    scale = config.init_std * math.sqrt(2)
    return x + scale * sinusoidal_positions(start, x.shape[1], config.dim, x.device).to(x.dtype)


class Block(nn.Module):
    """LayerNorm -> attention -> residual; LayerNorm -> MLP -> residual. ``causal=False`` builds the attention's
    non-causal form (an encoder)."""

    def __init__(self, config: ModelConfig, causal: bool = True):
        super().__init__()
        options = dict(config.attention_options)
        if config.position == "rope":
            options["rotary"] = True
        self.norm1 = nn.LayerNorm(config.dim)
        self.attention = build_attention(config.attention, config.dim, config.heads, causal=causal, **options)
        self.norm2 = nn.LayerNorm(config.dim)
        hidden = config.mlp_ratio * config.dim
        self.mlp = feed_forward(config.dim, hidden)
        self.dropout = nn.Dropout(config.dropout)
        # how a call runs the block so that backward recomputes its activations (set by
        # LanguageModel.set_activation_checkpointing); None: they are kept from the forward pass
        self.checkpoint_function: Callable | None = None

    def residual_weights(self) -> list[nn.Parameter]:
        return self.attention.residual_weights() + [self.mlp[2].weight]

    def forward(self, x, padding_mask=None, cache=None):
        # Not with a cache: a step cache is updated in place, and the recomputation would update it again.
        if self.checkpoint_function is not None and torch.is_grad_enabled() and cache is None:
            return self.checkpoint_function(self._forward, x, padding_mask)
        return self._forward(x, padding_mask, cache)

    def _forward(self, x, padding_mask=None, cache=None):
        y, cache = self.attention(self.norm1(x), padding_mask=padding_mask, cache=cache)
        check_returned_cache(self.attention, cache)
        x = x + self.dropout(y)
        x = x + self.dropout(self.mlp(self.norm2(x)))
        return x, cache


def initialise(model: nn.Module, blocks: nn.ModuleList, config: ModelConfig) -> None:
    """Normal(0, init_std) linear and embedding weights, zero biases; GPT-2's scaling of the projections that
    write into the residual stream by 1/sqrt(2 depth)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for block in blocks:
        for weight in block.residual_weights():
            nn.init.normal_(weight, 0.0, config.init_std / math.sqrt(2 * config.depth))


def parameter_groups(model: nn.Module, weight_decay: float, lr: float) -> list[dict]:
    """Optimizer groups: weight decay on matrices, none on vectors and on what the mechanisms exclude, and
    the peak learning rate ``lr`` except where a mechanism caps it. Each group's ``lr_scale`` is its peak
    rate over ``lr``: a schedule sets every group's rate to ``lr_scale`` times the scheduled rate."""
    mechanisms = [module for module in model.modules() if isinstance(module, Mechanism)]
    excluded = {id(p) for module in mechanisms for p in module.no_weight_decay()}
    scale = {id(p): min(1.0, cap / lr) for module in mechanisms
             for parameters, cap in module.learning_rate_caps() for p in parameters}
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for p in model.parameters():
        decay = weight_decay if p.dim() >= 2 and id(p) not in excluded else 0.0
        groups.setdefault((decay, scale.get(id(p), 1.0)), []).append(p)
    return [{"params": params, "weight_decay": decay, "lr": lr * lr_scale, "lr_scale": lr_scale}
            for (decay, lr_scale), params in groups.items()]


def set_learning_rate(optimizer: torch.optim.Optimizer, rate: float) -> None:
    """Set each group of :func:`parameter_groups` to ``lr_scale`` times the scheduled ``rate``."""
    for group in optimizer.param_groups:
        group["lr"] = rate * group.get("lr_scale", 1.0)  # an optimiser state saved without scales has none


class LanguageModel(nn.Module):
    r"""The causal decoder of this module's description, built from a :class:`ModelConfig`:
    ``forward(ids [B, T], padding_mask [B, T] | None, cache | None) -> (logits [B, T, vocab], cache)``, where the
    :class:`ModelCache` returned continues the sequence (None when a layer has no decoding form)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.dim)
        initialise(self, self.blocks, config)

    def reset_parameters(self) -> None:
        """Initialise every weight and buffer again as construction does, with fresh draws: for a model built on
        the meta device (``with torch.device("meta")``), after ``to_empty(device=...)``."""
        reset_initialised(self)  # every submodule once, the mechanisms whole
        initialise(self, self.blocks, self.config)

    @property
    def supports_decoding(self) -> bool:
        """Whether every layer can continue a sequence from a cache."""
        return all(b.attention.supports_decoding for b in self.blocks)

    def parameter_groups(self, weight_decay: float, lr: float) -> list[dict]:
        return parameter_groups(self, weight_decay, lr)

    def set_activation_checkpointing(self, enable: bool = True, *, every: int = 1,
                                     function: Callable | None = None) -> None:
        """Whether backward recomputes the activations of every ``every``-th block (the first included) instead
        of keeping them from the forward pass: such a block keeps only its input, for one more forward pass of
        compute. Gradients are unchanged (dropout masks are replayed). Calls without gradients, and calls that
        continue from a cache, run as usual. ``function(forward, x, padding_mask)`` runs a block's forward so
        (default: :func:`torch.utils.checkpoint.checkpoint`, non-reentrant)."""
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        function = function or partial(checkpoint, use_reentrant=False)
        for i, block in enumerate(self.blocks):
            block.checkpoint_function = function if enable and i % every == 0 else None

    def forward(self, ids: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache: ModelCache | None = None) -> tuple[torch.Tensor, ModelCache | None]:
        """``ids [B, T]`` -> ``logits [B, T, vocab]`` and the cache that continues the sequence.

        The cache is None when some layer has no decoding form.
        """
        if ids.dim() != 2:
            raise ValueError(f"ids must have shape [B, T], got {tuple(ids.shape)}")
        if cache is not None:
            self.check_cache(cache)
        start = 0 if cache is None else cache.position
        logits, layer_caches = self._run(ids, padding_mask, None if cache is None else cache.layers, start)
        if any(c is None for c in layer_caches):
            return logits, None
        return logits, ModelCache(tuple(layer_caches), start + ids.shape[1])

    def check_cache(self, cache: Any) -> None:
        """Refuse what is not a cache this model returned: a layer's cache, or a model's of another depth (whose
        extra layers' caches would be dropped without a word, or a missing one fail with an ``IndexError``)."""
        check_kind(cache, ModelCache, type(self).__name__, "pass the cache this model's previous call returned")
        if len(cache.layers) != len(self.blocks):
            raise ValueError(f"the cache holds the caches of {len(cache.layers)} layers, and this model has "
                             f"{len(self.blocks)}: pass the cache this model's previous call returned")

    def _run(self, ids: torch.Tensor, padding_mask: torch.Tensor | None, caches: tuple | None,
             start: int | torch.Tensor) -> tuple[torch.Tensor, list]:
        """The logits of ``ids`` at positions from ``start`` (an int, or a 0-d tensor for a CUDA graph) on, and
        each layer's cache."""
        x = self.dropout(add_positions(self.embed(ids), self.config, start))
        layer_caches = []
        for i, block in enumerate(self.blocks):
            x, layer_cache = block(x, padding_mask=padding_mask, cache=None if caches is None else caches[i])
            layer_caches.append(layer_cache)
        return F.linear(self.norm(x), self.embed.weight), layer_caches

    def step_cache(self, cache: ModelCache) -> ModelCache | None:
        """``cache`` with every layer's cache in the fixed layout a one-token step updates in place
        (:meth:`~lavo.layers.base.Mechanism.step_cache`), or None when a layer has none."""
        if not all(block.attention.has_step_layout for block in self.blocks):
            return None
        layers = [block.attention.step_cache(layer) for block, layer in zip(self.blocks, cache.layers)]
        return ModelCache(tuple(layers), cache.position)

    def decode_step(self, ids: torch.Tensor, position: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """``ids [B, 1]`` at ``position`` (a 0-d tensor) -> ``logits [B, 1, vocab]``, updating ``cache`` (from
        :meth:`step_cache`) in place. Reads nothing from the host, so a CUDA graph can capture it."""
        return self._run(ids, None, cache.layers, position)[0]


def count_parameters(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Trainable parameters (tied weights counted once), optionally without the token embedding."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if exclude_embedding and name == "embed.weight":
            continue
        total += p.numel()
    return total


def build_model(config: ModelConfig | dict) -> LanguageModel:
    """A :class:`LanguageModel` of ``config``, or of a dict of its fields (checked as ``ModelConfig.from_dict``
    checks them), with freshly drawn weights."""
    return LanguageModel(config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config))
