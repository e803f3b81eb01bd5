"""Host-to-device transfer of a step's integer inputs: packed into one pinned host buffer (its int64
arrays, then its int32 arrays) and sent with a single non-blocking copy, so building step N+1 never
waits for the GPU to finish step N.

Pageable copies would each stage through a driver buffer (and a sync); seven of them per step were
most of the host time at batch 1, and each CUDA call made from Python costs host time even when it
is asynchronous (a copy ~8 us, an event record that looks up the current stream ~10 us on the
H100's host), hence one copy per step. Two pinned buffers alternate: the host packs one while the
copy out of the other may still be in flight, and an event says when a buffer is free again.

Each array of send() starts at a 16-byte boundary. Triton specializes a kernel on whether each
pointer argument is 16-byte aligned; packed back to back, a view's alignment followed the sizes of
the arrays before it, so a step could need a variant not compiled yet (~1.5 s of JIT mid-serving).
"""

from __future__ import annotations

import numpy as np
import torch

from fastllm.worker.streams import current_stream


class _PinnedBuffer:
    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.host = torch.empty(0, dtype=torch.uint8)
        self.bytes = self.host.numpy()
        self.copied = torch.cuda.Event() if pinned else None  # recorded after the last copy out of host
        self.in_flight = False

    def fill(self, arrays: list[np.ndarray], offsets: list[int], nbytes: int) -> torch.Tensor:
        """Write each array at its byte offset (in its own dtype); returns host[:nbytes]."""
        if self.in_flight:
            self.copied.synchronize()  # the copy out of this buffer two steps ago
            self.in_flight = False
        if nbytes > self.host.numel():
            size = max(nbytes, 2 * self.host.numel(), 4096)
            self.host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            self.bytes = self.host.numpy()
        for a, offset in zip(arrays, offsets):
            self.bytes[offset:offset + a.nbytes].view(a.dtype)[:] = a.ravel()
        return self.host[:nbytes]

    def copy_queued(self, device: torch.device) -> None:
        """Mark the copy out of host (just queued): the next fill waits for it."""
        if self.pinned:
            self.copied.record(current_stream(device))
            self.in_flight = True


def _as(arrays: list[np.ndarray], dtype) -> list[np.ndarray]:
    return [a if a.dtype == dtype else a.astype(dtype) for a in arrays]


def _layout(arrays: list[np.ndarray], start: int, align: int) -> tuple[list[int], int]:
    """Byte offsets of the arrays packed from `start`, each at a multiple of `align` bytes; and the end."""
    offsets, end = [], start
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // align) * align
    return offsets, end


class StepInputStager:
    """send(int64 arrays, int32 arrays) -> device tensors of the same shapes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._buffers = [_PinnedBuffer(self.cuda) for _ in range(2)]
        self._turn = 0

    def send(self, int64_arrays: list[np.ndarray], int32_arrays: list[np.ndarray]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        int64_arrays, int32_arrays = _as(int64_arrays, np.int64), _as(int32_arrays, np.int32)
        offsets64, split = _layout(int64_arrays, 0, 16)
        offsets32, end = _layout(int32_arrays, split, 16)
        buffer, host = self._pack(int64_arrays + int32_arrays, offsets64 + offsets32, end)
        # (on the CPU a clone: the buffer is refilled next-but-one step)
        flat = host.to(self.device, non_blocking=True) if self.cuda else host.clone()
        buffer.copy_queued(self.device)
        as64, as32 = flat[:split].view(torch.int64), flat[split:].view(torch.int32)
        offsets32 = [(o - split) // 4 for o in offsets32]  # in int32 elements of as32
        return ([as64[o // 8:o // 8 + a.size].view(a.shape) for a, o in zip(int64_arrays, offsets64)],
                [as32[o:o + a.size].view(a.shape) for a, o in zip(int32_arrays, offsets32)])

    def send_into(self, int64_arrays: list[np.ndarray], int32_arrays: list[np.ndarray], into: torch.Tensor,
                  int32_start: int) -> None:
        """Copy the int64 arrays back to back from byte 0 of `into` (a uint8 device buffer: a CUDA
        graph's static inputs, whose views were fixed at capture) and the int32 arrays from byte
        int32_start, in one copy; no views are made, each of which would cost host time."""
        int64_arrays, int32_arrays = _as(int64_arrays, np.int64), _as(int32_arrays, np.int32)
        offsets64, end64 = _layout(int64_arrays, 0, 8)
        assert end64 <= int32_start, "the int64 arrays overrun the int32 part"
        offsets32, end = _layout(int32_arrays, int32_start, 4)
        buffer, host = self._pack(int64_arrays + int32_arrays, offsets64 + offsets32, end)
        into[:end].copy_(host, non_blocking=self.cuda)
        buffer.copy_queued(self.device)

    def _pack(self, arrays: list[np.ndarray], offsets: list[int],
              nbytes: int) -> tuple[_PinnedBuffer, torch.Tensor]:
        """The arrays in this turn's buffer (the buffers alternate); returns it and its filled bytes."""
        buffer = self._buffers[self._turn]
        self._turn ^= 1
        return buffer, buffer.fill(arrays, offsets, nbytes)
