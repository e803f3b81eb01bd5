"""Two independent launch sequences side by side: one on a side stream, the other on the current stream.

A mixed step's cascade attention: the shared-prefix kernel and the suffix (prefill) kernel read the same
inputs and write different outputs, and each alone leaves SMs idle (few programs, short loops); as two
branches (of the CUDA graph, when captured: the side stream joins the capture through the fork's event)
they overlap.

The side branch's tensors come from the side stream's pool and are used on the current stream after the
join, with no record_stream: safe because every fork first waits for the current stream, so the side
stream never runs (and reuses a freed block) ahead of work queued on the current stream before the fork.
Off CUDA (the references, the Triton interpreter) the two run one after the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

A = TypeVar("A")
B = TypeVar("B")
_streams: dict[int, torch.cuda.Stream] = {}  # device index -> its side stream


def fork_join(side: Callable[[], A], main: Callable[[], B], device: torch.device) -> tuple[A, B]:
    """(side(), main()): on CUDA, side's launches on the side stream, main's on the current stream, then
    the current stream waits for both."""
    if device.type != "cuda":
        return side(), main()
    current = torch.cuda.current_stream(device)
    stream = _streams.get(current.device_index)
    if stream is None:
        stream = _streams[current.device_index] = torch.cuda.Stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        side_result = side()
    main_result = main()
    current.wait_stream(stream)
    return side_result, main_result
