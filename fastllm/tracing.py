"""Named NVTX ranges around the engine's phases, for Nsight Systems and the torch profiler.

Off by default and then free: `nvtx_range` returns a shared no-op context. enable_nvtx() turns
them on (fastllm bench --nvtx); layer ranges (--nvtx-layers) are a second, finer switch.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)

_NULL = contextlib.nullcontext()
_enabled = False
_layers_enabled = False


def enable_nvtx(layers: bool = False) -> None:
    global _enabled, _layers_enabled
    _enabled, _layers_enabled = True, layers
    if not torch.cuda.is_available():
        logger.info("NVTX ranges are on but there is no GPU: they show only in torch profiler traces")


def nvtx_enabled() -> bool:
    return _enabled


def layer_ranges_enabled() -> bool:
    return _enabled and _layers_enabled


def nvtx_range(name: str):
    """A context manager marking `name` in Nsight timelines and torch profiler traces."""
    if not _enabled:
        return _NULL
    return _Range(name)


class _Range:
    __slots__ = ("name", "_record")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_push(self.name)
        self._record = torch.profiler.record_function(self.name)
        self._record.__enter__()
        return self

    def __exit__(self, *exc):
        self._record.__exit__(*exc)
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_pop()
        return False
