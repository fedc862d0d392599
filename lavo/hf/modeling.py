"""The native language model as a ``transformers`` ``PreTrainedModel`` with ``generate()``.

:class:`LavoLMForCausalLM` holds a :class:`lavo.model.LanguageModel` under ``lavo`` (weights ``lavo.*``) and
computes exactly what it computes; generation goes through :class:`~lavo.hf.state.LavoState`, which wraps the
native cache.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache as HubCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from ..generate import check_room
from ..model import Block, LanguageModel
from .configuration import UNRETURNED_OUTPUTS, LavoLMConfig
from .state import LavoState, real_spans

# what generate() continues a prompt by when neither max_new_tokens nor max_length is set (transformers' default
# max_length, which it then counts after the prompt)
DEFAULT_NEW_TOKENS = 20


def check_buffers_persist(model: torch.nn.Module) -> None:
    """Refuse non-persistent buffers: ``from_pretrained`` builds the model on the meta device and gives such a
    buffer uninitialised memory, which :meth:`LavoLMForCausalLM._init_weights` cannot refill (it does not know
    how a mechanism of your own computes it)."""
    transient = [f"{name}.{buffer}" if name else buffer for name, module in model.named_modules()
                 for buffer in module._non_persistent_buffers_set]
    if transient:
        raise ValueError(f"the Hugging Face model saves and restores persistent buffers only; not persistent: "
                         f"{', '.join(sorted(transient))} (from_pretrained would leave uninitialised memory there): "
                         "register them with persistent=True")


class LavoLMForCausalLM(PreTrainedModel, GenerationMixin):
    r"""A :class:`~lavo.model.LanguageModel` (``self.lavo``) as a ``transformers`` causal language model, built from
    a :class:`~lavo.hf.LavoLMConfig` or wrapped around a native model (:meth:`from_native`): ``input_ids [B, T]``
    -> ``logits [B, T, vocab]`` and a :class:`~lavo.hf.LavoState` to continue from (:meth:`forward`)."""

    config_class = LavoLMConfig
    base_model_prefix = "lavo"
    main_input_name = "input_ids"
    _no_split_modules = [Block.__name__]
    supports_gradient_checkpointing = True
    # LAVO's memory cannot be rolled back, so assisted (speculative) generation, which needs that, is refused
    _is_stateful = True

    def __init__(self, config: LavoLMConfig):
        config.check_supported()
        super().__init__(config)
        self.lavo = LanguageModel(config.model_config())
        check_buffers_persist(self.lavo)
        self.post_init()
        if not self.lavo.supports_decoding:
            # generate() then feeds the whole sequence at every step instead of the last token
            self.generation_config.use_cache = False

    def _init_weights(self, module) -> None:
        """Draw the weights ``from_pretrained`` found none for (a key the checkpoint lacks, or one of another shape
        with ``ignore_mismatched_sizes=True``) as the native model draws them when built, and leave every other
        weight alone: each native module initialises itself when built (the mechanisms' own schemes, e.g. LAVO's
        Haar-random basis and zero position bias), and a loaded checkpoint replaces the rest. transformers would
        otherwise leave those weights as the memory it allocated, and its report calls them newly initialised.
        An embedding other than the model's own is the one ``resize_token_embeddings(..., mean_resizing=False)``
        makes: its rows are drawn as the native model draws its embeddings (torch's would have 1 / ``init_std``
        times their scale, and the tied logits of the new tokens as much)."""
        if isinstance(module, torch.nn.Embedding) and module is not self.lavo.embed:
            torch.nn.init.normal_(module.weight, 0.0, self.config.init_std)
            return
        tensors = self.lavo.state_dict(keep_vars=True)
        # from_pretrained marks each tensor it loads (transformers calls this for each module that owns an unmarked
        # one); none marked: the model is being built, and has initialised itself
        missing = [name for name, tensor in tensors.items() if not getattr(tensor, "_is_hf_initialized", False)]
        if len(missing) in (0, len(tensors)):
            return
        with torch.device("cpu"):  # a whole native model once, so that each tensor is drawn by its own scheme
            fresh = LanguageModel(self.lavo.config).state_dict()
        with torch.no_grad():
            for name in missing:
                tensors[name].copy_(fresh[name])
                tensors[name]._is_hf_initialized = True  # so that the calls for the other modules leave it

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the state is made by forward(), not a DynamicCache made by generate()

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1) -> None:
        """Where ``activation_checkpointing_enable()`` and ``activation_checkpointing_disable()`` end: the native
        blocks (not ``transformers`` layers) take the checkpointing function, every ``every_n_layers``-th of them."""
        self.lavo.set_activation_checkpointing(enable, every=every_n_layers, function=gradient_checkpointing_func)

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(block.checkpoint_function is not None for block in self.lavo.blocks)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.lavo.embed

    def set_input_embeddings(self, embedding: torch.nn.Embedding) -> None:
        self.lavo.embed = embedding
        # resize_token_embeddings updates this model's config; the native model's must follow
        self.lavo.config = dataclasses.replace(self.lavo.config, vocab_size=embedding.num_embeddings)

    @classmethod
    def from_native(cls, model: LanguageModel, **config) -> LavoLMForCausalLM:
        """The same model (weights copied, in its training or eval mode) with ``config`` (any other
        :class:`LavoLMConfig` field) set."""
        wrapped = cls(LavoLMConfig.from_model_config(model.config, **config))
        wrapped.lavo.load_state_dict(model.state_dict())
        weight = next(model.parameters())
        return wrapped.to(device=weight.device, dtype=weight.dtype).train(model.training)

    def generate(self, *args, **kwargs):
        mask = kwargs.get("attention_mask")
        empty = [] if mask is None else (mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"rows {empty} of attention_mask have no real token, so nothing to continue (their "
                             "logits would be zeros): give each prompt at least one token, e.g. the tokenizer's "
                             "bos_token_id first, as pipeline() does for an empty prompt")
        self.check_room(args[0] if args else kwargs.get("inputs", kwargs.get("input_ids")), kwargs)
        if not self.lavo.supports_decoding:
            # with use_cache, generate() would feed only the last token, which a model without a cache cannot take
            kwargs["use_cache"] = False
        return super().generate(*args, **kwargs)

    def check_room(self, inputs: torch.Tensor | None, kwargs: dict) -> None:
        """:func:`lavo.generate.check_room` for ``generate()``'s prompt and its ``max_new_tokens`` (else
        ``max_length``, the whole sequence; else :data:`DEFAULT_NEW_TOKENS`), from ``kwargs`` or the generation
        config."""
        if inputs is None:
            return
        config = kwargs.get("generation_config") or self.generation_config
        new = kwargs.get("max_new_tokens", config.max_new_tokens)
        if new is None:
            length = kwargs.get("max_length", config.max_length)
            new = DEFAULT_NEW_TOKENS if length is None else length - inputs.shape[-1]
        check_room(self.lavo, inputs.shape[-1], new)

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: LavoState | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, num_items_in_batch: int | torch.Tensor | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        r"""``input_ids [B, T]`` -> ``logits [B, T, vocab]`` (zero at padding), the state to continue with (when
        ``use_cache``), and the next-token loss when ``labels [B, T]`` are given (-100 is ignored, and so is a
        label at or just after padding): the mean, or the sum over ``num_items_in_batch`` when given (``Trainer``
        does, to weigh every token of an accumulated batch alike; it counts a label at or just after padding too,
        so one other than -100 there is refused).

        ``attention_mask [B, past + T]`` (1 for real tokens) is the mask of the whole sequence so far, as
        ``generate()`` passes it; each row's real tokens must be consecutive. Padding is not fed to the model,
        except that a right-padded batch that starts no state (``use_cache=False``) is one call with the padding
        mask, as exact.
        ``past_key_values`` is taken as another name for ``cache``. Other keyword arguments of the
        ``transformers`` interface (``position_ids``, ...) are accepted and unused: the model counts positions
        itself, so ``position_ids`` that restart within a row (sequences packed into it) are refused. Embeddings
        in place of ids, hidden states and attention weights are refused. ``logits_to_keep`` (an int ``n``: the last
        ``n`` positions, 0 for all; or a tensor of position indices) selects the logits returned, as in
        ``transformers``; the loss is over every position still.
        """
        cache = merge_cache_names(cache, kwargs.pop("past_key_values", None))
        keep = kwargs.pop("logits_to_keep", 0)
        refuse_unsupported(input_ids, kwargs, self.config)
        use_cache = (self.config.use_cache if use_cache is None else use_cache) and self.lavo.supports_decoding
        if cache is not None and not self.lavo.supports_decoding:
            raise ValueError(f"attention {self.config.attention!r} has no decoding form: call without a cache")
        state = LavoState(input_ids.shape[0]) if cache is None else cache
        refuse_mismatched_shapes(input_ids, attention_mask, labels, state.columns)
        real = None if attention_mask is None else attention_mask[:, -input_ids.shape[1]:].bool()
        refuse_outside_vocabulary(input_ids, real, self.config.vocab_size)
        refuse_packed_positions(kwargs.get("position_ids"), real)
        if cache is None and real is not None and not use_cache and bool(real[:, 0].all()):
            # right padding and no state wanted (use_cache=False): one call over the batch, whose real tokens start at
            # position 0 as alone, instead of one per row length
            real_spans(real)  # refuses padding between real tokens
            # the pad ids are never embedded (one outside the vocabulary would fail)
            ids = input_ids.masked_fill(~real, 0)
            logits = self.lavo(ids, padding_mask=real)[0].masked_fill(~real[..., None], 0)
        else:
            logits = state.feed(self.lavo, input_ids, real)
        loss = None if labels is None else next_token_loss(logits, labels, num_items_in_batch, real)
        logits = logits[:, slice(-keep, None) if isinstance(keep, int) else keep]
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=state if use_cache else None)


def refuse_mismatched_shapes(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                             labels: torch.Tensor | None, consumed: int) -> None:
    """Errors for an ``attention_mask`` that is not ``[B, consumed + T]`` and ``labels`` that are not ``[B, T]``,
    for ``input_ids [B, T]`` after a state that has consumed ``consumed`` positions."""
    rows, new = input_ids.shape
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != rows:
            raise ValueError(f"attention_mask must have shape [B, positions] with the {rows} rows of input_ids, got "
                             f"{tuple(attention_mask.shape)}")
        if attention_mask.shape[1] != consumed + new:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions, but the state has "
                             f"consumed {consumed} and input_ids adds {new}: pass the mask of the whole sequence and "
                             "only the new input_ids")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(f"labels must have the shape of input_ids, {tuple(input_ids.shape)}, got "
                         f"{tuple(labels.shape)}")


def refuse_packed_positions(position_ids: torch.Tensor | None, real: torch.Tensor | None) -> None:
    """An error for ``position_ids`` that do not step by one between neighbouring real tokens (``real [B, T]``,
    None: all), as for several sequences packed into one row (``DataCollatorWithFlattening``): the model counts
    positions itself, so it would attend across their boundaries. ``generate()``'s positions step by one."""
    if position_ids is None or position_ids.shape[-1] < 2:
        return
    steps = position_ids.diff(dim=-1)
    neighbours = torch.ones_like(steps, dtype=torch.bool) if real is None else real[:, 1:] & real[:, :-1]
    if bool(((steps != 1) & neighbours.to(steps.device)).any()):
        raise ValueError("position_ids restart or skip within a row, as for sequences packed into one row: the model "
                         "counts positions itself and would attend across them; pad the sequences instead "
                         "(lavo.hf.LanguageModelingCollator)")


