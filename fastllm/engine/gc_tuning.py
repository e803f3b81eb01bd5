"""The engine process's garbage collector: startup objects frozen, collection thresholds raised.

Reference counting frees almost everything a step allocates; the collector only breaks cycles, and
each collection stops the engine loop. Two things made it cost decode steps:
- Startup leaves millions of long-lived objects (torch.compile's graphs and guards); a full
  collection walking them stalled steps by tens of ms. Frozen, they are never walked.
- At CPython's default gen-0 threshold (700) a batch-256 decode step crossed it about three times
  with objects that die within the step, and every collection promoted the step in flight to older
  generations, which fed gen-1 and gen-2 collections of 5-14 ms on the H100's host (the p99 of
  the step). With the threshold at 20,000 a 150-step batch-256 run collected nothing.
FASTLLM_GC_THRESHOLD=a[,b[,c]] sets other thresholds (gc.set_threshold's; 700,10,10 is CPython's).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLD = (20_000, 50, 50)


def read_gc_threshold() -> tuple[int, ...]:
    """The thresholds asked for: FASTLLM_GC_THRESHOLD, else DEFAULT_THRESHOLD. ValueError if malformed."""
    text = os.environ.get("FASTLLM_GC_THRESHOLD", "").strip()
    if not text:
        return DEFAULT_THRESHOLD
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values):
        raise ValueError(f"FASTLLM_GC_THRESHOLD must be 1 to 3 non-negative integers (gc.set_threshold's), "
                         f"got {text!r}")
    return values


def prepare_gc_for_serving(threshold: tuple[int, ...]) -> None:
    """Freeze what startup left alive and set the collection thresholds (logged when they change)."""
    gc.collect()
    gc.freeze()
    if gc.get_threshold()[:len(threshold)] != threshold:
        gc.set_threshold(*threshold)
        logger.info("garbage collector: thresholds %s (FASTLLM_GC_THRESHOLD), startup objects frozen",
                    ",".join(map(str, gc.get_threshold())))
    if not getattr(prepare_gc_for_serving, "registered", False):
        prepare_gc_for_serving.registered = True
        atexit.register(gc.unfreeze)  # the exit-time collection may free them (bindings check for leaks)
