"""Writing files so that an interrupted process never leaves a half-written one: write a temporary file in the
same folder, flush it to disk, then ``os.replace`` it over the target (atomic on POSIX).

A process killed mid-write (``kill -9``, power loss) leaves its temporary file ``.NAME.tmpPID`` behind;
:func:`remove_orphans` deletes those whose process is gone.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

TEMPORARY = re.compile(r"\..+\.(?:tmp|old)(\d+)")  # a file or folder being written, or one being retired


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's (or a folder's) contents to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` on a temporary path beside ``path``, then move it into place; on error the
    temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        give_default_mode(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)  # the rename itself
    return path


@functools.cache
def current_umask() -> int:
    """The process's umask, read once: reading it means setting it, for a moment in which another thread's new
    file would get the wrong mode."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def give_default_mode(path: str | os.PathLike) -> None:
    """Give ``path`` the permissions ``open()`` gives a new file (safetensors creates its files 0600, which
    hides a shared run's or model's weights from other users)."""
    os.chmod(path, 0o666 & ~current_umask())


def make_directory(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a directory, made with its parents where missing; a file in its place or a parent's is
    named in a ``ValueError`` that starts with ``what``."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = next(parent for parent in (path, *path.parents) if parent.exists() or parent.is_symlink())
        kind = "a file" if blocking.exists() else "a broken link"
        raise ValueError(f"{what} {path} cannot be a directory: {blocking} is {kind}") from None
    return path


@contextlib.contextmanager
def locked_folder(folder: str | os.PathLike):
    """Hold ``fcntl.flock`` on ``folder`` while the block runs (another process waits its turn), so that a
    read-change-write of a file in it sees no other meanwhile; a lock on the folder leaves no lock file behind,
    and the operating system releases it however the process ends."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        except OSError as error:  # a filesystem without flock (some network and FUSE ones): the block runs unlocked
            if error.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(descriptor)


def write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | os.PathLike, value: Any) -> Path:
    return write_text(path, json.dumps(value, indent=1) + "\n")


def read_saved_state(path: str | os.PathLike, what: str, advice: str, error: type[Exception] = ValueError) -> Any:
    """``torch.load`` a training state this package saved, onto the CPU; ``weights_only=True``, so a file from
    elsewhere can hold no code to run. A damaged or foreign file raises ``error``: ``PATH is not WHAT (reason);
    ADVICE``."""
    import torch
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as failure:  # a damaged file raises pickle, zip, EOF or runtime errors
        raise error(f"{path} is not {what} ({type(failure).__name__}: {failure}); {advice}") from failure


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_orphans(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files and staging folders (``.NAME.tmpPID``) and the retired folders
    (``.NAME.oldPID``) in ``directory`` whose process no longer exists (those of running processes are left
    alone); return what was deleted."""
    directory = Path(directory)
    removed = []
    for path in directory.glob(".*") if directory.is_dir() else []:
        match = TEMPORARY.fullmatch(path.name)
        if match and not process_exists(int(match.group(1))):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def staging_folder(final: Path) -> Path:
    """An empty folder ``.NAME.tmpPID`` beside ``final``, to fill and then move into place whole; the staging
    folders a killed process left there go first (:func:`remove_orphans`)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(final.parent)
    staging = final.with_name(f".{final.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging
