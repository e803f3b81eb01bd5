"""FP8 projections at Llama-3.1-8B shapes (e4m3 weights, bf16 activations), per row count.

Impls: `triton` is fastllm's fp8_linear as the engine calls it (the weight-streaming kernel up to 32 rows,
quantization + torch._scaled_mm above); `triton_fp8_skinny` the weight-streaming kernel alone (up to 32
rows) and `scaled_mm` our quantization kernel + torch._scaled_mm at every row count, the two paths the
dispatch picks between; `bf16_linear` the bf16 projection the engine runs without FP8 (our skinny kernel up
to 32 rows, cuBLAS above) and `cublas_bf16` F.linear. Metric: GB/s of the weight bytes read (+ x and the
output) against the copy bandwidth. Whether decode batches take the weight-streaming kernel is decided by
the triton_fp8_skinny / scaled_mm rows.

    python benchmarks/kernels/bench_fp8_linear.py            (or run_all.py; GPU of sm_89+)
"""

from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F
from kbench import DEVICE, DTYPE, HIDDEN, INTERMEDIATE, baseline_rows, entry_points, input_sets, timed_row

KERNEL = "fp8_linear"
SHAPES = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN),
          "down": (HIDDEN, INTERMEDIATE)}
CASES = {f"{name}_M{rows}": (name, rows) for name in SHAPES for rows in (1, 8, 32, 64, 256)}


def measure(case: str):
    from fastllm.kernels import fp8_skinny_linear, triton_impl
    from fastllm.kernels.fp8_linear import fast_accum, quantize_fp8_per_token
    from fastllm.kernels.skinny_linear import linear as bf16_linear
    from fastllm.layers.fp8 import quantize_weight

    name, rows = CASES[case]
    n_out, k_in = SHAPES[name]

    def make():
        w = torch.randn(n_out, k_in, device=DEVICE, dtype=DTYPE) / k_in ** 0.5
        weight, scale = quantize_weight(w, per_tensor=False)
        return torch.randn(rows, k_in, device=DEVICE, dtype=DTYPE), weight, scale, w

    sets = input_sets(make, lambda s: s[1].numel())
    nbytes = n_out * k_in + 2 * rows * (k_in + n_out)
    fp8_sets = [s[:3] for s in sets]
    ours = [functools.partial(triton_impl("fp8_linear"), x, w, s, None) for x, w, s in fp8_sets]
    rows_out = [timed_row(KERNEL, case, "triton", ours, nbytes)]

    def scaled_mm(x, weight, scale):
        q, x_scale = quantize_fp8_per_token(x)
        return torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype,
                                use_fast_accum=fast_accum(x.dtype))  # (as fp8_linear sums above 32 rows)

    impls = {"scaled_mm": scaled_mm}
    if rows <= fp8_skinny_linear.MAX_ROWS:
        impls["triton_fp8_skinny"] = fp8_skinny_linear.launch
    baseline_rows(rows_out, KERNEL, case, impls, fp8_sets, nbytes)
    bf16_bytes = 2 * n_out * k_in + 2 * rows * (k_in + n_out)
    bf16_sets = [(s[0], s[3]) for s in sets]
    baseline_rows(rows_out, KERNEL, case, {"bf16_linear": lambda x, w: bf16_linear(x, w, None),
                                           "cublas_bf16": F.linear}, bf16_sets, bf16_bytes)
    return rows_out, ours[0]


run, test_bench_fp8_linear = entry_points(KERNEL, CASES, measure)


if __name__ == "__main__":
    for row in run():
        print(json.dumps(row))
