"""The model settings as a ``transformers`` config: the fields of :class:`lavo.model.ModelConfig`, so every
registered mechanism and its options load through ``AutoConfig``."""
from __future__ import annotations

import difflib
from dataclasses import field

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from ..model import ModelConfig
from ..run import EXPORTED_MODEL_TYPE as MODEL_TYPE

# the outputs transformers models return on request and LavoLMForCausalLM does not: the flag, and what it asks for
UNRETURNED_OUTPUTS = {"output_hidden_states": "hidden states", "output_attentions": "attention weights"}


@strict
class LavoLMConfig(PreTrainedConfig):
    r"""A LAVO language model's config (``model_type = "lavo_lm"``).

    ``vocab_size`` ... ``init_std`` are :class:`lavo.model.ModelConfig`'s fields and mean the same; the standard
    names ``hidden_size``, ``num_hidden_layers`` and ``num_attention_heads`` read ``dim``, ``depth`` and ``heads``.
    ``lavo_run`` is the run config (sections data, model, train) of the run it was exported from, or None: it
    lets ``lavo eval`` score the run's held-out split and default to multiples of its training length.
    """

    model_type = MODEL_TYPE
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "depth", "num_attention_heads": "heads"}

    # ModelConfig's fields again: transformers reads a config's fields from its own dataclass declaration
    # (tests check that the names and defaults agree)
    vocab_size: int = 4096
    dim: int = 256
    depth: int = 4
    heads: int = 4
    attention: str = "lavo"
    attention_options: dict = field(default_factory=dict)
    position: str = "none"
    mlp_ratio: int = 4
    dropout: float | int = 0.0
    init_std: float = 0.02
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True  # the logits read the token embedding matrix
    lavo_run: dict | None = None

    def __post_init__(self, **kwargs):
        check_spelling(kwargs)
        super().__post_init__(**kwargs)
        self.model_config()  # a bad mechanism, option or position fails here, with ModelConfig's message
        self.check_supported()

    def check_supported(self) -> None:
        """Refuse untied output embeddings and outputs the model does not return, here and again when the model
        is built (``from_pretrained`` sets its keyword arguments on the config after it is made): the model would
        otherwise ignore them."""
        if not self.tie_word_embeddings:
            raise ValueError("LavoLMForCausalLM reads its logits from the token embedding matrix: "
                             "tie_word_embeddings=False is not supported")
        for flag, what in UNRETURNED_OUTPUTS.items():
            if getattr(self, flag):
                raise ValueError(f"LavoLMForCausalLM does not return {what}: {flag}=True is not supported")

    def model_config(self) -> ModelConfig:
        """The native model's settings."""
        return ModelConfig.from_dict({name: getattr(self, name) for name in ModelConfig.__dataclass_fields__})

    @classmethod
    def from_model_config(cls, config: ModelConfig, **extra) -> LavoLMConfig:
        return cls(**config.to_dict(), **extra)


def check_spelling(unknown: dict) -> None:
    """Refuse a keyword that is not a field but close to a model setting's name (``depht=3``): transformers keeps
    any unknown keyword as an attribute, so the model would be built with the default. Other unknown keywords
    (metadata that other tools write into config.json) are kept, as transformers keeps them."""
    settings = [*ModelConfig.__dataclass_fields__, *LavoLMConfig.attribute_map]
    for name in unknown:
        close = difflib.get_close_matches(name, settings, n=1, cutoff=0.7)
        if close:
            raise ValueError(f"LavoLMConfig has no setting {name!r}: did you mean {close[0]!r}?")
