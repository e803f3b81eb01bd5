"""Time tensor-parallel all-reduces at given message sizes, in the steady state of a decode step.

On a GPU the calls run back to back inside one CUDA graph (as a decode step replays them: no launch
cost from the host), after a warm-up outside it; the time per call is the graph's time over the call
count, the median of a few replays. On the CPU (gloo) a plain loop is timed. Every rank of the group
must call these at once, with the same sizes.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

CALLS_PER_GRAPH = 32
REPLAYS = 5


def time_calls(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """Milliseconds per call of fn(x), steady state."""
    for _ in range(3):
        fn(x)
    if x.device.type != "cuda":
        start = time.perf_counter()
        for _ in range(CALLS_PER_GRAPH):
            fn(x)
        return (time.perf_counter() - start) * 1e3 / CALLS_PER_GRAPH
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn(x)
    graph.replay()  # the first replay uploads the graph
    times = []
    for _ in range(REPLAYS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / CALLS_PER_GRAPH)
    return statistics.median(times)


def time_all_reduce(group, dtype: torch.dtype, sizes: list[int]) -> list[float]:
    """Milliseconds per all-reduce of each size in bytes through the group's own path (one-shot or
    NCCL by size, as the model's all-reduces take it)."""
    return [time_calls(group.all_reduce, torch.randn(size // dtype.itemsize, device=group.device).to(dtype))
            for size in sizes]
