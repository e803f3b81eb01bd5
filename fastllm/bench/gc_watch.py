"""Garbage collections inside a measured window: how long each took, so a benchmark can say whether a slow
step was one. CPython calls gc.callbacks at the start and the end of every collection (automatic or
gc.collect()); the watch adds up their wall time."""

from __future__ import annotations

import gc
import time


class GCWatch:
    """with GCWatch() as watch: ...; watch.seconds: wall time inside collections so far."""

    def __init__(self):
        self.seconds = 0.0
        self._started: float | None = None  # (None: a collection under way when the watch began)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def __enter__(self) -> "GCWatch":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)
