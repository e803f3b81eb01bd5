"""Cascade attention at Llama-3-8B shapes (32 q heads, 8 kv heads, dim 128, bf16, block size 16): a group of
decode requests on a shared prefix (the same block ids at the head of every table) plus their own tokens.

Ours ('triton') is the engine's decode path over the cached K/V (cascade_decode_attention): the shared-prefix
kernel (the group's rows as one tile, split over the prefix), then paged decode over each request's own
tokens (kv_start), started beside it by programmatic dependent launch, which merges each request's prefix
states into its row by log-sum-exp; two launches timed together in steady state (kbench.steady_ms). The
baseline is the plain paged decode kernel on the same data ('paged_decode_attention': every request reads the
whole prefix), our own kernel, not torch's: the row's speedup_vs_paged_decode is the target (>= 3x at B64 x
2,048 + 128).
GB/s counts the bytes cascade must move (the prefix once, the suffixes, q/out, partial states).

    pytest benchmarks/kernels/bench_cascade_attention.py      (or run_all.py --only cascade_attention)
"""

from __future__ import annotations

import functools

import torch
from kbench import DEVICE, DTYPE, HEAD_DIM, HKV, HQ, entry_points, input_sets, timed_row

KERNEL = "cascade_attention"
# name -> (requests, shared prefix tokens, own tokens per request)
CASES = {"B64_prefix2048_own128": (64, 2048, 128), "B16_prefix4096_own512": (16, 4096, 512)}
PAGE = 16


def shared_prefix_problem(batch: int, prefix: int, own: int, lone: int = 0):
    """(query, key_cache, value_cache, block_tables, seq_lens, plan): every table starts with the same
    prefix // PAGE blocks, but the last `lone` requests', which share nothing with the group (blocks of
    their own, as another prompt of the same length has); plan = (kv_start, prefix_rows, prefix_lens, rows,
    row_start), one group of the batch - lone requests."""
    shared, per_own = prefix // PAGE, -(-own // PAGE)
    num_blocks = shared * (1 + lone) + batch * per_own
    key_cache = torch.randn(num_blocks, PAGE, HKV, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    value_cache = torch.randn_like(key_cache)
    ids = torch.randperm(num_blocks, device=DEVICE).int()
    prefix_ids = ids[:shared * (1 + lone)].view(1 + lone, shared)
    own_ids = ids[shared * (1 + lone):].view(batch, per_own)
    grouped = batch - lone
    prefix_of = torch.cat([prefix_ids[:1].expand(grouped, shared), prefix_ids[1:]])
    block_tables = torch.cat([prefix_of, own_ids], dim=1).contiguous()
    seq_lens = torch.full((batch,), prefix + own, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, HQ, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    kv_start = torch.tensor([prefix] * grouped + [0] * lone, **i32)
    plan = (kv_start, torch.zeros(1, **i32), torch.tensor([prefix], **i32), torch.arange(grouped, **i32),
            torch.tensor([0, grouped], **i32))
    return query, key_cache, value_cache, block_tables, seq_lens, plan


def cascade(query, key_cache, value_cache, block_tables, seq_lens, plan, prefix: int, own: int, scale: float):
    from fastllm.kernels.cascade_attention import cascade_decode_attention

    return cascade_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, *plan,
                                    query.shape[0], prefix, own, scale)


def cascade_bytes(batch: int, prefix: int, own: int, splits: int) -> int:
    kv_token = HKV * HEAD_DIM * 2 * DTYPE.itemsize  # K and V of one token
    qo = 2 * batch * HQ * HEAD_DIM * DTYPE.itemsize
    partials = 2 * batch * HQ * splits * (HEAD_DIM + 1) * 4 + 2 * batch * HQ * 4  # written, read; suffix lse
    return prefix * kv_token + batch * own * kv_token + 2 * qo + partials


def measure(case: str):
    from kbench import num_sms

    from fastllm.kernels.cascade_attention import choose_num_splits
    from fastllm.kernels.paged_decode_attention import bytes_moved, paged_decode_attention
    from fastllm.kernels.prefill_tiles import query_tile_size

    batch, prefix, own = CASES[case]
    scale = HEAD_DIM**-0.5
    group = HQ // HKV
    splits = choose_num_splits(batch, HKV, query_tile_size(group), prefix, num_sms())
    nbytes = cascade_bytes(batch, prefix, own, splits)
    sets = input_sets(lambda: shared_prefix_problem(batch, prefix, own), lambda args: nbytes)
    ours = [functools.partial(cascade, *args, prefix, own, scale) for args in sets]
    plain = [functools.partial(paged_decode_attention, *args[:5], prefix + own, scale) for args in sets]
    whole = plain[0]().float()
    err = ((ours[0]().float() - whole).norm() / whole.norm()).item()
    rows = [timed_row(KERNEL, case, "triton", ours, nbytes, prefix_splits=splits, rel_err_vs_plain=round(err, 5))]
    plain_bytes = bytes_moved(sets[0][0], sets[0][1], batch * (prefix + own))
    rows.append(timed_row(KERNEL, case, "paged_decode_attention", plain, plain_bytes))
    rows[0]["speedup_vs_paged_decode"] = round(rows[1]["ms"] / rows[0]["ms"], 2)
    return rows, ours[0]


run, test_bench_cascade_attention = entry_points(KERNEL, CASES, measure)
