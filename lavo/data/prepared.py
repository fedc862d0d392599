"""Prepared data: both splits of a source tokenised once and cached under ``data_dir`` as flat token arrays
(numpy memmaps) with a ``manifest.json``; later calls only map the files.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..files import atomic_write, remove_orphans, staging_folder, write_json
from ..report import counted
from .documents import SPLITS, DataError, Document, document_digests, listing
from .sources import is_builtin, mix_parts, part_of, provenance, read_split, source_splits
from .tokenizer import Tokenizer, check_word_lengths, gpt2_tokenizer, load_tokenizer_file, parse_tokenizer, train_bpe

DEFAULT_DATA_DIR = "data"


@dataclass
class TokenData:
    """One prepared split: ``tokens`` (read-only memmap) and its document boundaries."""

    tokens: np.ndarray
    documents: list[dict]
    split: str
    manifest: dict

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Prepared:
    train: TokenData
    valid: TokenData
    tokenizer: Tokenizer
    directory: Path
    manifest: dict
    digests: dict[str, dict[str, str]]  # {split: {document name: digest of its text}} (document_digests)

    def split(self, name: str) -> TokenData:
        if name not in SPLITS:
            raise DataError(f"unknown split {name!r}; splits: {', '.join(SPLITS)}")
        return getattr(self, name)


def _source_key(source: str) -> str:
    if is_builtin(source):
        return source
    path = Path(source).resolve()
    return f"dir-{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def _fingerprint(splits: dict[str, list[Document]], tokenizer: str) -> str:
    h = hashlib.sha256(tokenizer.encode())
    for split in SPLITS:
        for doc in splits[split]:
            h.update(f"\0{split}\0{doc.name}\0".encode())
            h.update(doc.text.encode())
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2 ** 16 else np.uint32)


def encode_documents(tokenizer: Tokenizer, documents: list[Document], dtype: np.dtype) -> tuple[np.ndarray, list]:
    """The documents' tokens in one array, each followed by ``<|endoftext|>``, and each document's span."""
    encoded = tokenizer.encode_batch([d.text for d in documents])
    tokens = np.empty(sum(len(ids) + 1 for ids in encoded), dtype=dtype)
    bounds, at = [], 0
    for doc, ids in zip(documents, encoded):
        tokens[at:at + len(ids)] = ids
        bounds.append({"name": doc.name, "start": at, "end": at + len(ids)})
        tokens[at + len(ids)] = tokenizer.eot_id  # document separator
        at += len(ids) + 1
    return tokens, bounds


def _load_split(directory: Path, manifest: dict, split: str, fix: str) -> TokenData:
    info = manifest["splits"][split]
    path = directory / info["file"]
    dtype = np.dtype(manifest["dtype"])
    expected = info["num_tokens"] * dtype.itemsize
    if not path.is_file() or path.stat().st_size != expected:
        found = path.stat().st_size if path.is_file() else "no file"
        raise DataError(f"prepared file {path} is corrupt (expected {expected} bytes, found {found}): {fix}")
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(info["num_tokens"],))
    return TokenData(tokens, info["documents"], split, manifest)


def split_tokens(source: str, data_dir: str | os.PathLike, holdout: list[str] | None, split: str,
                 tokenizer: Tokenizer, parts: list[str] | None = None) -> np.ndarray:
    """One split of ``source`` tokenised with ``tokenizer`` (:func:`~lavo.data.sources.read_split`): the same
    tokens :func:`prepare` caches, without the cache."""
    return tokenize(read_split(source, data_dir, holdout, split, parts), tokenizer)


def tokenize(documents: list[Document], tokenizer: Tokenizer) -> np.ndarray:
    """The documents' tokens in one array, each document followed by ``<|endoftext|>``, as prepared data holds
    them."""
    return encode_documents(tokenizer, documents, token_dtype(tokenizer.vocab_size))[0]


def prepare(source: str = "austen", tokenizer: str = "bpe4096", data_dir: str | os.PathLike = DEFAULT_DATA_DIR,
            holdout: list[str] | None = None, rebuild: bool = False, fetch: bool = True,
            log=print) -> Prepared:
    """Fetch ``source`` if needed, split it by document, tokenise each split once and map the cached arrays.

    Cached files live in ``data_dir/<source>/<tokenizer>-<key>/``: ``train.bin``, ``valid.bin``,
    ``manifest.json`` (and ``tokenizer.json`` for a trained BPE), where ``key`` is a digest of the texts, the
    split and the tokenizer name. A cache folder is written once, complete, and never changed: other texts or
    another split get a folder of their own, so a trained BPE a run used is never retrained under it.
    ``rebuild=True`` builds the folder again (e.g. after damage).
    """
    vocab_size = parse_tokenizer(tokenizer)
    splits, folders = source_splits(source, data_dir, holdout, fetch=fetch, log=log)
    fingerprint = _fingerprint(splits, tokenizer)
    directory = Path(data_dir) / _source_key(source) / f"{tokenizer}-{fingerprint[:12]}"
    fix = (f"delete {directory} or run `lavo data --source {source} --tokenizer {tokenizer} "
           f"--data-dir {data_dir} --rebuild`")
    remove_orphans(directory.parent)
    manifest_path = directory / "manifest.json"
    if rebuild or not manifest_path.is_file():
        # folders are published whole, so one without its manifest is damaged: it is replaced, as on --rebuild
        build_cache(directory, folders, splits, source, tokenizer, fingerprint, log,
                    replace=rebuild or directory.exists())
    try:
        manifest = json.loads(manifest_path.read_text())
        manifest["splits"], manifest["dtype"], manifest["fingerprint"]
    except (ValueError, KeyError) as error:
        raise DataError(f"{manifest_path} is corrupt ({error}): {fix}") from error
    tok = gpt2_tokenizer() if vocab_size is None else load_tokenizer_file(directory / "tokenizer.json", tokenizer,
                                                                          fix)
    return Prepared(*(_load_split(directory, manifest, s, fix) for s in SPLITS), tok, directory, manifest,
                    document_digests(splits))


def write_cache(staging: Path, folders: dict[str, Path], splits: dict[str, list[Document]], source: str,
                tokenizer: str, fingerprint: str, log) -> None:
    """The tokenizer (a trained BPE), both splits' tokens and the manifest, into ``staging``."""
    vocab_size = parse_tokenizer(tokenizer)
    if vocab_size is None:
        tok = gpt2_tokenizer()
    else:
        check_word_lengths(splits["train"])
        log(f"training a byte-level BPE ({vocab_size} tokens) on {counted(len(splits['train']), 'training document')}")
        tok = train_bpe([d.text for d in splits["train"]], vocab_size)
        if tok.vocab_size < vocab_size:  # the trainer stops once every word is one token, without a word
            log(f"note: the training documents make a BPE of only {tok.vocab_size} tokens, not {vocab_size} (each of "
                f"their words is one token by then): a model trained on this data has a vocabulary of "
                f"{tok.vocab_size}")
        tok.save(staging / "tokenizer.json")
    dtype = token_dtype(tok.vocab_size)
    texts = {part: str(folder) for part, folder in folders.items()}
    manifest = {"source": source, "texts": texts[source] if source in texts else texts,
                "provenance": provenance(folders), "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
                "eot_id": tok.eot_id, "dtype": dtype.name, "fingerprint": fingerprint, "splits": {}}
    for split in SPLITS:
        file = f"{split}.bin"
        log(f"tokenising {split}: {counted(len(splits[split]), 'document')} "
            f"({listing([d.name for d in splits[split]], 8)})")
        tokens, bounds = encode_documents(tok, splits[split], dtype)
        atomic_write(staging / file, tokens.tofile)
        manifest["splits"][split] = {"file": file, "num_tokens": len(tokens), "documents": bounds}
    write_json(staging / "manifest.json", manifest)


