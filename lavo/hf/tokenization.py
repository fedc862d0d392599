"""The run's tokenizer as a ``transformers`` tokenizer."""
from __future__ import annotations

import os

from transformers import PreTrainedTokenizerFast

from ..data import EOT, Tokenizer
from ..run import TOKENIZER


class LavoTokenizer(PreTrainedTokenizerFast):
    """A ``PreTrainedTokenizerFast`` over the run's byte-level BPE (``tokenizer.json``) that will not load
    without that file: the error says it is missing, instead of the generic one about slow tokenizers. A text that
    says ``<|endoftext|>`` is encoded as text, as the run's tokenizer encoded it in training (``transformers``
    would otherwise read it as the token), unless ``split_special_tokens=False`` is given."""

    @classmethod
    def convert_to_native_format(cls, **kwargs):
        file = kwargs.get("tokenizer_file")
        if not (file and os.path.isfile(file)):
            where = kwargs.get("name_or_path") or "the model directory"
            # a ValueError: transformers replaces an OSError by a message about corrupted vocabulary files
            raise ValueError(f"{where} has no {TOKENIZER}: a LAVO model's tokenizer is that file; copy the run's "
                             f"{TOKENIZER} there or export the run again with `lavo export`")
        # exports saved before split_special_tokens was written into tokenizer_config.json leave it out
        kwargs.setdefault("split_special_tokens", True)
        return super().convert_to_native_format(**kwargs)


def hub_tokenizer(tokenizer: Tokenizer) -> LavoTokenizer:
    """``tokenizer`` for ``transformers``: ``<|endoftext|>`` is its end, start and padding token, and it pads
    on the left, as batched generation needs."""
    return LavoTokenizer(tokenizer_object=tokenizer.inner, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                         padding_side="left", split_special_tokens=True)
