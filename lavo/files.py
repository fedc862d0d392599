"""Writing files so that an interrupted process never leaves a half-written one: write a temporary file in the
same folder, then ``os.replace`` it over the target (atomic on POSIX)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` on a temporary path beside ``path``, then move it into place; on error the
    temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | os.PathLike, value: Any) -> Path:
    return write_text(path, json.dumps(value, indent=1) + "\n")
