"""Prefill attention at Llama-3-8B shapes (32 q heads, 8 kv heads, dim 128, bf16, block size 16).

Ours: causal attention of whole prompts, q / k / v laid out as the model has them (slices of one qkv
output, k and v also written to the paged cache). Baseline: torch SDPA, causal, on the same problem laid
out contiguously [B, H, S, D] (flash / cuDNN / efficient; each backend that accepts it). Metric: TFLOP/s
of the causal problem, 4 * B * Hq * D * S (S + 1) / 2.

    pytest benchmarks/kernels/bench_prefill_attention.py      (or run_all.py)
"""

from __future__ import annotations

import functools

from kbench import HEAD_DIM, HQ, HKV, entry_points, prefill_problem, row, sdpa_rows, time_ms

KERNEL = "prefill_attention"
CASES = {"B8_S2048": (8, 2048), "B1_S8192": (1, 8192)}
PAGE = 16


def measure(case: str):
    from fastllm.kernels.prefill_attention import flops, prefill_attention, use_chunk_tma

    batch, seq = CASES[case]
    args = prefill_problem(batch, seq, 0, PAGE)
    query, key, value = args[:3]
    scale = HEAD_DIM**-0.5
    n_flops = flops([seq] * batch, [seq] * batch, HQ, HEAD_DIM)

    ours = functools.partial(prefill_attention, *args, seq, scale)
    rows = [row(KERNEL, case, "triton", time_ms(ours), flops=n_flops, chunk_tma=use_chunk_tma(key, value))]

    def heads_first(x, heads):  # [B * S, H, D] -> contiguous [B, H, S, D]
        return x.reshape(batch, seq, heads, HEAD_DIM).transpose(1, 2).contiguous()

    q, k, v = heads_first(query, HQ), heads_first(key, HKV), heads_first(value, HKV)
    got = heads_first(ours(), HQ).float()

    def check(out):
        return ((got - out.float()).norm() / out.float().norm()).item()

    sdpa_rows(rows, KERNEL, case, q, k, v, causal=True, scale=scale, flops=n_flops, check=check)
    return rows, ours


run, test_bench_prefill_attention = entry_points(KERNEL, CASES, measure)
