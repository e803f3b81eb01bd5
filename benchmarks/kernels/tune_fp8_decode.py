"""Decode attention over an FP8 cache: the table's launch (choose_config with fp8_cache=True) against the
16-bit cache's launch for the same shape, on the same e4m3 K/V (GPU).

    python benchmarks/kernels/tune_fp8_decode.py
    python benchmarks/kernels/tune_fp8_decode.py --batch-sizes 32,64 --contexts 384,4096 --bound 8192
    python benchmarks/kernels/tune_fp8_decode.py --append     # the engine's launch (rotary_decode_attention)

Llama-3-8B's attention (32 q heads, 8 KV heads, dim 128, bf16 queries, block size 16), at a CUDA graph's
loose bound (--bound: the split count and tile follow it, not the requests), a third of the requests at
half the context; each row also once with every request full at the largest context. Per config: us a
call in steady state (kbench.steady_ms) and the fraction of copy bandwidth over the bytes the requests hold.
--append times the launch as the engine's decode step makes it: each request's new token rotated, written
to the cache and attended from registers (APPEND), which holds more registers a program than the kernel
alone: a config can win without it and lose with it.
"""

from __future__ import annotations

import argparse
import functools

import torch
from kbench import DEVICE, HEAD_DIM, HKV, HQ, copy_bandwidth_gbs, input_sets, num_sms, paged_kv, steady_ms

from fastllm.kernels import reference
from fastllm.kernels.paged_decode_attention import (NewTokens, bytes_moved, choose_config,
                                                    paged_decode_attention_splits)
from fastllm.layers.rotary import cos_sin_cache

PAGE = 16
K_SCALE, V_SCALE = 0.37, 1.9  # any values time the same


def make_inputs(batch: int, context: int, ragged: bool, fp8: bool = True):
    """(query, key_cache, value_cache, block_tables, seq_lens): ragged puts a third of the requests at half
    the context; fp8=False leaves the cache in bf16 (tune_decode_tiles.py)."""
    key_cache, value_cache, block_tables = paged_kv(batch, max(context, 64), PAGE)
    if fp8:
        key_cache = reference.kv_to_cache(key_cache, reference.FP8, K_SCALE)
        value_cache = reference.kv_to_cache(value_cache, reference.FP8, V_SCALE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    if ragged:
        seq_lens[::3] = max(1, context // 2)
    query = torch.randn(batch, HQ, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    return query, key_cache, value_cache, block_tables, seq_lens


def new_tokens(query, block_tables, seq_lens, bound: int) -> NewTokens:
    """APPEND's inputs: each request's new token (at position seq_len - 1) and its cache slot."""
    positions = seq_lens.long() - 1
    slots = block_tables.gather(1, (positions // PAGE)[:, None]).squeeze(1).long() * PAGE + positions % PAGE
    key, value = (torch.randn(query.shape[0], HKV, HEAD_DIM, device=DEVICE, dtype=query.dtype)
                  for _ in range(2))
    cos_sin = cos_sin_cache(HEAD_DIM, bound, 500000.0, {}).to(DEVICE)
    return NewTokens(positions, key, value, cos_sin, True, slots)


def reference_out(s, bound: int, scale: float, new: NewTokens | None) -> torch.Tensor:
    """The reference's output for the inputs s (with APPEND's new tokens, its caches left as they were)."""
    if new is None:
        return reference.paged_decode_attention(*s, bound, scale, k_scale=K_SCALE, v_scale=V_SCALE).float()
    query, key_cache, value_cache, block_tables, seq_lens = s
    return reference.rotary_decode_attention(new.positions, query, new.key, new.value, new.cos_sin_cache,
                                             new.is_neox, key_cache.clone(), value_cache.clone(),
                                             new.slot_mapping, block_tables, seq_lens, bound, scale,
                                             k_scale=K_SCALE, v_scale=V_SCALE).float()


def time_configs(batch: int, context: int, ragged: bool, bound: int, copy_gbs: float, append: bool) -> str:
    sets = input_sets(functools.partial(make_inputs, batch, context, ragged),
                      lambda s: bytes_moved(s[0], s[1], int(s[4].sum()), 1))
    new = [new_tokens(s[0], s[3], s[4], bound) if append else None for s in sets]
    kv_bytes = bytes_moved(sets[0][0], sets[0][1], int(sets[0][4].sum()), 1)
    scale = HEAD_DIM ** -0.5
    ref = reference_out(sets[0], bound, scale, new[0])
    cells = []
    for fp8_rule in (False, True):
        cfg = choose_config(bound, batch, HKV, HEAD_DIM, num_sms(), 2, fp8_cache=fp8_rule)
        calls = [functools.partial(paged_decode_attention_splits, *s, bound, scale, cfg.num_splits,
                                   block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                   min_split_len=cfg.min_split_len, k_scale=K_SCALE, v_scale=V_SCALE,
                                   append=a)
                 for s, a in zip(sets, new)]
        err = ((calls[0]().float() - ref).norm() / ref.norm()).item()
        assert err < 2e-3, (batch, context, cfg, err)
        ms = steady_ms(calls)
        cells.append(f"{tuple(cfg)} {ms * 1e3:.1f} us ({kv_bytes / ms / 1e6 / copy_gbs:.3f})")
    return f"| {batch} x {context}{'' if ragged else ' full'} | " + " | ".join(cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="25,32,48,64,96,115")
    p.add_argument("--contexts", default="128,384,1024,4096")
    p.add_argument("--bound", type=int, default=4096)
    p.add_argument("--append", action="store_true",
                   help="time the engine's launch: the step's new token rotated, written and attended")
    args = p.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    assert max(contexts) <= args.bound, "contexts beyond the bound"
    copy_gbs = copy_bandwidth_gbs()
    print(f"bound {args.bound}, {num_sms()} SMs{', APPEND' if args.append else ''}; "
          "config = (splits, keys a tile, warps, stages, min split len)")
    print("| B x context | 16-bit table | FP8 table |\n|---|---|---|")
    for batch in batches:
        for context in contexts:
            print(time_configs(batch, context, True, args.bound, copy_gbs, args.append), flush=True)
        print(time_configs(batch, max(contexts), False, args.bound, copy_gbs, args.append), flush=True)


if __name__ == "__main__":
    main()
