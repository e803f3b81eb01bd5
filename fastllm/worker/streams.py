"""The engine's CUDA streams: the one its work runs on, and a cheap lookup of the current one.

engine_stream: a stream of the engine's own for each device, not the default stream. Every Worker call
(loading, the profiling run, KV allocation, capture, steps) runs with it current, and the CUDA graphs are
captured on it. Once several streams of a process have run work, every graph replay pays more a launch for
the rest of the process; with one engine stream for everything the engine's process stays short of that
(docs/speculative_decoding.md, "CUDA streams and the step's launches" and "The engine stream").

current_stream: the stream this thread queues work on now, where a step's events belong (runners and
stagers also run outside a Worker, in tests, on the default stream). torch.cuda.current_stream() builds a
Stream object on every call, host time on every step; this looks the stream up by its raw handle, as
Triton's launches do.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_by_handle: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device index, raw handle) -> its stream


def engine_stream(device: torch.device) -> torch.cuda.Stream:
    """The (CUDA) device's engine stream, made once ("cuda" without an index: the current device's)."""
    return _engine_stream(_index(device))


@functools.cache
def _engine_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def on_engine_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """The engine stream current in this thread for the block (nothing off CUDA)."""
    return _OnStream(engine_stream(device)) if device.type == "cuda" else contextlib.nullcontext()


class _OnStream:
    """torch.cuda.stream(stream) by the streams' ids: it runs around every step, and torch's builds Stream
    and device objects for the streams it replaces. Setting a stream also makes its device current, so the
    stream's device's previous stream (where that is not the current device) is set back first, then the
    current device's, which makes that device current again."""

    __slots__ = ("ids", "saved")

    def __init__(self, stream: torch.cuda.Stream):
        self.ids = (stream.stream_id, stream.device_index, stream.device_type)

    def __enter__(self) -> None:
        here, there = torch._C._cuda_getDevice(), self.ids[1]
        self.saved = [torch._C._cuda_getCurrentStream(there)]
        if here != there:
            self.saved.append(torch._C._cuda_getCurrentStream(here))
        torch._C._cuda_setStream(*self.ids)

    def __exit__(self, *exc) -> None:
        for ids in self.saved:
            torch._C._cuda_setStream(*ids)


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's current stream on the (CUDA) device."""
    index = _index(device)
    key = (index, torch._C._cuda_getCurrentRawStream(index))  # (the default stream is 0 on every device)
    stream = _by_handle.get(key)
    if stream is None:
        stream = _by_handle[key] = torch.cuda.current_stream(index)
    return stream
