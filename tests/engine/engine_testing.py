"""Helpers for tests of the AsyncLLMEngine and the server over it, with the engine core on a thread of
the test process (AsyncLLMEngine(llm_engine)): wait until nothing is left on either side (then the KV
pool must be whole), and count the core's steps meanwhile."""

from __future__ import annotations

import contextlib
import time


def wait_idle(engine, timeout_s: float = 10.0) -> None:
    """Until the API side holds no request and the core has none left; then its block pool is whole."""
    deadline = time.monotonic() + timeout_s
    while engine.output_processor.groups or engine._streams or engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)
    engine.engine.check_kv_pool_whole()


@contextlib.contextmanager
def count_steps(engine):
    """steps[0]: the core steps taken so far (the core thread calls this wrapper)."""
    core = engine.engine.core
    steps, step = [0], core.step

    def counted():
        steps[0] += 1
        return step()
    core.step = counted
    try:
        yield steps
    finally:
        del core.step
