"""The scope in which our PDL kernels trigger early (pdl.py's mode 2, as under FASTLLM_PDL=trigger), for a small
model's latency-bound launches: each kernel lets the next one start as it starts. Kept apart from pdl.py so
the code that opens the scope (the speculative step) imports without Triton."""

from __future__ import annotations

import contextlib
import contextvars

_active = contextvars.ContextVar("pdl_early_triggers", default=False)


@contextlib.contextmanager
def early_triggers():
    """Kernels launched inside (a CUDA graph's capture included) trigger early where PDL is on at all."""
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)


def active() -> bool:
    return _active.get()
