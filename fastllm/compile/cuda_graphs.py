"""Decode steps replayed from CUDA graphs, one captured per batch size.

Every captured graph reads its inputs from the same static buffers and writes the logits and their
argmax (greedy sampling) to the same static outputs; temporaries live in one shared memory pool.
A decode step whose every request samples without a seed, penalties, min_tokens or logprobs replays a
second graph of its size that also draws the tokens (temperature, top-k, top-p, min-p), up to
MAX_SAMPLING_GRAPH_SIZE rows: captured at the first such step of that size, so startup does not pay
for sizes no sampled request reaches.
A batch of B requests replays the smallest captured size >= B; the padding rows carry slot -1
(their K/V writes are skipped) and attend over one token of the null block (block 0, never handed
out), so they touch no real KV slot. The step's inputs are staged straight into the static buffers
(input_batch.py), padding rows included: a replay is one launch after the staging copy (and a
block-table spread). Prefill and mixed steps replay graphs of their own (mixed_graphs.py), in the same
memory pool, reading their in-flight tokens from the same `argmax`.
A decode step with cascade attention's groups (worker/cascade.py) replays a third graph of its size, whose
plan inputs are bounded static buffers (CascadeGraphInputs), captured at that size's first such step.
"""

from __future__ import annotations

import logging
import time

import torch

from fastllm.kernels import dispatch as kernels
from fastllm.layers.sampler import SamplingMetadata, exponential_noise, filtered_probs
from fastllm.worker.attn_metadata import AttentionMetadata, forward_context
from fastllm.worker.cascade import CascadeGraphInputs
from fastllm.worker.streams import engine_stream

logger = logging.getLogger(__name__)


# Larger decode batches run compiled without a graph: at 512 rows the GPU work of a step (~15 ms
# for an 8B model) dwarfs its launches, and every captured size costs startup time.
MAX_DEFAULT_CAPTURE_SIZE = 512

# Sampling graphs only up to this batch size. Their temporaries stay in the graphs' memory pool, which
# the KV-cache sizing did not see: by count of the sampler's live tensors (float32 logits and
# probabilities, sort values and int64 indices) some 30 bytes per row per vocabulary entry, ~0.25 GiB
# at 64 rows of a 128k vocabulary but ~2 GiB at 512 (an estimate, not measured). Larger batches sample
# outside the graph, where their launches are a small part of a long step.
MAX_SAMPLING_GRAPH_SIZE = 64


# static_i64: input_ids, positions, slot_mapping and token_src, max_bs rows each, then room for the
# rows that sample (when some row is a one-token prefill chunk rather than a decode).
STATIC_I64_ROWS = 5
# static_i32 after seq_lens: the sampling params, float32 bits, this many rows of max_bs.
SAMPLING_ROWS = 4


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (at most MAX_DEFAULT_CAPTURE_SIZE)."""
    largest = min(max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, 8) if s <= largest]
    sizes += list(range(16, largest + 1, 8))
    if sizes[-1] != largest:
        sizes.append(largest)
    return sizes


def graph_sampling_metadata(params: torch.Tensor) -> SamplingMetadata:
    """The sampler's metadata from a graph's float32 [temperature, top_k, top_p, min_p] x rows
    (temperature 0: a greedy row)."""
    temperature, top_k, top_p, min_p = params
    greedy = temperature == 0
    return SamplingMetadata(temperature=torch.where(greedy, 1.0, temperature), greedy=greedy, top_k=top_k.long(),
                            top_p=top_p, min_p=min_p, all_greedy=False, generators={}, penalty_rows=[], banned=[],
                            max_num_logprobs=None)


def record_graph(step, pool, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """step()'s launches captured into a new graph whose memory comes from `pool` (None: a new pool).
    torch.cuda.graph would also empty the allocator's cache before each capture, so that every
    size's warm-up had to cudaMalloc its activations afresh."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()  # the capture stream starts after everything queued before it
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            step()
        finally:
            graph.capture_end()
    return graph


