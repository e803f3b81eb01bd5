"""Zeroed int32 counters for kernels whose last program to finish a group merges the group's partials
(decode attention's KV splits, skinny_linear's K splits): each program counts itself done with an atomic,
and the one that counts last merges and sets the counter back to 0 for the next launch."""

from __future__ import annotations

import torch

_buffers: dict[tuple[str, torch.device], list[torch.Tensor]] = {}  # (owner, device) -> buffers, largest last


def split_counters(owner: str, device: torch.device, n: int) -> torch.Tensor:
    """n int32 zeros that `owner`'s kernel leaves zeroed again. A larger request adds a buffer and keeps the
    old ones: a captured CUDA graph holds the address it was captured with.

    One buffer serves every launch of one owner on the device, so those launches must not overlap: one
    stream per device (the engine's)."""
    buffers = _buffers.setdefault((owner, device), [])
    if not buffers or buffers[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a zero fill recorded into a graph would not have run before the first replay's atomics
            raise RuntimeError(f"{owner}'s split counters must be allocated before CUDA-graph capture: run the "
                               "launch once outside the capture first")
        buffers.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return buffers[-1]
