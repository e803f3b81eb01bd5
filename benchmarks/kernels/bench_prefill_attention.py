"""Prefill attention at Llama-3-8B shapes (32 q heads, 8 kv heads, dim 128, bf16, block size 16).

Ours: causal attention of whole prompts over the paged cache (K/V already written). Baseline: torch
SDPA, causal, on the same problem laid out contiguously [B, H, S, D] (flash / cuDNN / efficient; each
backend that accepts it). Metric: TFLOP/s of the causal problem, 4 * B * Hq * D * S (S + 1) / 2.

    pytest benchmarks/kernels/bench_prefill_attention.py      (or run_all.py)
"""

from __future__ import annotations

import functools

import torch
from kbench import DEVICE, DTYPE, HEAD_DIM, HQ, contiguous_kv, entry_points, paged_kv, row, sdpa_rows, time_ms

KERNEL = "prefill_attention"
CASES = {"B8_S2048": (8, 2048), "B1_S8192": (1, 8192)}
PAGE = 16


def measure(case: str):
    from fastllm.kernels.prefill_attention import flops, prefill_attention

    batch, seq = CASES[case]
    key_cache, value_cache, block_tables = paged_kv(batch, seq, PAGE)
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch * seq, HQ, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    n_flops = flops([seq] * batch, [seq] * batch, HQ, HEAD_DIM)

    ours = functools.partial(prefill_attention, query, key_cache, value_cache, block_tables, seq_lens, qsl,
                             seq, scale)
    rows = [row(KERNEL, case, "triton", time_ms(ours), flops=n_flops)]

    k, v = contiguous_kv(key_cache, value_cache, block_tables, seq)
    q = query.view(batch, seq, HQ, HEAD_DIM).transpose(1, 2).contiguous()  # [B, Hq, S, D]
    got = ours().view(batch, seq, HQ, HEAD_DIM).transpose(1, 2).float()

    def check(out):
        return ((got - out.float()).norm() / out.float().norm()).item()

    sdpa_rows(rows, KERNEL, case, q, k, v, causal=True, scale=scale, flops=n_flops, check=check)
    return rows, ours


run, test_bench_prefill_attention = entry_points(KERNEL, CASES, measure)