def reset_graphs(table: dict) -> None:
    """Destroy the graphs of a {key: graph or list of graphs} table now, whoever else still holds them,
    and empty it. NCCL (2.26+) tears a communicator down only once every graph that captured one of its
    collectives is gone, so a sharded model's graphs must go before its process groups."""
    for entry in table.values():
        for graph in entry if isinstance(entry, list) else (entry,):
            graph.reset()
    table.clear()


def time_graph(graph: torch.cuda.CUDAGraph, repeats: int = 5) -> float:
    """Milliseconds of one replay (after one untimed replay), by CUDA events."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    begin.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / repeats


class CUDAGraphRunner:
    def __init__(self, forward, compute_logits, attention_layers, sizes: list[int], max_blocks_per_seq: int,
                 max_seq_len: int, vocab_size: int, dtype: torch.dtype, device: torch.device):
        self.forward, self.compute_logits = forward, compute_logits
        start_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.attention_layers = attention_layers
        self.sizes = sorted(set(sizes))
        self.max_bs = self.sizes[-1]
        self.max_seq_len = max_seq_len
        n = self.max_bs
        # The graphs' inputs, packed as the step's staging copy lays them out (input_batch.py), so a
        # decode step's host-to-device copy lands straight in them: int64 [input_ids, positions,
        # slot_mapping, token_src] of n rows each, then the rows that sample when not all do; int32
        # [seq_lens (n), the step's block-table rows at the step's width]. token_src[i] >= 0: row i's
        # input is the token the previous step sampled in that row, still on the device; the graph
        # reads it from `argmax` (where the previous step's tokens are).
        self.max_blocks_per_seq = max_blocks_per_seq
        # Both parts in one byte buffer, so that a step's inputs arrive in a single copy.
        self.int32_start = STATIC_I64_ROWS * n * 8
        self.static = torch.zeros(self.int32_start + 4 * (n + SAMPLING_ROWS * n + n * max_blocks_per_seq),
                                  dtype=torch.uint8, device=device)
        self.static_i64 = self.static[:self.int32_start].view(torch.int64)
        self.static_i32 = self.static[self.int32_start:].view(torch.int32)
        self.input_ids, self.positions, self.slot_mapping, self.token_src = self.static_i64[:4 * n].view(4, n)
        self.slot_mapping.fill_(-1)
        self.token_src.fill_(-1)
        self.seq_lens = self.static_i32[:n]
        # float32 [temperature, top_k, top_p, min_p] per row, for the graphs that also sample (their bits
        # ride in the int32 copy); temperature 0 is a greedy row, as are the padding rows.
        self.sampling_params = self.static_i32[n:(1 + SAMPLING_ROWS) * n].view(torch.float32).view(SAMPLING_ROWS, n)
        self._staged_tables = self.static_i32[n:]
        # What the graphs read, at the full width (a long max_model_len makes it thousands of blocks
        # wide): a step stages only its own width, and take_block_tables spreads it into these rows.
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # Outputs shared by every graph (one replays at a time): the logits, and their argmax, which
        # is the whole of sampling when every row is greedy. Graph-owned outputs would each stay
        # allocated: [size, vocab] for every captured size is over 1 GiB for a 128k vocabulary.
        self.logits = torch.zeros(n, vocab_size, dtype=dtype, device=device)
        self.argmax = torch.zeros(n, dtype=torch.int64, device=device)
        self.static_bytes = (torch.cuda.memory_allocated(device) - start_bytes) if device.type == "cuda" else 0
        self._last_tables = self._last_outputs = None  # (key, views): steps repeat their shapes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The same step followed by the sampler (sampling_params), captured at a size's first such step.
        self.sampling_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The same step with cascade attention's groups (enable_cascade), captured at a size's first such step.
        self.cascade_inputs: CascadeGraphInputs | None = None
        self.cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_stream = engine_stream(device) if device.type == "cuda" else None
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        # False runs the same padded step through the compiled forward without the graph: the
        # same kernels on the same buffers, so replay can be checked against it token for token.
        self.replay = True

    def enable_cascade(self) -> None:
        """Let decode steps with cascade groups replay graphs too (their plan staged by take_cascade_plan)."""
        self.cascade_inputs = CascadeGraphInputs(self.max_bs, self.max_seq_len, self.static.device)

    def _metadata(self, bs: int, cascade: bool = False) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.seq_lens[:bs],
                                 self.query_start_loc[:bs + 1], max_query_len=1, max_seq_len=self.max_seq_len,
                                 cascade=self.cascade_inputs.metadata(bs) if cascade else None)

    def in_flight_inputs(self, token_src: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, but row i is the previous step's sampled token in row token_src[i] of `argmax` where
        token_src[i] >= 0 (take_in_flight_tokens put them there)."""
        return torch.where(token_src >= 0, self.argmax.index_select(0, token_src.clamp(min=0)), input_ids)

    def _run(self, bs: int, cascade: bool = False) -> None:
        input_ids = self.in_flight_inputs(self.token_src[:bs], self.input_ids[:bs])
        with forward_context(self._metadata(bs, cascade), self.attention_layers):
            hidden = self.forward(input_ids, self.positions[:bs])
        self.compute_logits(hidden, out=self.logits[:bs])
        kernels.argmax(self.logits[:bs], out=self.argmax[:bs])

    def _sample(self, bs: int) -> None:
        """Replace the non-greedy rows' argmax with a draw under their temperature, top-k, top-p and
        min-p: the sampler's math on the static logits, with the default generator (capture-safe)."""
        metadata = graph_sampling_metadata(self.sampling_params[:, :bs])
        probs = filtered_probs(self.logits[:bs].float(), metadata)
        drawn = (probs / exponential_noise(probs, {})).argmax(dim=-1)
        self.argmax[:bs].copy_(torch.where(metadata.greedy, self.argmax[:bs], drawn))

    def _capture_sampling(self, bs: int) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        saved = self.argmax.clone()  # the previous step's tokens, which this step's inputs may read
        self._sample(bs)  # warm up the sampler's ops on this size, eagerly
        self.argmax.copy_(saved)
        graph = self.record(lambda: (self._run(bs), self._sample(bs)))
        self.sampling_graphs[bs] = graph
        logger.info("captured the sampling graph of batch %d in %.0f ms", bs, (time.perf_counter() - start) * 1e3)
        return graph

    def _capture_cascade(self, bs: int) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        saved = self.argmax.clone()  # the previous step's tokens, which this step's inputs may read
        self._run(bs, cascade=True)  # warm up the cascade kernels on this size (rewrites this step's K/V alike)
        self.argmax.copy_(saved)
        graph = self.record(lambda: self._run(bs, cascade=True))
        self.cascade_graphs[bs] = graph
        logger.info("captured the cascade-attention graph of batch %d in %.0f ms", bs,
                    (time.perf_counter() - start) * 1e3)
        return graph

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        for bs in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            size_start = time.perf_counter()
            self._run(bs)  # warm up (and compile this size if it is new)
            logger.debug("batch %d: warm-up %.2f s", bs, time.perf_counter() - size_start)
            self.graphs[bs] = self.record(lambda: self._run(bs))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-ups' activations, once (they lie outside the graphs' pool)
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_allocated() - before + self.static_bytes  # with the static buffers
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s, %.2f GiB",
                    len(self.graphs), self.sizes[0], self.max_bs, self.capture_seconds, self.pool_bytes / 2**30)

    def reset(self) -> None:
        """Destroy every graph of this runner (it replays none after)."""
        for table in (self.graphs, self.sampling_graphs, self.cascade_graphs):
            reset_graphs(table)

    def time_replays(self, sizes: list[int], repeats: int = 5) -> dict[int, float]:
        """Milliseconds of one replay per captured size in `sizes`. Only before the first step: the
        static inputs still hold capture's padding (no KV written)."""
        return {bs: time_graph(self.graphs[bs], repeats) for bs in sizes if bs in self.graphs}

    def record(self, step) -> torch.cuda.CUDAGraph:
        """step()'s launches captured into a new graph of the shared pool (the mixed steps' graphs too)."""
        graph = record_graph(step, self.pool, self.capture_stream)
        self.pool = self.pool or graph.pool()
        return graph

    def fits(self, num_scheduled: list[int], in_flight_tokens: torch.Tensor | None) -> bool:
        """Whether a step of these per-request token counts replays a graph: decode only, not too many,
        and the previous step's tokens (if still on the device) fit in `argmax`."""
        return bool(self.graphs) and len(num_scheduled) <= self.max_bs and all(n == 1 for n in num_scheduled) \
            and (in_flight_tokens is None or in_flight_tokens.shape[0] <= self.max_bs)

    def take_block_tables(self, rows: int, width: int, sampling: bool = False) -> None:
        """Copy the staged [rows, width] block tables (after the sampling params when `sampling`) into
        the first rows and columns of the graphs' table. Columns past a row's width keep older block
        ids: the kernels read a row only up to its seq_len, which the width covers."""
        key = (rows, width, sampling)
        if self._last_tables is None or self._last_tables[0] != key:
            start = self.sampling_params.numel() if sampling else 0
            self._last_tables = key, (self.block_tables[:rows, :width],
                                      self._staged_tables[start:start + rows * width].view(rows, width))
        dst, src = self._last_tables[1]
        dst.copy_(src)

    def take_in_flight_tokens(self, tokens: torch.Tensor) -> None:
        """Make `argmax` hold the previous step's sampled tokens (there already after a greedy replay)."""
        if tokens.data_ptr() != self.argmax.data_ptr():
            self.argmax[:tokens.shape[0]].copy_(tokens)

    def padded_size(self, num_reqs: int) -> int:
        return next(s for s in self.sizes if s >= num_reqs)

    def samples(self, num_reqs: int) -> bool:
        """Whether a step of num_reqs requests may draw its tokens in a sampling graph."""
        return self.padded_size(num_reqs) <= MAX_SAMPLING_GRAPH_SIZE

    def take_cascade_plan(self, plan, stager) -> None:
        """Copy a step's cascade plan (worker/cascade.py) into the cascade graphs' inputs, in one copy."""
        stager.send_into([], [self.cascade_inputs.pack(plan)], self.cascade_inputs.buffer.view(torch.uint8), 0)

    def replay_staged(self, num: int, sample_rows: torch.Tensor | None = None,
                      sampling: bool = False, cascade: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay for a batch of `num` one-token requests whose inputs (padding rows included, up to
        padded_size(num)) are already in the static buffers. Returns (logits [S, vocab], their argmax
        [S]) of the rows that sample: sample_rows, or all num rows when None (views of buffers the
        next replay overwrites, in that case). sampling: the sampling params are staged too, and the
        second tensor is the sampled tokens. cascade: a plan is staged (take_cascade_plan); not with sampling."""
        bs = self.padded_size(num)
        if self.replay:
            if cascade:
                graph = self.cascade_graphs.get(bs) or self._capture_cascade(bs)
            else:
                graph = self.graphs[bs] if not sampling else (self.sampling_graphs.get(bs) or self._capture_sampling(bs))
            graph.replay()
        else:
            with torch.inference_mode():
                self._run(bs, cascade)
                if sampling:
                    self._sample(bs)
        if sample_rows is not None:
            return self.logits[sample_rows], self.argmax[sample_rows]
        if self._last_outputs is None or self._last_outputs[0] != num:
            self._last_outputs = num, (self.logits[:num], self.argmax[:num])
        return self._last_outputs[1]
