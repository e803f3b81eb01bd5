"""SiLU-and-mul at Llama-3-8B shapes (intermediate 14336, bf16).

Baselines: torch.compile of the reference (Inductor fuses it into one pointwise kernel), static and
dynamic in the token count (the engine compiles its model with dynamic shapes), and eager.
Whether the model uses our kernel is decided by this comparison. Metric: achieved GB/s (read 2I,
write I per token) vs the copy bandwidth.

    pytest benchmarks/kernels/bench_silu_and_mul.py      (or run_all.py)
"""

from __future__ import annotations

import functools

import torch
from kbench import DEVICE, DTYPE, INTERMEDIATE, baseline_rows, compiled, entry_points, input_sets, timed_row

KERNEL = "silu_and_mul"
CASES = {"T8192": 8192, "T256": 256, "T64": 64, "T8": 8}


def measure(case: str):
    from fastllm.kernels import reference_impl, triton_impl
    from fastllm.kernels.silu_and_mul import bytes_moved

    num_tokens = CASES[case]
    sets = input_sets(lambda: (torch.randn(num_tokens, 2 * INTERMEDIATE, device=DEVICE, dtype=DTYPE),),
                      lambda args: bytes_moved(args[0]))
    nbytes = bytes_moved(sets[0][0])
    ours = [functools.partial(triton_impl("silu_and_mul"), *args) for args in sets]
    rows = [timed_row(KERNEL, case, "triton", ours, nbytes)]
    ref = reference_impl("silu_and_mul")
    dynamic = torch.compile(ref, dynamic=True, fullgraph=True)  # as the engine compiles its model
    baselines = {"torch_compile": compiled(ref), "torch_compile_dynamic": dynamic, "torch_eager": ref}
    baseline_rows(rows, KERNEL, case, baselines, sets, nbytes)
    return rows, ours[0]


run, test_bench_silu_and_mul = entry_points(KERNEL, CASES, measure)
