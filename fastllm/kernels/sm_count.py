"""The streaming-multiprocessor count that the kernels' launch tables size their grids by."""

from __future__ import annotations

import functools

import torch

INTERPRETER_SMS = 4  # what a CPU tensor (Triton's interpreter) pretends to run on


@functools.lru_cache(maxsize=None)
def _count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device (the current one when it has no index); INTERPRETER_SMS elsewhere."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _count(device.index if device.index is not None else torch.cuda.current_device())
