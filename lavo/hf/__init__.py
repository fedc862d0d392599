"""LAVO language models in the Hugging Face ``transformers`` ecosystem (the optional extra ``hf``).

Importing this package registers the model type ``lavo_lm`` with ``AutoConfig``, ``AutoModelForCausalLM`` and
``AutoTokenizer``, so a directory written by ``lavo export`` loads with ``AutoModelForCausalLM.from_pretrained``
and ``pipeline("text-generation", model=DIRECTORY)``.
"""
try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    if error.name != "transformers":  # installed, but it failed to import (a missing dependency): its error says why
        raise
    raise ImportError("lavo.hf needs transformers: install the extra with `pip install -e '.[hf]'`",
                      name="transformers") from error

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .configuration import MODEL_TYPE, LavoLMConfig
from .export import export_run, load_exported
from .modeling import LavoLMForCausalLM
from .state import LavoState
from .tokenization import LavoTokenizer, hub_tokenizer
from .training import LanguageModelingCollator, MechanismCallback, lavo_optimizer

AutoConfig.register(MODEL_TYPE, LavoLMConfig, exist_ok=True)
AutoModelForCausalLM.register(LavoLMConfig, LavoLMForCausalLM, exist_ok=True)
AutoTokenizer.register(LavoLMConfig, tokenizer_class=LavoTokenizer, exist_ok=True)

__all__ = ["LanguageModelingCollator", "LavoLMConfig", "LavoLMForCausalLM", "LavoState", "LavoTokenizer",
           "MechanismCallback", "export_run", "hub_tokenizer", "lavo_optimizer", "load_exported"]