def refuse_outside_vocabulary(input_ids: torch.Tensor, real: torch.Tensor | None, vocab_size: int) -> None:
    """An error naming the real tokens' ids (``real [B, T]``, None: all) outside ``0 .. vocab_size - 1``; on a GPU
    the embedding would stop the process with a device-side assertion. Padding ids are never embedded."""
    ids = input_ids if real is None else input_ids[real]
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        raise ValueError(f"input_ids hold ids outside the model's vocabulary of {vocab_size}: "
                         f"{sorted(set(outside.tolist()))[:5]}")


def merge_cache_names(cache: HubCache | None, past_key_values: HubCache | None) -> LavoState | None:
    """The state passed as ``cache`` or under its older name ``past_key_values`` (not both). An empty
    ``transformers`` cache of another kind (a ``DynamicCache()``, as transformers' guides pass to ``generate``)
    means a new state; one that holds positions cannot be continued."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the state as cache or as past_key_values, not both")
    given = past_key_values if cache is None else cache
    if given is None or isinstance(given, LavoState):
        return given
    if isinstance(given, HubCache) and given.get_seq_length() == 0:
        return None
    holding = " holding positions" if isinstance(given, HubCache) else ""
    raise TypeError(f"LavoLMForCausalLM continues a lavo.hf.LavoState (the cache its calls return), got a "
                    f"{type(given).__name__}{holding}: pass no cache to start, or the one a call returned")


def refuse_unsupported(input_ids: torch.Tensor | None, kwargs: dict, config: LavoLMConfig) -> None:
    """Errors for ids of another shape and for the ``transformers`` options that would change what forward
    returns but that it lacks, asked for in the call or, where the call does not name them, in ``config``."""
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError("LavoLMForCausalLM takes input_ids only, not inputs_embeds")
    if input_ids is None:
        raise ValueError("input_ids are required")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids has no positions; generate() takes the whole sequence so far (the positions a "
                         "state passed with it has consumed, then the new ones), a call of the model only the new ones")
    for flag, what in UNRETURNED_OUTPUTS.items():
        asked = kwargs.get(flag)
        if asked or (asked is None and getattr(config, flag)):
            fix = f"call it without {flag}=True" if asked else f"set model.config.{flag} = False"
            raise ValueError(f"LavoLMForCausalLM does not return {what}: {fix}")


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None,
                    real: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``logits [B, T, V]`` at position ``t`` against ``labels [B, T]`` at ``t + 1`` (-100
    ignored): the mean over the counted labels, or their sum divided by ``num_items_in_batch``. Where ``real
    [B, T]`` (True for real tokens) says position ``t`` or ``t + 1`` is padding, the label is ignored too: padding
    predicts nothing (its logits are zeros), and a padded position is no target."""
    labels = labels[:, 1:].to(logits.device)
    if real is not None:
        unpredicted = ~(real[:, :-1] & real[:, 1:]).to(labels.device)
        if num_items_in_batch is not None:
            refuse_uncounted_targets(labels, unpredicted)
        labels = labels.masked_fill(unpredicted, -100)
    logits, labels = logits[:, :-1].flatten(0, 1).float(), labels.flatten()
    if num_items_in_batch is None:
        return F.cross_entropy(logits, labels, ignore_index=-100)
    total = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    return total / torch.as_tensor(num_items_in_batch, device=total.device)


def refuse_uncounted_targets(labels: torch.Tensor, unpredicted: torch.Tensor) -> None:
    """An error for shifted ``labels [B, T - 1]`` that padding leaves unpredicted (``unpredicted [B, T - 1]``) but
    that are not -100: ``Trainer`` counts every such label in ``num_items_in_batch``, so the loss, which ignores
    them, would come out too small by that share (one label per left-padded row, the first real token)."""
    rows = ((labels != -100) & unpredicted).any(1).nonzero().flatten().tolist()
    if rows:
        raise ValueError(f"rows {rows} have labels other than -100 at or just after padding, which the loss ignores "
                         "(padding predicts nothing) but num_items_in_batch counts as Trainer does: pad on the "
                         "right with labels -100 at padding (lavo.hf.LanguageModelingCollator does), or set those "
                         "labels to -100")
