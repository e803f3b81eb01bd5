"""KV-cache write at Llama-3-8B shapes (8 kv heads, dim 128, bf16, block size 16, 4096 blocks).

Two slot layouts: every token to a random slot (T8192, the worst case: each 2 KiB row lands alone),
and what a prefill step writes (T8192_blocks: the tokens fill whole blocks, taken in random order
from the pool, so each block is one contiguous 32 KiB run of K and of V).

Baselines: the reference (boolean-mask index_put) and index_copy_ of the valid rows into the flat
cache view, the fastest torch built-in for a scatter. Metric: achieved GB/s (bytes_moved: K/V read
once and written once, plus the slot mapping) vs the copy bandwidth, in steady state (kbench.steady_ms).
A last row, torch_copy_contiguous, is no KV write: torch's copy_ of the same K and V into the cache's
first T rows, i.e. the same bytes with no scatter, what a plain copy of this size reaches.

    pytest benchmarks/kernels/bench_kv_cache_write.py      (or run_all.py)
"""

from __future__ import annotations

import functools

import torch
from kbench import DEVICE, DTYPE, HEAD_DIM, HKV, baseline_rows, entry_points, input_sets, timed_row

KERNEL = "kv_cache_write"
CASES = {"T8192": 8192, "T8192_blocks": 8192, "T64": 64}
NUM_BLOCKS, PAGE = 4096, 16


def measure(case: str):
    from fastllm.kernels import reference_impl, triton_impl
    from fastllm.kernels.kv_cache_write import bytes_moved

    num_tokens = CASES[case]

    def make():
        key = torch.randn(num_tokens, HKV, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        value = torch.randn_like(key)
        key_cache = torch.zeros(NUM_BLOCKS, PAGE, HKV, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        value_cache = torch.zeros_like(key_cache)
        if case.endswith("_blocks"):
            blocks = torch.randperm(NUM_BLOCKS, device=DEVICE)[:num_tokens // PAGE]
            slots = (blocks[:, None] * PAGE + torch.arange(PAGE, device=DEVICE)).reshape(-1)
        else:
            slots = torch.randperm(NUM_BLOCKS * PAGE, device=DEVICE)[:num_tokens]
        return key, value, key_cache, value_cache, slots

    def nbytes_of(args):
        return bytes_moved(args[0], args[2], args[4], num_tokens)

    sets = input_sets(make, nbytes_of)
    nbytes = nbytes_of(sets[0])
    ours = [functools.partial(triton_impl("kv_cache_write"), *args) for args in sets]
    rows = [timed_row(KERNEL, case, "triton", ours, nbytes)]

    def index_copy(key, value, key_cache, value_cache, slots):
        key_cache.view(-1, HKV, HEAD_DIM).index_copy_(0, slots, key)
        value_cache.view(-1, HKV, HEAD_DIM).index_copy_(0, slots, value)

    def copy_contiguous(key, value, key_cache, value_cache, slots):
        key_cache.view(-1, HKV, HEAD_DIM)[:num_tokens].copy_(key)
        value_cache.view(-1, HKV, HEAD_DIM)[:num_tokens].copy_(value)

    baselines = {"torch_index_copy": index_copy, "torch_reference": reference_impl("kv_cache_write"),
                 "torch_copy_contiguous": copy_contiguous}
    baseline_rows(rows, KERNEL, case, baselines, sets, nbytes, syncing=("torch_reference",))
    return rows, ours[0]


run, test_bench_kv_cache_write = entry_points(KERNEL, CASES, measure)
