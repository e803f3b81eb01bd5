"""Rotary embedding (neox layout, in place) at Llama-3-8B shapes: q/k are views of a fused qkv output.

Baselines: torch.compile of the reference (in-place on the same views) and the eager reference.
Metric: achieved GB/s (bytes_moved: q and k read and written once, one cos/sin row per token).

    pytest benchmarks/kernels/bench_rotary.py      (or run_all.py)
"""

from __future__ import annotations

import functools

from kbench import baseline_rows, compiled, entry_points, fused_qkv, input_sets, rotary_inputs, timed_row

KERNEL = "rotary_embedding"
CASES = {"T8192": 8192, "T64": 64}
MAX_POS = 32768


def measure(case: str):
    from fastllm.kernels import reference_impl, triton_impl
    from fastllm.kernels.rotary import bytes_moved

    num_tokens = CASES[case]

    def make():
        query, key, _ = fused_qkv(num_tokens)
        positions, cos_sin = rotary_inputs(num_tokens, MAX_POS)
        return positions, query, key, cos_sin, True

    sets = input_sets(make, lambda args: bytes_moved(args[1], args[2], args[0]))
    nbytes = bytes_moved(sets[0][1], sets[0][2], sets[0][0])
    ours = [functools.partial(triton_impl("rotary_embedding"), *args) for args in sets]
    rows = [timed_row(KERNEL, case, "triton", ours, nbytes)]
    ref = reference_impl("rotary_embedding")
    baseline_rows(rows, KERNEL, case, {"torch_compile": compiled(ref), "torch_eager": ref}, sets, nbytes)
    return rows, ours[0]


run, test_bench_rotary = entry_points(KERNEL, CASES, measure)
