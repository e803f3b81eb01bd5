"""Rotary embedding fused with the KV-cache write, at Llama-3-8B shapes (what attention runs first on a
prefill or mixed step; a decode step does both inside decode attention, rotary_decode_attention).

q, k, v are views of a fused qkv output; slots are a random permutation of a 16-token-page cache.
Baselines: our two unfused kernels back to back (rotary in place, then kv_cache_write), and
torch.compile of the reference. Metric: achieved GB/s (bytes_moved of the fused kernel).

    pytest benchmarks/kernels/bench_rotary_kv_cache_write.py      (or run_all.py)
"""

from __future__ import annotations

import functools

import torch
from kbench import DEVICE, DTYPE, HEAD_DIM, HKV, compiled, entry_points, fused_qkv, rotary_inputs, row, time_ms, try_row

KERNEL = "rotary_kv_cache_write"
CASES = {"T8192": 8192, "T256": 256, "T1": 1}
MAX_POS = 32768
PAGE = 16


def measure(case: str):
    from fastllm.kernels import reference_impl, triton_impl
    from fastllm.kernels.rotary_kv_cache_write import bytes_moved

    num_tokens = CASES[case]
    query, key, value = fused_qkv(num_tokens)
    positions, cos_sin = rotary_inputs(num_tokens, MAX_POS)
    num_blocks = -(-num_tokens // PAGE) + 1
    key_cache = torch.zeros(num_blocks, PAGE, HKV, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_blocks * PAGE, device=DEVICE)[:num_tokens]
    args = (positions, query, key, value, cos_sin, True, key_cache, value_cache, slots, False)
    nbytes = bytes_moved(query, key, positions, slots, num_tokens)
    ours = functools.partial(triton_impl(KERNEL), *args)
    rows = [row(KERNEL, case, "triton", time_ms(ours), nbytes)]

    def unfused():
        triton_impl("rotary_embedding")(positions, query, key, cos_sin, True)
        triton_impl("kv_cache_write")(key, value, key_cache, value_cache, slots)

    try_row(rows, KERNEL, case, "triton_unfused", lambda: row(KERNEL, case, "triton_unfused", time_ms(unfused),
                                                              nbytes))
    comp = compiled(reference_impl(KERNEL))
    try_row(rows, KERNEL, case, "torch_compile", lambda: row(KERNEL, case, "torch_compile",
                                                             time_ms(functools.partial(comp, *args)), nbytes))
    return rows, ours


run, test_bench_rotary_kv_cache_write = entry_points(KERNEL, CASES, measure)
