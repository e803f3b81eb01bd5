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
from kbench import DEVICE, DTYPE, INTERMEDIATE, compiled, entry_points, row, time_ms, try_row

KERNEL = "silu_and_mul"
CASES = {"T8192": 8192, "T256": 256, "T64": 64, "T8": 8}


def measure(case: str):
    from fastllm.kernels import reference_impl, triton_impl
    from fastllm.kernels.silu_and_mul import bytes_moved

    num_tokens = CASES[case]
    x = torch.randn(num_tokens, 2 * INTERMEDIATE, device=DEVICE, dtype=DTYPE)
    nbytes = bytes_moved(x)
    ours = functools.partial(triton_impl("silu_and_mul"), x)
    rows = [row(KERNEL, case, "triton", time_ms(ours), nbytes)]
    ref = reference_impl("silu_and_mul")
    comp = compiled(ref)
    try_row(rows, KERNEL, case, "torch_compile", lambda: row(KERNEL, case, "torch_compile",
                                                             time_ms(functools.partial(comp, x)), nbytes))
    comp_dynamic = torch.compile(ref, dynamic=True, fullgraph=True)
    try_row(rows, KERNEL, case, "torch_compile_dynamic", lambda: row(
        KERNEL, case, "torch_compile_dynamic", time_ms(functools.partial(comp_dynamic, x)), nbytes))
    try_row(rows, KERNEL, case, "torch_eager", lambda: row(KERNEL, case, "torch_eager",
                                                           time_ms(functools.partial(ref, x)), nbytes))
    return rows, ours


run, test_bench_silu_and_mul = entry_points(KERNEL, CASES, measure)
