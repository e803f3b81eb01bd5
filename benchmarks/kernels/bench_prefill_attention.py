"""Prefill attention at Llama-3-8B shapes (32 q heads, 8 kv heads, dim 128, bf16, block size 16).

Ours: causal attention of whole prompts, q / k / v laid out as the model has them (slices of one qkv
output, k and v also written to the paged cache). 'triton' is the default path (on an H100 the Gluon
kernel of prefill_attention_hopper.py); 'triton_kernel' forces the Triton kernel, for comparison.
Baseline: torch SDPA, causal, on the same problem laid out contiguously [B, H, S, D] (flash / cuDNN /
efficient; each backend that accepts it). Metric: TFLOP/s
of the causal problem, 4 * B * Hq * D * S (S + 1) / 2.

    pytest benchmarks/kernels/bench_prefill_attention.py      (or run_all.py)
"""

from __future__ import annotations

import functools

from kbench import HEAD_DIM, HKV, HQ, entry_points, input_sets, prefill_problem, sdpa_rows, timed_row

KERNEL = "prefill_attention"
CASES = {"B8_S2048": (8, 2048), "B1_S8192": (1, 8192)}
PAGE = 16


def measure(case: str):
    from fastllm.kernels.prefill_attention import (
        _use_hopper_kernel,
        choose_config,
        flops,
        prefill_attention,
        prefill_attention_config,
        use_chunk_tma,
    )

    batch, seq = CASES[case]
    scale = HEAD_DIM**-0.5
    n_flops = flops([seq] * batch, [seq] * batch, HQ, HEAD_DIM)

    def footprint(args):  # the qkv rows (q, k, v are views of one buffer), the out rows and the cache
        query, key_cache = args[0], args[3]
        return query.untyped_storage().nbytes() + query.nbytes + 2 * key_cache.nbytes

    sets = input_sets(lambda: prefill_problem(batch, seq, 0, PAGE), footprint)
    ours = [functools.partial(prefill_attention, *args, seq, scale) for args in sets]
    query, key, value = sets[0][:3]
    config = "BM{}-BN{}-w{}-s{}".format(*choose_config(HEAD_DIM, HQ // HKV, query.dtype))
    gluon = _use_hopper_kernel(*sets[0][:5])
    if gluon:
        from fastllm.kernels import prefill_attention_hopper as hopper

        default = f"gluon-ws BM2x{hopper.BLOCK_M}-BN{hopper.key_tile(seq)}-s{hopper.STAGES}"
    else:
        default = config
    rows = [timed_row(KERNEL, case, "triton", ours, flops=n_flops, chunk_tma=use_chunk_tma(key, value),
                      config=default)]
    if gluon:  # the default path is the Gluon kernel: time the Triton one beside it
        triton_kernel = [functools.partial(prefill_attention_config, *args, seq, scale, hopper=False) for args in sets]
        rows.append(timed_row(KERNEL, case, "triton_kernel", triton_kernel, flops=n_flops,
                              chunk_tma=use_chunk_tma(key, value), config=config))

    def heads_first(x, heads):  # [B * S, H, D] -> contiguous [B, H, S, D]
        return x.reshape(batch, seq, heads, HEAD_DIM).transpose(1, 2).contiguous()

    qkv_sets = [(heads_first(q, HQ), heads_first(k, HKV), heads_first(v, HKV)) for q, k, v, *_ in sets]
    got = heads_first(ours[0](), HQ).float()

    def check(out):
        return ((got - out.float()).norm() / out.float().norm()).item()

    sdpa_rows(rows, KERNEL, case, qkv_sets, causal=True, scale=scale, flops=n_flops, check=check)
    return rows, ours[0]


run, test_bench_prefill_attention = entry_points(KERNEL, CASES, measure)
