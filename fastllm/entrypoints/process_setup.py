"""Process-wide settings the `fastllm` commands and the server choose for their own process (the library
never changes them on import or construction): the garbage collector and torch's CPU threads.

The garbage collector: startup objects frozen, collection thresholds raised. Reference counting frees
almost everything a step allocates; the collector only breaks cycles, and each collection stops the
engine loop. Two things made it cost decode steps:
- Startup leaves millions of long-lived objects (torch.compile's graphs and guards); a full
  collection walking them stalled steps by tens of ms. Frozen, they are never walked.
- At CPython's default gen-0 threshold (700) a batch-256 decode step crossed it about three times
  with objects that die within the step, and every collection promoted the step in flight to older
  generations, which fed gen-1 and gen-2 collections of 5-14 ms on the H100's host (the p99 of
  the step). With the threshold at 20,000 a 150-step batch-256 run collected nothing.
FASTLLM_GC_THRESHOLD=a[,b[,c]] sets other thresholds (gc.set_threshold's; 700,10,10 is CPython's).

CPU threads: a tiny model's ops are too small for torch's intra-op threads to pay, and on a busy machine
each op's threads wait for one another; such models run with one thread (see set_cpu_threads).
OMP_NUM_THREADS, when set, is left to decide.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os

from fastllm.config import EngineConfig

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


def prepare_gc_for_serving(threshold: tuple[int, ...] | None = None) -> None:
    """Freeze what startup left alive and set the collection thresholds (read_gc_threshold's by default;
    logged when they change). Call once the engine is built."""
    threshold = threshold or read_gc_threshold()
    gc.collect()
    gc.freeze()
    if gc.get_threshold()[:len(threshold)] != threshold:
        gc.set_threshold(*threshold)
        logger.info("garbage collector: thresholds %s (FASTLLM_GC_THRESHOLD), startup objects frozen",
                    ",".join(map(str, gc.get_threshold())))
    if not getattr(prepare_gc_for_serving, "registered", False):
        prepare_gc_for_serving.registered = True
        atexit.register(gc.unfreeze)  # the exit-time collection may free them (bindings check for leaks)


# A model whose largest matmul (hidden x intermediate) is below this runs with one torch thread on the CPU.
TINY_MATMUL = 2**20


def set_cpu_threads(config: EngineConfig) -> None:
    """One torch thread for a tiny model on the CPU, unless OMP_NUM_THREADS says otherwise (logged)."""
    if "OMP_NUM_THREADS" in os.environ or config.device == "cuda":
        return
    import torch

    if config.device == "auto" and torch.cuda.is_available():
        return
    hf = config.model.hf_config
    if hf.get("hidden_size", 0) * hf.get("intermediate_size", 0) < TINY_MATMUL and torch.get_num_threads() > 1:
        logger.info("CPU: a tiny model runs with one torch thread (of %d; OMP_NUM_THREADS sets it)",
                    torch.get_num_threads())
        torch.set_num_threads(1)
