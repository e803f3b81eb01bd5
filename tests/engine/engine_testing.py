"""Helpers for tests of the AsyncLLMEngine and the server over it: wait for the engine thread to go
idle (then the KV pool must be whole), and count the steps it takes meanwhile."""

from __future__ import annotations

import contextlib
import time


def wait_idle(engine, timeout_s: float = 5.0) -> None:
    """Until the AsyncLLMEngine has no request and no queued command; then its block pool is whole."""
    deadline = time.monotonic() + timeout_s
    while engine.engine.has_unfinished_requests() or not engine._commands.empty():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)
    engine.engine.check_kv_pool_whole()


@contextlib.contextmanager
def count_steps(engine):
    """steps[0]: the engine steps taken so far (the engine thread calls this wrapper)."""
    steps, step = [0], engine.engine.step

    def counted():
        steps[0] += 1
        return step()
    engine.engine.step = counted
    try:
        yield steps
    finally:
        del engine.engine.step
