"""Fused residual-add + RMSNorm and plain RMSNorm at Llama-3-8B shapes (bf16).

Baselines: torch.compile of the unfused reference code (what Inductor fuses it into) and the eager
reference. Metric: achieved GB/s (bytes_moved: one read of each input, one write of each output) vs
the copy bandwidth.

    pytest benchmarks/kernels/bench_fused_add_rms_norm.py      (or run_all.py)
"""

from __future__ import annotations

import functools

import torch
from kbench import DEVICE, DTYPE, HEAD_DIM, HIDDEN, HQ, compiled, entry_points, row, time_ms, try_row

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
    x = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    weight = torch.randn(shape[-1], device=DEVICE, dtype=DTYPE)
    args = (x, torch.randn_like(x), weight, EPS) if op == "fused_add_rms_norm" else (x, weight, EPS)
    nbytes = bytes_moved(x, DTYPE, fused_residual=op == "fused_add_rms_norm")
    ours = functools.partial(triton_impl(op), *args)
    rows = [row(KERNEL, case, "triton", time_ms(ours), nbytes)]
    ref = reference_impl(op)
    comp = compiled(ref)
    try_row(rows, KERNEL, case, "torch_compile", lambda: row(KERNEL, case, "torch_compile",
                                                             time_ms(functools.partial(comp, *args)), nbytes))
    try_row(rows, KERNEL, case, "torch_eager", lambda: row(KERNEL, case, "torch_eager",
                                                           time_ms(functools.partial(ref, *args)), nbytes))
    return rows, ours


run, test_bench_fused_add_rms_norm = entry_points(KERNEL, CASES, measure)
