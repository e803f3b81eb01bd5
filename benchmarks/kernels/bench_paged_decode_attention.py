"""Paged decode attention at Llama-3-8B shapes (32 q heads, 8 kv heads, dim 128, bf16, block size 16).

Ours reads K/V through permuted block tables; the baseline is torch SDPA (each backend that accepts the
problem) on the same K/V laid out contiguously, which is the best torch can do without paging.
Metric: achieved GB/s (bytes_moved: K/V once + q/out + split partials) vs the copy bandwidth, in steady
state (kbench.steady_ms).

    pytest benchmarks/kernels/bench_paged_decode_attention.py      (or run_all.py)
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from kbench import (
    DEVICE,
    DTYPE,
    HEAD_DIM,
    HKV,
    HQ,
    contiguous_kv,
    entry_points,
    input_sets,
    num_sms,
    paged_kv,
    sdpa_rows,
    timed_row,
)

KERNEL = "paged_decode_attention"
CASES = {"B64_ctx4096": (64, 4096), "B1_ctx32768": (1, 32768)}
PAGE = 16


def measure(case: str):
    from fastllm.kernels.paged_decode_attention import bytes_moved, choose_config, paged_decode_attention

    batch, ctx = CASES[case]
    scale = HEAD_DIM**-0.5
    splits = choose_config(ctx, batch, HKV, HEAD_DIM, num_sms(), DTYPE.itemsize).num_splits  # the launch's

    def make():
        key_cache, value_cache, block_tables = paged_kv(batch, ctx, PAGE)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
        query = torch.randn(batch, HQ, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        return query, key_cache, value_cache, block_tables, seq_lens

    def nbytes_of(args):
        return bytes_moved(args[0], args[1], batch * ctx, splits)

    sets = input_sets(make, nbytes_of)
    nbytes = nbytes_of(sets[0])
    ours = [functools.partial(paged_decode_attention, *args, ctx, scale) for args in sets]
    rows = [timed_row(KERNEL, case, "triton", ours, nbytes, num_splits=splits)]

    # the same K/V, contiguous per request: [B, Hkv, S, D]
    qkv_sets = [(query.unsqueeze(2), *contiguous_kv(key_cache, value_cache, block_tables, ctx))
                for query, key_cache, value_cache, block_tables, _ in sets]  # q [B, Hq, 1, D]
    q, k, v = qkv_sets[0]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale, enable_gqa=True)
    err = ((ours[0]().float() - ref.squeeze(2)).norm() / ref.norm()).item()
    rows[0]["rel_err_vs_fp32"] = round(err, 5)
    del ref
    sdpa_rows(rows, KERNEL, case, qkv_sets, causal=False, scale=scale, nbytes=nbytes)
    return rows, ours[0]


run, test_bench_paged_decode_attention = entry_points(KERNEL, CASES, measure)
