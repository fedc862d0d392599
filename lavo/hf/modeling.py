"""The native language model as a ``transformers`` ``PreTrainedModel`` with ``generate()``.

:class:`LavoLMForCausalLM` holds a :class:`lavo.model.LanguageModel` under ``lavo`` (weights ``lavo.*``) and
computes exactly what it computes; generation goes through :class:`~lavo.hf.state.LavoState`, which wraps the
native cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from ..model import Block, LanguageModel
from .configuration import LavoLMConfig
from .state import LavoState


class LavoLMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LavoLMConfig
    base_model_prefix = "lavo"
    main_input_name = "input_ids"
    _no_split_modules = [Block.__name__]
    # LAVO's memory cannot be rolled back, so assisted (speculative) generation, which needs that, is refused
    _is_stateful = True

    def __init__(self, config: LavoLMConfig):
        super().__init__(config)
        self.lavo = LanguageModel(config.model_config())
        self.post_init()
        if not self.lavo.supports_decoding:
            # generate() then feeds the whole sequence at every step instead of the last token
            self.generation_config.use_cache = False

    def _init_weights(self, module) -> None:
        """Nothing: each native module initialises itself when built (the mechanisms' own schemes, e.g. LAVO's
        Haar-random basis and zero position bias), and a loaded checkpoint replaces the rest."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the state is made by forward(), not a DynamicCache made by generate()

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.lavo.embed

    def set_input_embeddings(self, embedding: torch.nn.Embedding) -> None:
        self.lavo.embed = embedding

    @classmethod
    def from_native(cls, model: LanguageModel, **config) -> LavoLMForCausalLM:
        """The same model (weights copied) with ``config`` (any other :class:`LavoLMConfig` field) set."""
        wrapped = cls(LavoLMConfig.from_model_config(model.config, **config))
        wrapped.lavo.load_state_dict(model.state_dict())
        return wrapped.to(next(model.parameters()).device)

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                cache: LavoState | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        r"""``input_ids [B, T]`` -> ``logits [B, T, vocab]`` (zero at padding), the state to continue with (when
        ``use_cache``), and the mean next-token loss when ``labels [B, T]`` are given (-100 is ignored).

        ``attention_mask [B, past + T]`` (1 for real tokens) is the mask of the whole sequence so far, as
        ``generate()`` passes it; each row's real tokens must be consecutive. Padding is never fed to the model.
        Other keyword arguments of the ``transformers`` interface (``position_ids``, ...) are accepted and unused:
        the model counts positions itself.
        """
        use_cache = (self.config.use_cache if use_cache is None else use_cache) and self.lavo.supports_decoding
        if cache is not None and not self.lavo.supports_decoding:
            raise ValueError(f"attention {self.config.attention!r} has no decoding form: call without a cache")
        state = LavoState(input_ids.shape[0]) if cache is None else cache
        real = None
        if attention_mask is not None:
            if attention_mask.shape[1] != state.columns + input_ids.shape[1]:
                raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions, but the state has "
                                 f"consumed {state.columns} and input_ids adds {input_ids.shape[1]}: pass the mask "
                                 "of the whole sequence and only the new input_ids")
            real = attention_mask[:, -input_ids.shape[1]:].bool()
        logits = state.feed(self.lavo, input_ids, real)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=state if use_cache else None)
