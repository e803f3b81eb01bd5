"""Fused residual-add + RMSNorm and plain RMSNorm at Llama-3-8B shapes (bf16).

Baselines: torch.compile of the unfused reference code (what Inductor fuses it into) and the eager
reference. Metric: achieved GB/s (bytes_moved: one read of each input, one write of each output) vs
the copy bandwidth.

    pytest benchmarks/kernels/bench_fused_add_rms_norm.py      (or run_all.py)
"""

from __future__ import annotations

import functools

import torch
from kbench import (
    DEVICE,
    DTYPE,
    HEAD_DIM,
    HIDDEN,
    HQ,
    baseline_rows,
    compiled,
    entry_points,
    input_sets,
    timed_row,
)

KERNEL = "fused_add_rms_norm"
# name -> (op, shape): the hidden-state norms of a prefill chunk and a decode batch, and Qwen3's q-norm
CASES = {
    "fused_8192x4096": ("fused_add_rms_norm", (8192, HIDDEN)),
    "fused_64x4096": ("fused_add_rms_norm", (64, HIDDEN)),
    "rms_8192x4096": ("rms_norm", (8192, HIDDEN)),
    "rms_heads_8192x32x128": ("rms_norm", (8192, HQ, HEAD_DIM)),
}
EPS = 1e-5


def measure(case: str):
    from fastllm.kernels import reference_impl, triton_impl
    from fastllm.kernels.fused_add_rms_norm import bytes_moved

    op, shape = CASES[case]
    fused = op == "fused_add_rms_norm"

    def make():
        x = torch.randn(shape, device=DEVICE, dtype=DTYPE)
        weight = torch.randn(shape[-1], device=DEVICE, dtype=DTYPE)
        return (x, torch.randn_like(x), weight, EPS) if fused else (x, weight, EPS)

    sets = input_sets(make, lambda args: bytes_moved(args[0], DTYPE, fused_residual=fused))
    nbytes = bytes_moved(sets[0][0], DTYPE, fused_residual=fused)
    ours = [functools.partial(triton_impl(op), *args) for args in sets]
    rows = [timed_row(KERNEL, case, "triton", ours, nbytes)]
    ref = reference_impl(op)
    baseline_rows(rows, KERNEL, case, {"torch_compile": compiled(ref), "torch_eager": ref}, sets, nbytes)
    return rows, ours[0]


run, test_bench_fused_add_rms_norm = entry_points(KERNEL, CASES, measure)
