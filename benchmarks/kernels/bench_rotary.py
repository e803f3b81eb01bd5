"""Rotary embedding (neox layout, in place) at Llama-3-8B shapes: q/k are views of a fused qkv output.

Baselines: torch.compile of the reference (in-place on the same views) and the eager reference.
Metric: achieved GB/s (bytes_moved: q and k read and written once, one cos/sin row per token).

    pytest benchmarks/kernels/bench_rotary.py      (or run_all.py)
"""

from __future__ import annotations

import functools

from kbench import compiled, entry_points, fused_qkv, rotary_inputs, row, time_ms, try_row

KERNEL = "rotary_embedding"
CASES = {"T8192": 8192, "T64": 64}
MAX_POS = 32768


def measure(case: str):
    from fastllm.kernels import reference_impl, triton_impl
    from fastllm.kernels.rotary import bytes_moved

    num_tokens = CASES[case]
    query, key, _ = fused_qkv(num_tokens)
    positions, cos_sin = rotary_inputs(num_tokens, MAX_POS)
    args = (positions, query, key, cos_sin, True)
    nbytes = bytes_moved(query, key, positions)
    ours = functools.partial(triton_impl("rotary_embedding"), *args)
    rows = [row(KERNEL, case, "triton", time_ms(ours), nbytes)]
    ref = reference_impl("rotary_embedding")
    comp = compiled(ref)
    try_row(rows, KERNEL, case, "torch_compile", lambda: row(KERNEL, case, "torch_compile",
                                                             time_ms(functools.partial(comp, *args)), nbytes))
    try_row(rows, KERNEL, case, "torch_eager", lambda: row(KERNEL, case, "torch_eager",
                                                           time_ms(functools.partial(ref, *args)), nbytes))
    return rows, ours


run, test_bench_rotary = entry_points(KERNEL, CASES, measure)
