"""Host-to-device transfer of a step's integer inputs: packed into pinned memory and sent with one
non-blocking copy per dtype, so building step N+1 never waits for the GPU to finish step N.

Pageable copies would each stage through a driver buffer (and a sync); seven of them per step were
most of the host time at batch 1. Two pinned buffers alternate: the host packs one while the copy
out of the other may still be in flight, and an event says when a buffer is free again.

Each array of send() starts at a 16-byte boundary. Triton specializes a kernel on whether each
pointer argument is 16-byte aligned; packed back to back, a view's alignment followed the sizes of
the arrays before it, so a step could need a variant not compiled yet (~1.5 s of JIT mid-serving).
"""

from __future__ import annotations

import numpy as np
import torch


class _PinnedBuffer:
    def __init__(self, dtype: torch.dtype, pinned: bool):
        self.dtype, self.pinned = dtype, pinned
        self.host = torch.empty(0, dtype=dtype)
        self.copied: torch.cuda.Event | None = None  # recorded after the last copy out of host (shared)

    def fill(self, arrays: list[np.ndarray], align: int) -> tuple[list[int], int]:
        """Pack the arrays, each from a multiple of `align` elements; returns their offsets and the
        elements used."""
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.size // align) * align
        if self.copied is not None:
            self.copied.synchronize()  # the copy out of this buffer two steps ago
        if total > self.host.numel():
            self.host = torch.empty(max(total, 2 * self.host.numel(), 1024), dtype=self.dtype, pin_memory=self.pinned)
        flat = self.host.numpy()
        for a, offset in zip(arrays, offsets):
            flat[offset:offset + a.size] = a.ravel()
        return offsets, total


class StepInputStager:
    """send(int64 arrays, int32 arrays) -> device tensors of the same shapes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._buffers = [{dt: _PinnedBuffer(dt, self.cuda) for dt in (torch.int64, torch.int32)} for _ in range(2)]
        self._turn = 0

    def send(self, int64_arrays: list[np.ndarray], int32_arrays: list[np.ndarray]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        out = []
        for (flat, offsets), arrays in zip(self._copy(int64_arrays, int32_arrays, aligned=True),
                                           (int64_arrays, int32_arrays)):
            out.append([flat[o:o + a.size].view(a.shape) for a, o in zip(arrays, offsets)])
        return out[0], out[1]

    def send_into(self, int64_arrays: list[np.ndarray], int32_arrays: list[np.ndarray],
                  into: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy the arrays back to back into the (int64, int32) device buffers from offset 0 (a CUDA
        graph's static inputs, whose views were fixed at capture); no views are made, each of which
        would cost host time."""
        self._copy(int64_arrays, int32_arrays, aligned=False, into=into)

    def _copy(self, int64_arrays, int32_arrays, aligned: bool, into=None) -> list[tuple[torch.Tensor, list[int]]]:
        buffers = self._buffers[self._turn]
        self._turn ^= 1
        flats = []
        for k, (dtype, arrays) in enumerate(((torch.int64, int64_arrays), (torch.int32, int32_arrays))):
            buffer = buffers[dtype]
            offsets, total = buffer.fill(arrays, 16 // dtype.itemsize if aligned else 1)
            if into is not None:
                flat = into[k][:total]
                flat.copy_(buffer.host[:total], non_blocking=self.cuda)
            elif self.cuda:
                flat = buffer.host[:total].to(self.device, non_blocking=True)
            else:
                flat = buffer.host[:total].clone()  # the buffer is refilled next-but-one step
            flats.append((flat, offsets))
        if self.cuda:  # one event for both copies
            copied = torch.cuda.Event()
            copied.record()
            for buffer in buffers.values():
                buffer.copied = copied
        return flats
