"""Ctrl-C and a multi-process engine's steps.

The ranks of tensor and pipeline parallelism run each step's collectives together. If rank 0 left a step
halfway (a KeyboardInterrupt inside its forward or between its messages to the workers), the workers would go
on waiting in that step's collectives and every later collective would pair with the wrong one. So a first
Ctrl-C during a step raises once the step is done, with every rank in step; a second one raises at once, and
the executor then refuses further steps (MultiprocExecutor: interrupted inside a step).
"""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupt_after_step():
    """Defer SIGINT's KeyboardInterrupt to the end of the block (the main thread, under Python's own handler;
    elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pending = []

    def handler(signum, frame):
        if pending:  # a second Ctrl-C: now
            raise KeyboardInterrupt
        pending.append(signum)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException:
        if pending:  # the block failed too: the Ctrl-C still stops the caller, the error its context
            raise KeyboardInterrupt
        raise
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt
