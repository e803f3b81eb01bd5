"""Prefill and mixed steps (prefill chunks beside decodes) replayed from CUDA graphs, one captured per token
bucket.

A step of T scheduled tokens over B requests replays the graph of the smallest bucket >= T. The graph of a
bucket of T tokens is the compiled forward over static inputs: input_ids, positions, slot_mapping [T]
(padding tokens: slot -1, their K/V never written; they belong to no request, so no row attends to them),
block_tables, seq_lens [S] and query_start_loc [S + 1] with S = min(T, max_num_seqs) (padding requests have
no token), and the prefill kernel's tile map (kernels/prefill_tiles.py), whose fixed size, not the step's
longest chunk, sets the attention grid. The step's leading decodes attend through the decode kernel over
S fixed rows (DecodeRows: seq_lens [S], 0 past the decodes), the tile map leaving them out. Its output is
the hidden states [T, H], owned by the graph; the logits and the sampler run after it as for a compiled
step, on the rows that sample.
The step's inputs are staged straight into the static buffers (one copy) and the block tables spread into
the graphs' table, as for decode graphs (cuda_graphs.py), whose memory pool these graphs share; a token
sampled by the step still in flight is read on the device from the decode graphs' `argmax`.
Steps that do not come here run the compiled forward, said once per reason: more tokens than the largest
bucket, cascade attention, a previous step whose sampled rows overflow `argmax`. Speculative steps and
pipeline stages never do (their runners have their own paths).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from fastllm.compile.cuda_graphs import CUDAGraphRunner, reset_graphs
from fastllm.kernels.prefill_tiles import build_tile_map, max_tiles, query_tile_size
from fastllm.worker.attn_metadata import AttentionMetadata, DecodeRows, forward_context, leading_decodes

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 256, then every 128, up to max_tokens (the last): a step pads to at most twice its
    tokens, and to at most 1.5x past 256, where the forward starts to be bound by compute, not weights."""
    sizes = [t for t in (16, 32, 64, 128, 256) if t < max_tokens]
    return sizes + list(range(384, max_tokens, 128)) + [max_tokens]


