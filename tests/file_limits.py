"""A real write failure for the tests, as a full disk gives one: files may not grow past a size."""
import contextlib
import resource
import signal


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """While entered, a write that would make any file longer than ``nbytes`` fails with ``EFBIG`` (``OSError``,
    ``File too large``) in whatever library writes it."""
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
