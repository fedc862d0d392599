"""What every registered layer declares and shares.

:class:`Mechanism` is the contract generic code (the model, training, the benchmark) talks to: what the layer
can do (causal, non-causal, decoding, rotary positions), what it costs (time complexity, cache bytes), which of
its parameters must not be weight-decayed and which write into the residual stream. Generic code asks these
questions instead of matching mechanism or parameter names.

:class:`AttentionLayer` adds what the attention mechanisms share: the q/k/v and output projections and the
head split.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import torch
from einops import rearrange
from torch import nn
from torch.nn.utils import parametrize

from ..cache import Cache, check_kind
from ..ops.common import check_padding_mask, check_switches, dtypes_may_differ, positive_int


def check_heads(dim: int, heads: int) -> int:
    """Validate the head split and return the head dimension."""
    if not (positive_int(dim) and positive_int(heads)):
        raise ValueError(f"dim and heads must be positive integers, got dim={dim!r}, heads={heads!r}")
    if dim % heads:
        raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
    return dim // heads


def zero_padded(y: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """``y [B, T, dim]`` with zeros at the padded positions: every mechanism outputs zeros there, as LAVO does
    (docs/DESIGN.md, decision 2), whatever its op leaves at a padded query."""
    return y if padding_mask is None else y.masked_fill(~padding_mask[..., None], 0)


def leading_padding(padding_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: how many padded positions come before each row's first real token (``T`` for a row of padding
    only)."""
    return (padding_mask.cumsum(1) == 0).sum(1)


