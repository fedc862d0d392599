"""What a ``source`` names (a built-in corpus, a mix of them joined by ``+``, or a folder of ``.txt`` files), and
its documents split into training and held-out ones.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .corpora import BUILTIN_SOURCES, PROVENANCE
from .documents import SPLITS, DataError, Document, describe_changes, digests_of, read_documents, split_documents

MIX = "+"  # joins the built-in sources of a mix: "austen+shakespeare+python"


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
        return BUILTIN_SOURCES[source][0](root, log)
    check_source(source)
    return Path(source)


def check_source(source: str) -> None:
    """Refuse a ``source`` that is neither a built-in corpus, a mix of them, nor a directory: the check that
    needs no download, which training makes before any other."""
    if not is_builtin(source) and not Path(source).is_dir():
        raise DataError(f"data source {source!r} is neither a built-in corpus ({', '.join(BUILTIN_SOURCES)}), "
                        f"a mix of them joined by '{MIX}', nor a directory of .txt files")


def source_splits(source: str, data_dir: str | os.PathLike, holdout: list[str] | None, fetch: bool = True,
                  log=print) -> tuple[dict[str, list[Document]], dict[str, Path]]:
    """The documents of ``source`` split by :func:`split_documents` (``holdout`` None: the source's default
    held-out documents), a mix's named ``part/name``; and the texts folder of each part (``{source: folder}``
    for a source that is not a mix)."""
    parts = mix_parts(source)
    if parts is None:
        texts = source_texts(source, data_dir, fetch=fetch, log=log)
        # a folder of the user's own is told of the files it leaves out; the built-in corpora leave none by chance
        documents, folders = read_documents(texts, None if is_builtin(source) else log), {source: texts}
    else:
        folders = {part: source_texts(part, data_dir, fetch=fetch, log=log) for part in parts}
        documents = [Document(f"{part}/{doc.name}", doc.text)
                     for part in parts for doc in read_documents(folders[part])]
    return split_documents(documents, default_holdout(source) if holdout is None else holdout), folders


def read_split(source: str, data_dir: str | os.PathLike, holdout: list[str] | None, split: str,
               parts: list[str] | None = None, recorded: dict[str, str] | None = None) -> list[Document]:
    """The documents of one split of ``source`` as they are now. ``parts`` keeps only the documents of those parts
    of a mix (e.g. the held-out code of ``"austen+python"``). ``recorded``: the split's document digests as a run
    recorded them (:func:`~lavo.data.documents.document_digests`); documents that differ from them are refused."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    documents = source_splits(source, data_dir, holdout, fetch=False)[0][split]
    if recorded is not None:
        changes = describe_changes(recorded, digests_of(documents))
        if changes:
            raise DataError(f"the {split} documents of {source} are not those the run recorded: {changes}")
    return documents if parts is None else only_parts(documents, source, parts)


def part_of(name: str) -> str | None:
    """The part of a mix a document of it comes from (``"python/difflib"`` -> ``"python"``)."""
    return name.split("/", 1)[0] if "/" in name else None


def check_parts(source: str, parts: list[str]) -> None:
    """Refuse ``parts`` that are not parts of the mix ``source``."""
    mixed = mix_parts(source) or []
    unknown = [part for part in parts if part not in mixed]
    if unknown:
        verb = "is not a part" if len(unknown) == 1 else "are not parts"
        raise DataError(f"{', '.join(unknown)} {verb} of the source {source!r}"
                        + (f" (its parts: {', '.join(mixed)})" if mixed else " (it is not a mix)"))


def only_parts(documents: list[Document], source: str, parts: list[str]) -> list[Document]:
    """The documents of a mix that come from ``parts``."""
    check_parts(source, parts)
    return [doc for doc in documents if part_of(doc.name) in parts]


def provenance(folders: dict[str, Path]) -> dict[str, dict]:
    """What each built-in source recorded about where its texts came from (the ``python`` source: the
    interpreter's version), by source."""
    found = {}
    for source, texts in folders.items():
        record = texts.parent / PROVENANCE
        if source in BUILTIN_SOURCES and record.is_file():
            found[source] = json.loads(record.read_text())
    return found
