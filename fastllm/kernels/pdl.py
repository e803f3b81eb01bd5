"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A kernel launched with PDL (Hopper and newer) may start while the kernel before it in the stream is
still finishing, so its launch overlaps that kernel's tail; inside a CUDA graph the launch attribute
becomes a programmatic edge. Such a kernel calls `tl.extra.cuda.gdc_wait()` (when its USE_PDL is set)
before it reads anything the previous kernel may have written and before its first write (its output
may reuse memory the previous kernel still reads); gdc_wait returns once that kernel has completed and
its writes are visible. Reads of data no earlier kernel of the step writes (weights, the step's staged
inputs) may come before it.

On a decode step every one of our kernels follows a cuBLAS GEMM or another of ours: the norms, SiLU,
attention and the argmax are ~130 launch-bound kernels a step for an 8B model.
`FASTLLM_PDL=0` turns it off (the launches and results are otherwise the same).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger("fastllm.kernels")


@functools.lru_cache(maxsize=None)
def _enabled(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        why, on = "the Triton interpreter", False
    elif os.environ.get("FASTLLM_PDL", "1").strip() == "0":
        why, on = "FASTLLM_PDL=0", False
    else:
        major, minor = torch.cuda.get_device_capability(device_index)
        why, on = f"sm_{major}{minor}", major >= 9
    logger.info("programmatic dependent launch %s for the decode-step kernels (%s)",
                "on" if on else "off", why)
    return on


def enabled(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _enabled(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch plus the USE_PDL constexpr: {} when PDL is off."""
    return {"launch_pdl": True, "USE_PDL": True} if enabled(device) else {"USE_PDL": False}
