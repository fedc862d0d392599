"""Stopping the running test's process as Ctrl-C, `timeout` or a job scheduler would."""
import os
import signal
import time


def stop_by(number: int) -> None:
    """Raise what Ctrl-C raises for SIGINT (a test worker may ignore the signal itself); for another signal, send
    it to this process and wait for its handler to raise."""
    if number == signal.SIGINT:
        raise KeyboardInterrupt
    os.kill(os.getpid(), number)
    time.sleep(5)  # the handler raises before this ends
