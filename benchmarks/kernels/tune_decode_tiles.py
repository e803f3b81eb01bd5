"""Decode attention's tiles over a 16-bit cache at every decode graph's batch size (GPU): the table's launch
(choose_config) against each candidate tile at the table's split count.

    python benchmarks/kernels/tune_decode_tiles.py
    python benchmarks/kernels/tune_decode_tiles.py --batch-sizes 96,160 --contexts 1000 --bound 8192

Llama-3-8B's attention (32 q heads, 8 KV heads, dim 128, bf16, block size 16), launched as the engine's decode
step launches it (APPEND: each request's new token rotated, written to the cache and attended from registers)
over ragged requests (a third at half the context), at a CUDA graph's loose bound. Per case: the table's
config and its us a call in steady state (kbench.steady_ms), then each tile's speed relative to it (> 1:
faster than the table's), the fastest starred. Which tile wins moves with how B x Hkv programs fill the
SMs' slots rather than steadily with the batch, hence every graph size.
"""

from __future__ import annotations

import argparse

import torch
from kbench import HEAD_DIM, HKV, input_sets, num_sms, steady_ms
from tune_fp8_decode import make_inputs, new_tokens

from fastllm.kernels.paged_decode_attention import choose_config, paged_decode_attention_splits

TILES = [(64, 4, 2), (64, 2, 3), (64, 2, 2), (32, 2, 3), (32, 1, 3), (32, 1, 2), (16, 2, 2), (16, 1, 3)]
GRAPH_BATCHES = [1, 2, 4, *range(8, 129, 8), 144, 160, 176, 192, 224, 256, 320, 384, 448, 512]


def step_inputs(batch: int, context: int, bound: int):
    """A decode step's inputs over a bf16 cache: ragged requests and each one's new token (APPEND)."""
    query, key_cache, value_cache, block_tables, seq_lens = make_inputs(batch, context, True, fp8=False)
    new = new_tokens(query, block_tables, seq_lens, bound)
    return query, key_cache, value_cache, block_tables, seq_lens, new


def time_case(batch: int, context: int, bound: int, sms: int):
    """(the table's launch, its us a call, {tile: speed relative to it}) at the table's split count."""
    sets = input_sets(lambda: step_inputs(batch, context, bound),
                      lambda s: 2 * s[1].numel() * s[1].element_size())
    chosen = choose_config(bound, batch, HKV, HEAD_DIM, sms, 2)

    def time_us(tile) -> float:
        block_n, warps, stages = tile
        return 1e3 * steady_ms([
            lambda s=s: paged_decode_attention_splits(
                *s[:5], bound, HEAD_DIM**-0.5, chosen.num_splits, block_n=block_n, num_warps=warps,
                num_stages=stages, min_split_len=chosen.min_split_len, append=s[5])
            for s in sets])

    table_us = time_us(tuple(chosen[1:4]))
    return chosen, table_us, {tile: table_us / time_us(tile) for tile in TILES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default=",".join(map(str, GRAPH_BATCHES)))
    parser.add_argument("--contexts", default="200,1000,3000")
    parser.add_argument("--bound", type=int, default=4096, help="the graph's max_seq_len bound")
    parser.add_argument("--max-kv-tokens", type=int, default=512 * 1100, help="skip larger batch x context")
    args = parser.parse_args()
    sms = num_sms()
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, bound {args.bound}; per case: the table's launch "
          "(splits, keys a tile, warps, stages) and us a call, then each tile's speed relative to it")
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batch_sizes.split(",")):
            if batch * context > args.max_kv_tokens:
                continue
            chosen, table_us, speed = time_case(batch, context, args.bound, sms)
            best = max(speed.values())
            cells = " ".join(f"{'/'.join(map(str, t))} {v:.2f}{'*' if v == best else ''}"
                             for t, v in speed.items())
            print(f"B{batch} x {context} ({batch * HKV / sms:.2f} programs a SM): table {tuple(chosen[:4])} "
                  f"{table_us:.1f} us | {cells}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
