"""Paged decode attention at Llama-3-8B shapes (32 q heads, 8 kv heads, dim 128, bf16, block size 16).

Ours reads K/V through permuted block tables; the baseline is torch SDPA (each backend that accepts the
problem) on the same K/V laid out contiguously, which is the best torch can do without paging.
Metric: achieved GB/s (bytes_moved: K/V once + q/out + split partials) vs the copy bandwidth.

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
    num_sms,
    paged_kv,
    row,
    sdpa_rows,
    time_ms,
)

KERNEL = "paged_decode_attention"
CASES = {"B64_ctx4096": (64, 4096), "B1_ctx32768": (1, 32768)}
PAGE = 16


def measure(case: str):
    from fastllm.kernels.paged_decode_attention import bytes_moved, choose_config, paged_decode_attention

    batch, ctx = CASES[case]
    key_cache, value_cache, block_tables = paged_kv(batch, ctx, PAGE)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, HQ, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    scale = HEAD_DIM**-0.5

    ours = functools.partial(paged_decode_attention, query, key_cache, value_cache, block_tables, seq_lens,
                             ctx, scale)
    sms = num_sms()
    splits = choose_config(ctx, batch, HKV, HEAD_DIM, sms, query.element_size()).num_splits  # the launch's
    nbytes = bytes_moved(query, key_cache, batch * ctx, splits)
    rows = [row(KERNEL, case, "triton", time_ms(ours), nbytes, num_splits=splits)]

    # the same K/V, contiguous per request: [B, Hkv, S, D]
    k, v = contiguous_kv(key_cache, value_cache, block_tables, ctx)
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale, enable_gqa=True)
    err = ((ours().float() - ref.squeeze(2)).norm() / ref.norm()).item()
    rows[0]["rel_err_vs_fp32"] = round(err, 5)
    sdpa_rows(rows, KERNEL, case, q, k, v, causal=False, scale=scale, nbytes=nbytes)
    return rows, ours


run, test_bench_paged_decode_attention = entry_points(KERNEL, CASES, measure)
