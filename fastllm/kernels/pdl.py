"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A kernel launched with PDL (Hopper and newer) may start while the kernel before it in the stream is
still finishing, so its launch overlaps that kernel's tail; inside a CUDA graph the launch attribute
becomes a programmatic edge. Such a kernel calls `wait(USE_PDL)` (below; `tl.extra.cuda.gdc_wait()`)
before it reads anything the previous kernel may have written and before its first write (its output
may reuse memory the previous kernel still reads); gdc_wait returns once that kernel has completed and
its writes are visible. Reads of data no earlier kernel of the step writes (weights, the step's staged
inputs) may come before it.

On a decode step every one of our kernels follows a cuBLAS GEMM or another of ours: the norms, SiLU,
attention and the argmax are ~130 launch-bound kernels a step for an 8B model.
`FASTLLM_PDL=0` turns it off (the launches and results are otherwise the same). `FASTLLM_PDL=trigger` also
has each kernel let the next one launch as soon as it starts (see `wait`); end to end it was within noise
(docs/fp8.md), so it is off by default.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

logger = logging.getLogger("fastllm.kernels")


@functools.lru_cache(maxsize=None)
def _mode(device_index: int) -> int:
    """0: off; 1: PDL launch, each kernel waits; 2: also trigger (FASTLLM_PDL=trigger)."""
    setting = os.environ.get("FASTLLM_PDL", "1").strip()
    if os.environ.get("TRITON_INTERPRET") == "1":
        why, mode = "the Triton interpreter", 0
    elif setting == "0":
        why, mode = "FASTLLM_PDL=0", 0
    else:
        major, minor = torch.cuda.get_device_capability(device_index)
        why, mode = f"sm_{major}{minor}", (2 if setting == "trigger" else 1) if major >= 9 else 0
    logger.info("programmatic dependent launch %s for the decode-step kernels (%s)",
                ("off", "on", "on, with early triggers")[mode], why)
    return mode


def _device_mode(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return _mode(device.index if device.index is not None else torch.cuda.current_device())


def enabled(device: torch.device) -> bool:
    return _device_mode(device) > 0


def triggers(device: torch.device) -> bool:
    """Whether each kernel lets the next one launch as it starts (FASTLLM_PDL=trigger)."""
    return _device_mode(device) == 2


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch plus the USE_PDL constexpr (0 when PDL is off; see wait)."""
    mode = _device_mode(device)
    return {"launch_pdl": True, "USE_PDL": mode} if mode else {"USE_PDL": 0}


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """A PDL kernel's wait for the kernel before it (nothing when USE_PDL is 0). At USE_PDL 2 it first lets
    the next kernel launch: that one's programs may then start (e.g. prefetch weights) while this one
    runs, and its own wait still holds it until this kernel's writes are visible."""
    if USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
