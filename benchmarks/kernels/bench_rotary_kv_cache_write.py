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
from kbench import (
    DEVICE,
    DTYPE,
    HEAD_DIM,
    HKV,
    baseline_rows,
    compiled,
    entry_points,
    fused_qkv,
    input_sets,
    rotary_inputs,
    timed_row,
)

KERNEL = "rotary_kv_cache_write"
CASES = {"T8192": 8192, "T256": 256, "T1": 1}
MAX_POS = 32768
PAGE = 16


def measure(case: str):
    from fastllm.kernels import reference_impl, triton_impl
    from fastllm.kernels.rotary_kv_cache_write import bytes_moved

    num_tokens = CASES[case]
    num_blocks = -(-num_tokens // PAGE) + 1

    def make():
        query, key, value = fused_qkv(num_tokens)
        positions, cos_sin = rotary_inputs(num_tokens, MAX_POS)
        key_cache = torch.zeros(num_blocks, PAGE, HKV, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        value_cache = torch.zeros_like(key_cache)
        slots = torch.randperm(num_blocks * PAGE, device=DEVICE)[:num_tokens]
        return positions, query, key, value, cos_sin, True, key_cache, value_cache, slots, False

    def nbytes_of(args):
        return bytes_moved(args[1], args[2], args[0], args[8], num_tokens)

    sets = input_sets(make, nbytes_of)
    nbytes = nbytes_of(sets[0])
    ours = [functools.partial(triton_impl(KERNEL), *args) for args in sets]
    rows = [timed_row(KERNEL, case, "triton", ours, nbytes)]

    def unfused(positions, query, key, value, cos_sin, is_neox, key_cache, value_cache, slots, _):
        triton_impl("rotary_embedding")(positions, query, key, cos_sin, is_neox)
        triton_impl("kv_cache_write")(key, value, key_cache, value_cache, slots)

    baselines = {"triton_unfused": unfused, "torch_compile": compiled(reference_impl(KERNEL))}
    baseline_rows(rows, KERNEL, case, baselines, sets, nbytes, syncing=("torch_compile",))  # a boolean mask
    return rows, ours[0]


run, test_bench_rotary_kv_cache_write = entry_points(KERNEL, CASES, measure)
