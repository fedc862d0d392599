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
    save_file, torch_save, replace = run.save_file, torch.save, os.replace

    def weights(tensors, path, metadata=None):
        save_file(tensors, path, metadata=metadata)
        if point == "weights" and metadata["step"] == str(STEP):
            truncate_and_die(path)

    def state(value, path, *args, **kwargs):
        torch_save(value, path, *args, **kwargs)
        if point == "state" and value["step"] == STEP:
            truncate_and_die(path)

    def move(source, target):
        if point == "commit" and Path(source).name == run.PENDING and Path(target).name == run.WEIGHTS:
            if torch.load(Path(target).parent / run.STATE, weights_only=True)["step"] == STEP:
                die()
        replace(source, target)

    run.save_file, torch.save, os.replace = weights, state, move


if __name__ == "__main__":
    patch(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
