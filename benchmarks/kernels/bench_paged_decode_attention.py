"""Paged decode attention at Llama-3-8B shapes (32 q heads, 8 kv heads, dim 128, bf16, block size 16).

Ours reads K/V through permuted block tables; the baseline is torch SDPA (each backend that accepts the
problem) on the same K/V laid out contiguously, which is the best torch can do without paging.
Metric: achieved GB/s (bytes_moved: K/V once + q/out + split partials) vs the copy bandwidth, in steady
state (kbench.steady_ms).

    pytest benchmarks/kernels/bench_paged_decode_attention.py      (or run_all.py)
    python benchmarks/kernels/bench_paged_decode_attention.py --kv-cache-dtype fp8

--kv-cache-dtype fp8 times the kernel over an e4m3 cache (kv_cache_dtype="fp8", bf16 queries) at 64 x 4096
beside the bf16 cache in the same run, each as a fraction of the copy bandwidth (issue #26: >= 0.85).
"""

from __future__ import annotations

import argparse
import functools
import json

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
CASES = {"B64_ctx4096": (64, 4096), "B1_ctx32768": (1, 32768), "B64_ctx4096_fp8kv": (64, 4096)}
FP8_SCALES = (0.37, 1.9)  # k_scale, v_scale: any values time the same
PAGE = 16


def measure(case: str):
    from fastllm.kernels import reference
    from fastllm.kernels.paged_decode_attention import bytes_moved, choose_config, paged_decode_attention

    batch, ctx = CASES[case]
    scale = HEAD_DIM**-0.5
    fp8 = case.endswith("_fp8kv")  # an e4m3 cache: 1 byte a K/V element in bytes_moved
    kv_scales = dict(zip(("k_scale", "v_scale"), FP8_SCALES)) if fp8 else {}
    # the launch's split count
    splits = choose_config(ctx, batch, HKV, HEAD_DIM, num_sms(), DTYPE.itemsize, fp8_cache=fp8).num_splits

    def make():
        key_cache, value_cache, block_tables = paged_kv(batch, ctx, PAGE)
        if fp8:
            key_cache, value_cache = (reference.kv_to_cache(cache, reference.FP8, kv_scales[name]) for cache, name
                                      in ((key_cache, "k_scale"), (value_cache, "v_scale")))
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
        query = torch.randn(batch, HQ, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        return query, key_cache, value_cache, block_tables, seq_lens

    def nbytes_of(args):
        return bytes_moved(args[0], args[1], batch * ctx, splits)

    sets = input_sets(make, nbytes_of)
    nbytes = nbytes_of(sets[0])
    ours = [functools.partial(paged_decode_attention, *args, ctx, scale, **kv_scales) for args in sets]
    rows = [timed_row(KERNEL, case, "triton, fp8 KV" if fp8 else "triton", ours, nbytes, num_splits=splits)]
    if fp8:  # (SDPA takes no e4m3 K/V): the error against the dequantizing reference instead
        ref = reference.paged_decode_attention(*sets[0], ctx, scale, **kv_scales).float()
        rows[0]["rel_err_vs_reference"] = round(((ours[0]().float() - ref).norm() / ref.norm()).item(), 5)
        return rows, ours[0]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: also time an e4m3 cache at 64 x 4096, beside the bf16 one")
    args = parser.parse_args()
    cases = ["B64_ctx4096", "B64_ctx4096_fp8kv"] if args.kv_cache_dtype == "fp8" else ["B64_ctx4096", "B1_ctx32768"]
    for case in cases:
        for row in measure(case)[0]:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
