"""The prefill attention kernel's query tiles, host side (no triton import): how many query tokens one
program covers, and the tile map that fixes a launch's grid whatever the step's mix of requests.

Without a tile map the grid is (cdiv(max_query_len, BLOCK_Q), B, Hkv): it follows the step, so a CUDA graph
captured at one step would replay the wrong grid at the next. A tile map [N, 2] int32 names, per program of
grid axis 0, the (request, query tile) it computes, -1 for a program that returns at once; the grid is then
(N, 1, Hkv) for any step whose tiles number at most N. A step of T tokens over S requests has at most
max_tiles(T, S, BLOCK_Q) of them (each request's last tile may be partial).
"""

from __future__ import annotations

import numpy as np


def block_m(group: int) -> int:
    """Rows of a program: BLOCK_M // group query tokens x the group's heads (at least one token's rows)."""
    return max(64, 1 << (group - 1).bit_length())


def query_tile_size(group: int) -> int:
    """BLOCK_Q: query tokens per program of the default launch (prefill_attention.choose_config's block_m)."""
    return block_m(group) // group


def max_tiles(num_tokens: int, num_reqs: int, block_q: int) -> int:
    """The most query tiles of T tokens split over S requests: cdiv(T, BLOCK_Q) + S."""
    return -(-num_tokens // block_q) + num_reqs


def build_tile_map(query_lens: np.ndarray, seq_lens: np.ndarray, block_q: int, size: int) -> np.ndarray:
    """[size, 2] int32: (request, query tile) of each of the requests' tiles, those whose rows see the most
    keys first (they run longest), then (-1, -1) entries. query_lens, seq_lens: [B] per request (q_len 0:
    no tile)."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    tiles = -(-query_lens // block_q)
    total = int(tiles.sum())
    assert total <= size, f"{total} query tiles do not fit a tile map of {size}"
    request = np.repeat(np.arange(len(tiles)), tiles)
    tile = np.arange(total) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    # keys seen by a tile's last row: the request's cached prefix and its chunk up to that row
    keys = np.asarray(seq_lens, dtype=np.int64)[request] - query_lens[request] \
        + np.minimum((tile + 1) * block_q, query_lens[request])
    order = np.argsort(-keys, kind="stable")
    out = np.full((size, 2), -1, dtype=np.int32)
    out[:total, 0], out[:total, 1] = request[order], tile[order]
    return out