def _aligned(n: int) -> int:
    """n int32 elements rounded up to 16 bytes (Triton specializes on 16-byte aligned pointers)."""
    return -(-n // 4) * 4


@dataclass
class _Bucket:
    """The static inputs of the graph of `tokens` tokens: views of MixedGraphRunner.static, in the layout a
    step stages: int64 [input_ids | positions | slot_mapping | token_src] of `tokens` rows each, then the
    rows that sample; int32 [seq_lens (S) | the decode rows' seq_lens (S) | query_start_loc (S + 1) |
    tile_map (N x 2) | the step's block tables at its own width], each part 16-byte aligned."""

    tokens: int
    num_seqs: int  # S
    num_tiles: int  # N
    decode_at: int  # int32 offsets of the parts after seq_lens
    qsl_at: int
    tile_map_at: int
    tables_at: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    token_src: torch.Tensor
    metadata: AttentionMetadata  # slot_mapping, block_tables, seq_lens, query_start_loc and tile_map


class MixedGraphRunner:
    def __init__(self, forward, attention_layers, buckets: list[int], max_num_seqs: int,
                 max_blocks_per_seq: int, max_seq_len: int, decode: CUDAGraphRunner, device: torch.device):
        self.forward, self.attention_layers, self.decode = forward, attention_layers, decode
        self.buckets = sorted(set(buckets))
        self.max_tokens = self.buckets[-1]
        self.max_num_seqs = max_num_seqs
        groups = {layer.num_heads // layer.num_kv_heads for layer in attention_layers}
        assert len(groups) == 1, f"layers with different GQA groups {groups}: one tile size per step"
        self.block_q = query_tile_size(groups.pop())
        start_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        max_seqs, *_, tables_at = self._layout(self.max_tokens)
        # int64 part: the largest bucket's 4 rows, then its sampling rows (one a request at most), 16-byte
        # aligned
        self.int32_start = 8 * (4 * self.max_tokens + 2 * -(-max_seqs // 2))
        self.static = torch.zeros(self.int32_start + 4 * (tables_at + max_seqs * max_blocks_per_seq),
                                  dtype=torch.uint8, device=device)
        self.static_i64 = self.static[:self.int32_start].view(torch.int64)
        self.static_i32 = self.static[self.int32_start:].view(torch.int32)
        # What the graphs read at the full width (a step stages its own width; _take_block_tables spreads it).
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.max_seq_len = max_seq_len
        self.views = {t: self._views(t) for t in self.buckets}
        self.static_bytes = torch.cuda.memory_allocated(device) - start_bytes if device.type == "cuda" else 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output [tokens, H]
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        self._last_tables = None  # (key, views): steps repeat their shapes
        self._said: set[str] = set()
        # False runs the same staged step through the compiled forward without the graph (the CPU tests).
        self.replay = True

    def _layout(self, tokens: int) -> tuple[int, int, int, int, int, int]:
        """A bucket's S, N and the int32 offsets of its decode rows' seq_lens, query_start_loc, tile map and
        staged tables."""
        num_seqs = min(tokens, self.max_num_seqs)
        num_tiles = max_tiles(tokens, num_seqs, self.block_q)
        decode_at = _aligned(num_seqs)
        qsl_at = decode_at + _aligned(num_seqs)
        tile_map_at = qsl_at + _aligned(num_seqs + 1)
        return num_seqs, num_tiles, decode_at, qsl_at, tile_map_at, tile_map_at + _aligned(2 * num_tiles)

    def _views(self, tokens: int) -> _Bucket:
        num_seqs, num_tiles, decode_at, qsl_at, tile_map_at, tables_at = self._layout(tokens)
        ids, positions, slots, token_src = self.static_i64[:4 * tokens].view(4, tokens)
        i32 = self.static_i32
        metadata = AttentionMetadata(
            slot_mapping=slots, block_tables=self.block_tables[:num_seqs], seq_lens=i32[:num_seqs],
            query_start_loc=i32[qsl_at:qsl_at + num_seqs + 1], max_query_len=tokens,
            max_seq_len=self.max_seq_len,
            tile_map=i32[tile_map_at:tile_map_at + 2 * num_tiles].view(num_tiles, 2),
            decode_rows=DecodeRows(num_seqs, i32[decode_at:decode_at + num_seqs]))
        return _Bucket(tokens, num_seqs, num_tiles, decode_at, qsl_at, tile_map_at, tables_at, ids, positions,
                       token_src, metadata)

    def bucket(self, num_tokens: int) -> int:
        return next(t for t in self.buckets if t >= num_tokens)

    def fits(self, num_tokens: int, in_flight_tokens: torch.Tensor | None, cascade) -> bool:
        """Whether a step of num_tokens tokens replays a graph; says once why not, per reason."""
        why = None
        if num_tokens > self.max_tokens:
            why = f"steps of more than {self.max_tokens} tokens (mixed_cuda_graph_max_tokens)"
        elif cascade is not None:
            why = "steps with cascade attention's groups"
        elif in_flight_tokens is not None and in_flight_tokens.shape[0] > self.decode.max_bs:
            why = f"steps after one that sampled more than {self.decode.max_bs} rows (the graphs read the " \
                  "in-flight tokens from the decode graphs' buffer)"
        if why is not None and why not in self._said:
            self._said.add(why)
            logger.info("a prefill or mixed step runs compiled without a CUDA graph: %s (logged once per "
                        "reason)", why)
        return why is None

    # one step

    def stage(self, stager, in_flight, from_device: list[tuple[int, int]], ids: np.ndarray,
              positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray,
              block_tables: np.ndarray, logits_indices: np.ndarray | None) -> torch.Tensor | None:
        """Copy a step's flat inputs into its bucket's static buffers, padded, in one copy; the rows whose
        input is the in-flight step's token (from_device: (flat row, row of in_flight.sampled)) read it
        on the device. Returns the device rows that sample (None: logits_indices None, every row)."""
        num_tokens, num_reqs = len(ids), len(seq_lens)
        b = self.views[self.bucket(num_tokens)]
        t = b.tokens
        assert num_reqs <= b.num_seqs, (num_reqs, b.num_seqs)
        num_sampled = 0 if logits_indices is None else len(logits_indices)
        i64 = np.zeros(4 * t + num_sampled, dtype=np.int64)
        i64[:num_tokens], i64[t:t + num_tokens] = ids, positions
        i64[2 * t:4 * t] = -1
        i64[2 * t:2 * t + num_tokens] = slots
        if from_device:
            rows, src = np.asarray(from_device, dtype=np.int64).T
            i64[3 * t + rows] = src
            self.decode.take_in_flight_tokens(in_flight.sampled)
        if num_sampled:
            i64[4 * t:] = logits_indices
        i32 = np.zeros(b.tables_at + block_tables.size, dtype=np.int32)
        i32[:num_reqs] = seq_lens
        query_lens = np.diff(query_start_loc)
        decodes = leading_decodes(query_lens)  # the decode kernel's rows; the tile map leaves them out
        i32[b.decode_at:b.decode_at + decodes] = seq_lens[:decodes]
        query_lens[:decodes] = 0
        i32[b.qsl_at:b.qsl_at + b.num_seqs + 1] = num_tokens  # padding requests: no token
        i32[b.qsl_at:b.qsl_at + num_reqs + 1] = query_start_loc
        tile_map = build_tile_map(query_lens, seq_lens, self.block_q, b.num_tiles)
        i32[b.tile_map_at:b.tile_map_at + tile_map.size] = tile_map.ravel()
        i32[b.tables_at:] = block_tables.ravel()
        stager.send_into([i64], [i32], self.static, self.int32_start)
        self._take_block_tables(b.tables_at, *block_tables.shape)
        return None if logits_indices is None else self.static_i64[4 * t:4 * t + num_sampled]

    def _take_block_tables(self, offset: int, rows: int, width: int) -> None:
        """The staged [rows, width] tables into the first rows and columns of the graphs' table (columns
        past a row's width keep older ids: the kernels read a row only up to its seq_len)."""
        key = (offset, rows, width)
        if self._last_tables is None or self._last_tables[0] != key:
            self._last_tables = key, (self.block_tables[:rows, :width],
                                      self.static_i32[offset:offset + rows * width].view(rows, width))
        dst, src = self._last_tables[1]
        dst.copy_(src)

    def replay_staged(self, num_tokens: int) -> torch.Tensor:
        """The hidden states [num_tokens, H] of the staged step (a view of the graph's output, which the
        next replay of its bucket overwrites)."""
        tokens = self.bucket(num_tokens)
        if self.replay:
            self.graphs[tokens].replay()
            hidden = self.hidden[tokens]
        else:
            hidden = self._run(tokens)
        return hidden[:num_tokens]

    def reset(self) -> None:
        """Destroy every graph of this runner (it replays none after)."""
        reset_graphs(self.graphs)

    def _run(self, tokens: int) -> torch.Tensor:
        b = self.views[tokens]
        input_ids = self.decode.in_flight_inputs(b.token_src, b.input_ids)
        with forward_context(b.metadata, self.attention_layers):
            return self.forward(input_ids, b.positions)

    # capture

    def _stage_empty(self, tokens: int) -> None:
        """A step of no request in the bucket's buffers: no KV is written and every attention program returns
        at once (the capture's warm-up and the captured launches are the same whatever the data)."""
        b = self.views[tokens]
        md = b.metadata
        for x, value in ((b.input_ids, 0), (b.positions, 0), (md.slot_mapping, -1), (b.token_src, -1),
                         (md.seq_lens, 0), (md.decode_rows.seq_lens, 0), (md.query_start_loc, 0),
                         (md.tile_map, -1)):
            x.fill_(value)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        for tokens in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            self._stage_empty(tokens)
            self._run(tokens)  # warm up (Triton's JIT for this size, outside the capture)

            def step(tokens=tokens):
                self.hidden[tokens] = self._run(tokens)
            self.graphs[tokens] = self.decode.record(step)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_allocated() - before + self.static_bytes
        logger.info("captured %d CUDA graphs of prefill and mixed steps (%s tokens) in %.1f s, %.2f GiB",
                    len(self.graphs), ", ".join(map(str, self.buckets)), self.capture_seconds,
                    self.pool_bytes / 2**30)
