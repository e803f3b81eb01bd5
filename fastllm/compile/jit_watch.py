"""Kernels and graphs compiled inside a measured window: a benchmark's, or a serving engine's steps.

A kernel variant first met mid-run costs a JIT compile (~1.5 s for the prefill kernel on a cold
cache) that lands in the timed window and looks like a slow step. The benchmarks record these, so
a run that paid for compiles says so instead of just being slow (a `jit` column, and a note on
the row's line). Triton calls knobs.runtime.jit_post_compile_hook after compiling a variant it did
not have in memory (also when the binary came from its disk cache); a hook already set is called
in turn. A Triton without that hook counts nothing, and the log says so once. torch.compile's compiles
are read from dynamo's counters (dynamo_graphs).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


def _knobs():
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs if hasattr(getattr(knobs, "runtime", None), "jit_post_compile_hook") else None


class TritonCompileWatch:
    """with TritonCompileWatch() as watch: ...; watch.compiles: [(kernel name, seconds into the window)]."""

    _said_unavailable = False

    def __init__(self):
        self.compiles: list[tuple[str, float]] = []
        self._knobs = _knobs()
        self._previous = None
        self._start = 0.0

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        self.compiles.append((getattr(fn, "name", repr(fn)), time.perf_counter() - self._start))
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    def start(self) -> "TritonCompileWatch":
        """Watch from now on, for good (the engine's steps)."""
        return self.__enter__()

    def __enter__(self) -> "TritonCompileWatch":
        self._start = time.perf_counter()
        if self._knobs is None:
            if not TritonCompileWatch._said_unavailable:
                TritonCompileWatch._said_unavailable = True
                logger.info("this Triton has no jit_post_compile_hook: mid-run kernel compiles are not counted")
            return self
        self._previous = self._knobs.runtime.jit_post_compile_hook
        self._knobs.runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._previous


_process_watch: TritonCompileWatch | None = None


def process_watch() -> TritonCompileWatch:
    """One watch for the whole process, started on first use: every engine reads it (a hook per engine
    would chain one call per engine ever built into each compile)."""
    global _process_watch
    if _process_watch is None:
        _process_watch = TritonCompileWatch().start()
    return _process_watch


_dynamo_counters = None


def dynamo_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (a recompile mid-run adds one). Read at every
    engine step, so dynamo's counters are imported once (their dict, which torch._dynamo.reset clears in
    place)."""
    global _dynamo_counters
    if _dynamo_counters is None:
        from torch._dynamo.utils import counters

        _dynamo_counters = counters
    return _dynamo_counters["stats"]["unique_graphs"]
