"""``python kill_during_checkpoint.py POINT train ...``: ``lavo train ...`` that SIGKILLs itself inside the
checkpoint of step 20, at POINT:

* ``weights``: half way through writing the new weights (a truncated temporary file);
* ``state``: the new weights written, half way through writing the training state;
* ``commit``: after ``state.pt`` committed the checkpoint, before its weights replace ``model.safetensors``.

Used by tests/test_faults.py; nothing in the package knows of it.
"""
import os
import signal
import sys
from pathlib import Path

import torch

from lavo import run
from lavo.cli import main

STEP = 20


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def truncate_and_die(path) -> None:
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)
    die()


def patch(point: str) -> None:
    atomic_write, replace = run.atomic_write, os.replace

    def reached(path: Path, tmp: Path) -> bool:
        """Whether ``tmp``, the temporary file of ``path``, holds step 20's weights or state, as ``point`` asks."""
        if point == "weights" and path.name == run.PENDING:
            return run.checkpoint_id(tmp)[0] == str(STEP)
        return point == "state" and path.name == run.STATE and torch.load(tmp, weights_only=True)["step"] == STEP

    def write_then_die(path, write):
        def written(tmp):
            write(tmp)
            if reached(Path(path), Path(tmp)):
                truncate_and_die(tmp)
        return atomic_write(path, written)

    def move(source, target):
        if point == "commit" and Path(source).name == run.PENDING and Path(target).name == run.WEIGHTS:
            if torch.load(Path(target).parent / run.STATE, weights_only=True)["step"] == STEP:
                die()
        replace(source, target)

    run.atomic_write, os.replace = write_then_die, move


if __name__ == "__main__":
    patch(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
