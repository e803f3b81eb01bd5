"""One GPU shared by `pytest -n` workers: a readers-writer lock over files, so that a `whole_gpu` test (an
engine whose profiling run sizes its KV cache to most of the card) runs with no other GPU test beside it,
while the other GPU tests run side by side.

Every GPU test holds the main lock shared, a whole_gpu test holds it exclusively. flock grants a shared lock
while an exclusive one waits, so a writer alone would wait until the other workers ran out of tests (past the
per-test timeout); it first takes the turnstile exclusively, which the readers pass through (shared, then
released) before they take the main lock, so new readers queue behind it and it waits only for the tests
already running.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile

LOCK_DIR = tempfile.gettempdir()


@contextlib.contextmanager
def _flock(path: str, operation: int):
    with open(path, "a") as f:
        fcntl.flock(f, operation)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def gpu_lock(exclusive: bool, directory: str = LOCK_DIR):
    """Hold the GPU shared (exclusive=False) or alone (True) for the body."""
    main = os.path.join(directory, "fastllm-gpu-tests.lock")
    turnstile = os.path.join(directory, "fastllm-gpu-tests.turnstile")
    if exclusive:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(main, fcntl.LOCK_EX):
            yield
    else:
        with _flock(turnstile, fcntl.LOCK_SH):
            pass
        with _flock(main, fcntl.LOCK_SH):
            yield
