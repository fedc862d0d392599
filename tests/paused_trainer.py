"""``python paused_trainer.py STEP GATE train ...``: ``lavo train ...`` that, once step STEP is done, waits before
the next step until the file GATE exists, and creates ``GATE.waiting`` when it starts waiting. A test signals or
kills it there, at a known step, however fast or slow the machine is.

Used by tests/test_faults.py; nothing in the package knows of it.
"""
import sys
import time
from pathlib import Path

from lavo.cli import main
from lavo.train import Trainer


def waiting_file(gate: Path) -> Path:
    return gate.with_name(gate.name + ".waiting")


def pause(step: int, gate: Path) -> None:
    train_step = Trainer.train_step

    def paused(self, lr):
        # inside the next step, past every check of the one before: a signal sent now is seen after this step
        if self.progress.step == step:
            waiting_file(gate).touch()
            while not gate.exists():
                time.sleep(0.01)
        return train_step(self, lr)

    Trainer.train_step = paused


if __name__ == "__main__":
    pause(int(sys.argv[1]), Path(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