def build_cache(directory: Path, folders: dict[str, Path], splits: dict[str, list[Document]], source: str,
                tokenizer: str, fingerprint: str, log, replace: bool = False) -> None:
    """Tokenise the splits into a staging folder beside ``directory``, then move it into place whole; an existing
    folder is replaced only when ``replace`` (``--rebuild``), else the first one published stays."""
    staging = staging_folder(directory)
    try:
        write_cache(staging, folders, splits, source, tokenizer, fingerprint, log)
    except OSError as error:  # a full disk: nothing half written stays behind
        shutil.rmtree(staging, ignore_errors=True)
        raise DataError(f"could not write the prepared data to {directory.parent} ({error}): free some space "
                        "there (or choose another --data-dir) and run it again") from error
    # --rebuild: the old folder goes only once the new one is complete. Without it, a folder that exists now was
    # published by another process meanwhile, which may be reading it: it stays (retiring it failed such a reader).
    if replace and directory.exists():
        retired = directory.with_name(f".{directory.name}.old{os.getpid()}")
        os.replace(directory, retired)
        shutil.rmtree(retired)
    try:
        os.replace(staging, directory)
    except OSError:  # another process published the same content first
        if not (directory / "manifest.json").is_file():
            raise
        shutil.rmtree(staging)


def tokens_by_part(data: TokenData) -> dict[str, tuple[int, int]]:
    """``{part: (documents, tokens)}`` of one split of a mix, each document's ``<|endoftext|>`` counted."""
    counts: dict[str, tuple[int, int]] = {}
    for doc in data.documents:
        documents, tokens = counts.get(part_of(doc["name"]), (0, 0))
        counts[part_of(doc["name"])] = (documents + 1, tokens + doc["end"] - doc["start"] + 1)
    return counts


def describe(prepared: Prepared) -> str:
    lines = [f"{prepared.directory}  (tokenizer {prepared.tokenizer.name}, vocab {prepared.tokenizer.vocab_size})"]
    for split in SPLITS:
        data = prepared.split(split)
        names = listing([d["name"] for d in data.documents], 12)
        lines.append(f"  {split:5s} {len(data):>10,d} tokens  {counted(len(data.documents), 'document')}: {names}")
        if mix_parts(prepared.manifest["source"]) is not None:
            for part, (documents, tokens) in tokens_by_part(data).items():
                lines.append(f"        {part:12s} {tokens:>10,d} tokens  {counted(documents, 'document')}")
    for source, record in prepared.manifest.get("provenance", {}).items():
        lines.append(f"  {source}: {json.dumps({k: v for k, v in record.items() if k != 'left_out'})}")
    return "\n".join(lines)
