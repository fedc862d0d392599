"""Documents (one per ``.txt`` file) and their split by whole documents: held-out texts are never
trained on.
"""
from __future__ import annotations

import hashlib
import os
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


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def document_digests(splits: dict[str, list[Document]]) -> dict[str, dict[str, str]]:
    """``{split: {document name: digest of its text}}``: what a run records of the documents it trained on and
    held out, so that later reads of its source can tell whether they are still those."""
    return {split: {doc.name: text_digest(doc.text) for doc in documents} for split, documents in splits.items()}


def changed_documents(recorded: dict[str, str], now: dict[str, str]) -> str:
    """How the documents ``now`` differ from ``recorded`` (both ``{name: digest}``), e.g. ``"added a; edited b"``;
    empty when they are the same."""
    changes = [(what, names) for what, names in (
        ("added", [name for name in now if name not in recorded]),
        ("removed", [name for name in recorded if name not in now]),
        ("edited", [name for name in now if name in recorded and now[name] != recorded[name]])) if names]
    return "; ".join(f"{what} {listing(names, 8)}" for what, names in changes)


def check_no_leak(splits: dict[str, list[Document]]) -> None:
    """Refuse a held-out document whose text is also a training document's (a copy, or a link to the file)."""
    training = {hashlib.sha256(d.text.encode()).digest(): d.name for d in splits["train"]}
    for doc in splits["valid"]:
        twin = training.get(hashlib.sha256(doc.text.encode()).digest())
        if twin is not None:
            raise DataError(f"held-out document {doc.name!r} has the same text as training document {twin!r} (a "
                            "copy, or a link to the same file): remove one, or the model trains on what it is "
                            "scored on")
