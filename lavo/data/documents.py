"""Documents (one per ``.txt`` file) and their split by whole documents: held-out texts are never
trained on.
"""
from __future__ import annotations

import hashlib
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "valid")
SKIPPED = "an empty or whitespace-only .txt file is not a document"


class DataError(RuntimeError):
    """A data problem the user can fix; the message says how."""


def listing(names: list[str], most: int) -> str:
    """The first ``most`` names, comma-separated, and how many more there are."""
    return ", ".join(names[:most]) + (f", ... ({len(names) - most} more)" if len(names) > most else "")


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def read_documents(directory: str | os.PathLike, log=None,
                   fix: str = "put one document per .txt file there (or use --source austen / --source shakespeare)"
                   ) -> list[Document]:
    """One document per ``.txt`` file of ``directory``, sorted by name; ``log`` is told of the files it leaves
    out (in subfolders, named ``.TXT``, or not a file: a folder or a dangling link); ``fix``: what the error of a
    folder without one says to do."""
    directory = Path(directory)
    # a folder or a dangling link named *.txt holds no text: it is left out and named, not read (an OSError)
    files = sorted(path for path in directory.glob("*.txt") if path.is_file())
    if not files:
        raise DataError(f"no .txt files in {directory}: {fix}")
    read = set(files)
    left_out = sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                      if p.suffix.lower() == ".txt" and p not in read)
    if left_out and log is not None:
        log(f"note: the documents are the .txt files directly in {directory}; not read: {listing(left_out, 5)}")
    documents = []
    for file in files:
        try:
            file.stem.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"the file name {file.name!r} in {directory} is not valid UTF-8: rename it") from None
        documents.append(Document(file.stem, read_text(file)))
    documents = [doc for doc in documents if doc.text.strip()]
    if not documents:
        raise DataError(f"every .txt file in {directory} is empty")
    return documents


def read_text(file: Path) -> str:
    """A UTF-8 text file's text, without the byte-order mark some editors write first (it would be a character of
    the first word, and would hide a copy of a training document from :func:`check_no_leak`)."""
    raw = file.read_bytes()
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise DataError(f"{file} is UTF-16 text: convert it to UTF-8, e.g. "
                        f"`iconv -f utf-16 -t utf-8 {file} -o {file}.new && mv {file}.new {file}`")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise DataError(f"{file} is not UTF-8 text ({error}): convert it, e.g. "
                        f"`iconv -f latin1 -t utf-8 {file} -o {file}.new && mv {file}.new {file}`") from error
    if "\0" in text:
        raise DataError(f"{file} holds NUL characters, which no text has: is it UTF-16 (convert it with "
                        "`iconv -f utf-16 -t utf-8`) or not text at all?")
    return text


def same_form(name: str) -> str:
    """``name`` in one Unicode form (NFC), to compare names: a file named on macOS spells "é" as two code points,
    a name typed on the command line as one."""
    return unicodedata.normalize("NFC", name)


def file_name_hint(missing: list[str], known: set[str]) -> str:
    """What to write instead of held-out names given as file names (``doc3.txt``, which names no document: a
    document is named by its file's name without ``.txt``), or nothing."""
    stems = [name[:-len(".txt")] for name in missing
             if name.lower().endswith(".txt") and same_form(name[:-len(".txt")]) in known]
    return f"; a document is named without .txt: hold out {', '.join(map(repr, stems))}" if stems else ""


def split_documents(documents: list[Document], holdout: list[str] | None = None
                    ) -> dict[str, list[Document]]:
    """Split by whole documents: ``holdout`` names go to ``valid``; by default the last ~10% (at least one)."""
    if len(documents) < 2:
        raise DataError(f"need at least 2 documents to split by document, got {len(documents)}: "
                        f"add more .txt files ({SKIPPED})")
    names = [d.name for d in documents]
    if holdout is None:
        holdout = names[-max(1, round(0.1 * len(names))):]
    known, held = {same_form(name) for name in names}, {same_form(name) for name in holdout}
    missing = [h for h in holdout if same_form(h) not in known]
    if missing:
        raise DataError(f"held-out documents {missing} are not in the source ({SKIPPED}); documents: "
                        f"{listing([repr(name) for name in names], 20)}{file_name_hint(missing, known)}")
    if len(held) >= len(names):
        raise DataError("every document is held out: leave at least one for training")
    splits = {"train": [d for d in documents if same_form(d.name) not in held],
              "valid": [d for d in documents if same_form(d.name) in held]}
    check_no_leak(splits)
    return splits


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def digests_of(documents: list[Document]) -> dict[str, str]:
    """``{document name: digest of its text}``."""
    return {doc.name: text_digest(doc.text) for doc in documents}


def document_digests(splits: dict[str, list[Document]]) -> dict[str, dict[str, str]]:
    """``{split: {document name: digest of its text}}``: what a run records of the documents it trained on and
    held out, so that later reads of its source can tell whether they are still those."""
    return {split: digests_of(documents) for split, documents in splits.items()}


def describe_changes(recorded: dict[str, str], now: dict[str, str]) -> str:
    """How the documents ``now`` differ from ``recorded`` (both ``{name: digest}``), e.g. ``"added a; edited b"``;
    empty when they are the same."""
    changes = [(what, names) for what, names in (
        ("added", [name for name in now if name not in recorded]),
        ("removed", [name for name in recorded if name not in now]),
        ("edited", [name for name in now if name in recorded and now[name] != recorded[name]])) if names]
    return "; ".join(f"{what} {listing(names, 8)}" for what, names in changes)


def check_no_leak(splits: dict[str, list[Document]]) -> None:
    """Refuse a held-out document whose text is also a training document's (a copy, or a link to the file)."""
    training = {text_digest(d.text): d.name for d in splits["train"]}
    for doc in splits["valid"]:
        twin = training.get(text_digest(doc.text))
        if twin is not None:
            raise DataError(f"held-out document {doc.name!r} has the same text as training document {twin!r} (a "
                            "copy, or a link to the same file): remove one, or the model trains on what it is "
                            "scored on")