def roll_rows(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``x [B, T, ...]`` with each row ``b`` rolled back along the time axis by ``shift[b]``: position ``t`` takes
    what was at ``(t + shift[b]) mod T``."""
    B, T = x.shape[:2]
    index = (torch.arange(T, device=x.device) + shift[:, None]) % T
    return x.gather(1, index.view(B, T, *[1] * (x.dim() - 2)).expand_as(x))


def first_parameter(module: nn.Module) -> nn.Parameter | None:
    """The module's first parameter, for its device and dtype; None in a replica made by ``nn.DataParallel``,
    which holds none."""
    return next(module.parameters(), None)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def keyword_options(cls: type, *internal: str) -> dict[str, Any]:
    """The keyword-only parameters of ``cls``'s constructor but ``internal``, with their defaults."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY and p.name not in internal}


def scaled_normal(*shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape) * std


def add_initialised(module: nn.Module, name: str, make: Callable[[], torch.Tensor], *, buffer: bool = False) -> None:
    """Give ``module.<name>`` the tensor ``make()`` makes, as a parameter (or a buffer), and keep ``make`` so that
    :func:`reset_initialised` makes it again: what a module owns beyond its submodules is initialised in one place,
    for construction and for a model built on the meta device and then materialised with ``to_empty()``. ``make``
    is a ``functools.partial`` of a module-level function, so that the module still pickles (unless torch's
    parametrizations, which do not pickle, are on it: LAVO's learned basis)."""
    value = make()
    if buffer:
        module.register_buffer(name, value)
    else:
        setattr(module, name, nn.Parameter(value))
    if "_initialisers" not in module.__dict__:
        module._initialisers = {}
    # and how many submodules were made before it, so that a reset draws in the order construction did
    module._initialisers[name] = (make, len(module._modules))


def reset_initialised(module: nn.Module) -> None:
    """Make every tensor of ``module`` again as construction made it, in the same order (fresh draws from the
    global RNG for the random ones), in place, on its device and in its dtype: each submodule through its own
    ``reset_parameters`` (or, without one, its submodules'), and what :func:`add_initialised` gave ``module``
    between them, where it was made."""
    own = module.__dict__.get("_initialisers", {})
    entries = list(module._modules.values())  # as add_initialised counted them: None and shared ones included
    reset = set()
    for position in range(len(entries) + 1):
        for name, (make, made_after) in own.items():  # a tensor made after a deleted submodule: at the end
            if made_after == position or position == len(entries) and made_after > position:
                _make_again(module, name, make)
        child = entries[position] if position < len(entries) else None
        if child is not None and id(child) not in reset:  # a submodule under two names is made once
            reset.add(id(child))
            child.reset_parameters() if hasattr(child, "reset_parameters") else reset_initialised(child)


def _make_again(module: nn.Module, name: str, make: Callable[[], torch.Tensor]) -> None:
    with torch.no_grad():
        current = getattr(module, name)
        value = make().to(device=current.device, dtype=current.dtype)
        if parametrize.is_parametrized(module, name):  # set through the parametrization's right inverse
            setattr(module, name, value)
        else:
            current.copy_(value)


class Mechanism(nn.Module):
    r"""Base of every registered layer: ``forward(x, padding_mask=None, cache=None) -> (y, cache)``.

    ``x`` is ``[B, T, dim]``; ``padding_mask`` ``[B, T]`` bool (True = real token; padded positions output
    zeros, and their content never changes the real ones, nor, in a non-causal call, how many lead or follow
    them; in a causal call leading padding shifts the real tokens: docs/DESIGN.md, "Decisions the paper leaves
    open", 4); ``cache`` is whatever the previous call returned (None to start a sequence). A layer decodes when
    its class declares :attr:`cache_types`, the :class:`~lavo.cache.Cache` kinds its causal calls return and
    continue, and implements :meth:`_new_cache` and :meth:`cache_nbytes`; a layer without a decoding form returns
    None as the cache. Asking a layer for something its flags deny raises an error naming it.
    """

    supports_causal = True
    supports_noncausal = True
    accepts_rotary = False  # takes ``rotary=True`` (the model's ``position="rope"``)
    time_complexity = "linear"  # "linear" | "quadratic" in the sequence length
    cache_types: tuple[type, ...] = ()  # the caches a call may continue (those its calls return)
    # whether a causal layer continues a sequence from the cache it returns: set from cache_types for each
    # subclass (__init_subclass__), unless the subclass sets it itself
    supports_decoding = False
    has_step_layout = False  # step_cache gives a fixed layout that a one-token step updates in place
    # Whether outputs depend on where the sequence starts (windows counted from position 0, cosFormer's
    # re-weighting): an AttentionLayer's non-causal calls then move each row's leading padding to its end first.
    absolute_positions = False
    max_positions: int | None = None  # the most positions one sequence may reach over all its calls (None: any)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "supports_decoding" not in cls.__dict__:
            cls.supports_decoding = bool(cls.cache_types)
        elif cls.supports_decoding and not cls.cache_types:
            raise TypeError(f"{cls.__name__} sets supports_decoding but declares no cache_types, the caches its "
                            "calls return and continue")

    def __init__(self, dim: int, heads: int, *, causal: bool = True):
        super().__init__()
        name = type(self).__name__
        check_switches(name, causal=causal)
        if causal and not self.supports_causal:
            raise ValueError(f"{name} has no causal form; build it with causal=False")
        if not causal and not self.supports_noncausal:
            raise ValueError(f"{name} has no non-causal form; build it with causal=True")
        self.head_dim = check_heads(dim, heads)
        self.dim, self.heads, self.causal = dim, heads, causal

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The keyword options of the constructor (``causal`` aside), what ``attention_options`` may set, with
        their defaults."""
        return keyword_options(cls, "causal")

    @classmethod
    def option_names(cls) -> list[str]:
        return list(cls.option_defaults())

    def reset_parameters(self) -> None:
        """Initialise every weight and buffer of the layer again as construction does, in the same order: after
        ``to_empty()`` of a layer built on the meta device."""
        reset_initialised(self)

    def no_weight_decay(self) -> list[nn.Parameter]:
        """Parameters to keep out of weight decay besides those with fewer than two dimensions."""
        return []

    def learning_rate_caps(self) -> list[tuple[list[nn.Parameter], float]]:
        """``[(parameters, cap)]``: parameters whose peak learning rate is ``min(lr, cap)`` instead of ``lr``
        (the schedule scales them as it scales the others)."""
        return []

    def residual_weights(self) -> list[nn.Parameter]:
        """Weights whose output is added to the residual stream (a model scales their initialisation)."""
        return []

    def cache_nbytes(self, batch_size: int, context: int, dtype: torch.dtype = torch.float32) -> int:
        """Upper bound of ``cache.nbytes()`` after ``context`` tokens of ``dtype`` inputs, for the cache a call
        returns (the fixed layout of :meth:`step_cache` has a size of its own)."""
        if self.supports_decoding:
            raise NotImplementedError(f"{type(self).__name__} decodes but does not implement cache_nbytes")
        raise ValueError(f"{type(self).__name__} has no decoding form, so no cache")

    def after_optimizer_step(self) -> None:
        """Called by :func:`after_optimizer_step` once the optimizer has stepped: for state that changes with
        training but not within a forward pass (Performer's feature redraws). Nothing by default."""

    def empty_cache(self, batch_size: int, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> Cache:
        """The cache before the first token, on the layer's device and for its dtype unless given (under
        autocast, the dtype its calls compute in); ``layer(x, cache=layer.empty_cache(B))`` equals ``layer(x)``.
        A layer without a decoding form raises."""
        if not self.supports_decoding:
            raise ValueError(f"{type(self).__name__} has no decoding form, so no cache")
        if device is None or dtype is None:
            first = first_parameter(self)
            device = torch.device(device or (first.device if first is not None else "cpu"))
            weights = first.dtype if first is not None else torch.get_default_dtype()
            # autocast computes float32 layers in its dtype (and leaves float64 ones as they are)
            autocast = (weights == torch.float32 and torch.amp.is_autocast_available(device.type)
                        and torch.is_autocast_enabled(device.type))
            dtype = dtype or (torch.get_autocast_dtype(device.type) if autocast else weights)
        return self._new_cache(batch_size, device=device, dtype=dtype)

    def _new_cache(self, batch_size: int, *, device: torch.device | str, dtype: torch.dtype) -> Cache:
        """The empty cache of a layer with a decoding form."""
        raise NotImplementedError(f"{type(self).__name__} decodes but does not implement _new_cache, which "
                                  "empty_cache calls")

    def step_cache(self, cache: Cache) -> Cache:
        """``cache`` (one this layer returned) in a fixed layout that a one-token step updates in place, with no
        host value read per step, so a CUDA graph of the step can be replayed. Where the layer has no such layout
        (:attr:`has_step_layout` False), ``cache`` as it is: a call continues from it as from any cache."""
        if not isinstance(cache, Cache):
            raise TypeError(f"step_cache takes a cache that a call of this layer returned, got {type(cache).__name__}")
        return self._step_cache(cache) if self.has_step_layout else cache

    def _step_cache(self, cache: Cache) -> Cache:
        """The fixed layout of a layer with :attr:`has_step_layout`."""
        raise NotImplementedError

    def check_call(self, x: torch.Tensor, padding_mask: torch.Tensor | None, cache: Any) -> None:
        """The checks every ``forward`` makes first."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape [B, T, {self.dim}], got {tuple(x.shape)}")
        if x.shape[1] == 0:  # refused by every mechanism alike (some ops would pass it through, others fail)
            raise ValueError(f"x has an empty time axis, shape {tuple(x.shape)}; a call needs at least one position")
        if x.shape[0] == 0:
            raise ValueError(f"x has an empty batch, shape {tuple(x.shape)}; a call needs at least one sequence")
        check_padding_mask(padding_mask, x.shape[0], x.shape[1], device=x.device)
        check_input_dtype(self, x)
        if cache is not None and not self.causal:
            raise ValueError(f"{type(self).__name__} was built with causal=False; a cache is only for causal decoding")
        if cache is not None and not self.supports_decoding:
            raise ValueError(f"{type(self).__name__} has no decoding form; call it without a cache")
        if cache is not None:  # before any mechanism's own checks, which would name shapes rather than the batch
            check_kind(cache, self.cache_types, type(self).__name__, "pass the cache this layer's previous call "
                       "returned")
            cache.check_batch_size(x.shape[0])
            cache.check_dtype(x.dtype)  # outside autocast (under it a cache and its inputs mix by design)


class PositionBound(NamedTuple):
    limit: int  # the most positions a sequence may reach
    layer: str  # the layer that sets it, as a message names it


def position_bound(model: nn.Module) -> PositionBound | None:
    """The fewest :attr:`~Mechanism.max_positions` among ``model``'s layers, with the layer that sets it, or None
    when no layer bounds the positions."""
    bounds = [PositionBound(m.max_positions, f"{type(m).__name__} with max_positions={m.max_positions}")
              for m in model.modules() if isinstance(m, Mechanism) and m.max_positions is not None]
    return min(bounds, default=None)


def check_returned_cache(layer: Mechanism, cache: Any) -> None:
    """Refuse a cache that breaks the contract where it would otherwise go unnoticed: a causal layer that
    decodes must return one of its :attr:`~Mechanism.cache_types` (None would make the next chunk forget the
    context, and a cache of another kind would not be reordered by beam search), one that does not, None."""
    if not layer.causal:
        return
    name = type(layer).__name__
    if layer.supports_decoding and not isinstance(cache, layer.cache_types):
        kinds = " or ".join(kind.__name__ for kind in layer.cache_types)
        raise TypeError(f"{name} returned {type(cache).__name__} as its cache, not a {kinds} (its cache_types); a "
                        "layer without a decoding form declares no cache_types and returns None")
    if not layer.supports_decoding and cache is not None:
        raise TypeError(f"{name} returned a {type(cache).__name__} but declares no cache_types, so nothing would "
                        "continue from it: declare the cache kinds its calls return, or return None")


def check_input_dtype(layer: nn.Module, x: torch.Tensor, name: str = "x") -> None:
    """Refuse an input of another dtype than the layer's weights where they may not differ
    (:func:`~lavo.ops.common.dtypes_may_differ`), which would otherwise fail in the first matmul with a message that
    names neither."""
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor (features, not token ids), got {x.dtype}")
    if dtypes_may_differ(x.device.type):
        return
    weights = first_parameter(layer)
    if weights is not None and x.dtype != weights.dtype:
        raise ValueError(f"{name} has dtype {x.dtype} and the layer's weights {weights.dtype}: convert one "
                         f"({name}.to({weights.dtype}) or layer.to({x.dtype})), or call the layer under torch.autocast")


def after_optimizer_step(model: nn.Module) -> None:
    """Tell every mechanism in ``model`` that the optimizer has stepped; call it after each ``optimizer.step()``
    of a training loop of your own (``lavo train`` does)."""
    for module in model.modules():
        if isinstance(module, Mechanism):
            module.after_optimizer_step()


class AttentionLayer(Mechanism):
    r"""Base of the attention layers: ``x`` -> per-head ``q, k, v [B, T, H, D]`` -> :meth:`attend` -> output
    projection. Subclasses implement :meth:`attend` and return None as the cache when they cannot decode."""

    def __init__(self, dim: int, heads: int, *, causal: bool = True):
        super().__init__(dim, heads, causal=causal)
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def residual_weights(self) -> list[nn.Parameter]:
        return [self.to_out.weight]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding_mask: torch.Tensor | None,
               cache: Any) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                cache: Any = None) -> tuple[torch.Tensor, Any]:
        self.check_call(x, padding_mask, cache)
        shift = self.leading_shift(padding_mask)
        if shift is not None:
            x, padding_mask = roll_rows(x, shift), roll_rows(padding_mask, shift)
        x = zero_padded(x, padding_mask)  # a NaN or inf at a padded position would reach every real one
        q, k, v = rearrange(self.to_qkv(x), "b t (three h d) -> three b t h d", three=3, h=self.heads)
        out, cache = self.attend(q, k, v, padding_mask, cache)
        y = zero_padded(self.to_out(rearrange(out, "b t h d -> b t (h d)")), padding_mask)
        return (y if shift is None else roll_rows(y, -shift)), cache

    def leading_shift(self, padding_mask: torch.Tensor | None) -> torch.Tensor | None:
        """``[B]``: how far a call moves each row so that its real tokens start at position 0, or None where it
        moves none. Non-causal outputs must not depend on how much padding leads a row (so on its batch-mates);
        a causal call keeps its positions, which its cache continues (docs/DESIGN.md, "Decisions the paper leaves
        open", 4)."""
        if not self.absolute_positions or self.causal or padding_mask is None:
            return None
        if not torch.compiler.is_compiling() and bool(padding_mask[:, 0].all()):  # no row starts padded: no gathers
            return None
        return leading_padding(padding_mask)

    def key_value_nbytes(self, batch_size: int, positions: int, dtype: torch.dtype) -> int:
        """Bytes of ``positions`` cached keys and values of ``dtype`` plus their bool mask."""
        return batch_size * positions * (2 * self.heads * self.head_dim * element_size(dtype) + 1)


class CrossAttentionLayer(nn.Module):
    r"""Base of the cross attentions (a decoder reading an encoder's output):
    ``forward(y [B, Tq, dim], source [B, S, dim], source_padding_mask [B, S] | None,
    query_padding_mask [B, Tq] | None) -> [B, Tq, dim]``, zero at padded queries.

    ``y`` gives per-head queries ``q [B, Tq, H, D]``; the source gives ``source_projections`` per-head tensors
    ``[B, S, H, D]`` (keys and values: 2; LAVO's features: 1). Subclasses implement :meth:`attend`
    ``(q, *source_heads, source_padding_mask) -> [B, Tq, H, D]``; one whose weights depend on a query's place
    (:attr:`query_positions`) also takes ``query_padding_mask``, so that padding the queries changes nothing.
    """

    query_positions = False

    def __init__(self, dim: int, heads: int, *, source_projections: int = 2):
        super().__init__()
        self.head_dim = check_heads(dim, heads)
        self.dim, self.heads, self.source_projections = dim, heads, source_projections
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_source = nn.Linear(dim, source_projections * dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The keyword options of the constructor, with their defaults (``source_projections`` is the
        subclass's own)."""
        return keyword_options(cls, "source_projections")

    def reset_parameters(self) -> None:
        """As :meth:`Mechanism.reset_parameters`."""
        reset_initialised(self)

    def attend(self, q: torch.Tensor, *source_heads: torch.Tensor,
               source_padding_mask: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, y: torch.Tensor, source: torch.Tensor, source_padding_mask: torch.Tensor | None = None,
                query_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        for name, t, length in (("y", y, "T"), ("source", source, "S")):
            if t.dim() != 3 or t.shape[-1] != self.dim:
                raise ValueError(f"{name} must have shape [B, {length}, {self.dim}], got {tuple(t.shape)}")
        if y.shape[0] != source.shape[0]:
            raise ValueError(f"y and source must have the same batch size, got {y.shape[0]} and {source.shape[0]}")
        if y.shape[1] == 0:  # refused alike (LAVO's read divided by it)
            raise ValueError(f"y has an empty time axis, shape {tuple(y.shape)}; a call needs at least one query")
        if y.shape[0] == 0:  # as self-attention refuses it (LAVO's op refused it, naming its own q; others passed)
            raise ValueError(f"y has an empty batch, shape {tuple(y.shape)}; a call needs at least one sequence")
        check_padding_mask(source_padding_mask, source.shape[0], source.shape[1], "source_padding_mask",
                           axes="B, S", device=source.device)
        check_padding_mask(query_padding_mask, y.shape[0], y.shape[1], "query_padding_mask", device=y.device)
        check_input_dtype(self, y, "y")
        check_input_dtype(self, source, "source")
        # a NaN at a padded position would reach every query (a padded query: only itself, but its gradient too)
        q = rearrange(self.to_q(zero_padded(y, query_padding_mask)), "b t (h d) -> b t h d", h=self.heads)
        source = zero_padded(source, source_padding_mask)
        source_heads = rearrange(self.to_source(source), "b s (n h d) -> n b s h d", n=self.source_projections,
                                 h=self.heads)
        query_mask = {"query_padding_mask": query_padding_mask} if self.query_positions else {}
        out = self.attend(q, *source_heads, source_padding_mask=source_padding_mask, **query_mask)
        return zero_padded(self.to_out(rearrange(out, "b t h d -> b t (h d)")), query_padding_mask)
