"""The speculative decode step at a fixed batch size: verify, accept, draft. On GPUs it is captured once
per batch size and replayed from a CUDA graph; elsewhere it runs as it is (the same code on the same
buffers, which is how the CPU tests cover what the graphs do).

Every request of the step is a decode: it verifies its newest token and up to k drafts, t_0 .. t_k at
positions start .. start + k (rows past its num_drafts are padding: their K/V is not kept and they are
never accepted). In order, on the device:
  1. the target's forward over the B x (k + 1) tokens (the chunked-prefill attention kernel, query
     length k + 1) and its logits;
  2. accept_drafts (rejection_sampler.py): request b emits its a accepted drafts and one token of the
     target's, the bonus token b', at position start + a + 1;
  3. with a draft model: its forward over (t_a, b') at positions start + a, start + a + 1, whose last
     row proposes d_1, then k - 1 one-token rounds for d_2 .. d_k.
The draft's KV stays whole: when this step began it held every position up to start + k - 1 (the
rounds of the step before wrote t_1 .. t_{k-1}); step 3 rewrites start + a and adds b' and
d_1 .. d_{k-1}. out holds [tokens (k + 1) | count | proposals (k)] per request.

The host waits only for the verify part: its tokens and counts are copied back between the two graphs,
and the proposals follow on their own (PendingDrafts). So the engine schedules and stages the next step
while the draft model still runs, and the next step reads the proposals where they are: a request whose
prev_row is its row in the step before takes its drafts t_1 .. t_k from that step's out, on the device.

Where each row's K/V goes depends only on what the host knows (each request's start, block table and the
slots it holds), except for the draft's rows, which start after the a drafts the step accepts: so the host
stages the slots, positions and lengths of every position a step can write, start .. start + 2k, and the
device only picks the draft's by a (a few gathers, not a few dozen small launches). A write at a position
outside the slots the request holds (the draft's rounds near its max_tokens, padding rows) is dropped
(slot -1), so no other request's KV can be touched.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fastllm.compile.cuda_graphs import (SAMPLING_ROWS, graph_sampling_metadata, record_graph, reset_graphs,
                                         time_graph)
from fastllm.kernels import dispatch as kernels
from fastllm.layers.sampler import exponential_noise, filtered_probs
from fastllm.spec_decode.rejection_sampler import accept_drafts
from fastllm.worker.attn_metadata import AttentionMetadata, TokenRows, forward_context
from fastllm.worker.streams import current_stream, engine_stream

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ModelFns:
    forward: Callable  # (input_ids [T], positions [T]) -> hidden [T, H]
    compute_logits: Callable  # hidden [N, H] -> logits [N, V]
    attention_layers: list
    # (input_ids [1], positions [1], metadata) -> hidden [1, H]: a one-request step's one-token rounds in one
    # launch each (draft_decoder.py); None: the rounds run forward
    decoder: Callable | None = None


class SpecDecodeStep:
    def __init__(self, target: ModelFns, draft: ModelFns | None, k: int, sizes: list[int], max_blocks_per_seq: int,
                 max_model_len: int, block_size: int, vocab_size: int, device: torch.device,
                 synthetic_acceptance_rate: float | None = None, num_prob_slots: int = 0):
        self.target, self.draft, self.k = target, draft, k
        self.sizes = sorted(set(sizes))
        n = self.max_bs = self.sizes[-1]
        self.max_model_len, self.block_size, self.vocab_size = max_model_len, block_size, vocab_size
        self.device = device
        self.synthetic_acceptance_rate = synthetic_acceptance_rate
        # Inputs, packed as one staging copy lays them out: int64 [tokens (n, k + 1) | num_drafts | prob_slot
        # | prev_row | the verify rows' slots and positions (n, k + 1) each | the slots and positions of
        # start .. start + 2k (2, n, 2k + 1)], then int32 [the verify rows' lengths (n, k + 1) | the lengths
        # of start .. start + 2k (n, 2k + 1) | sampling params (SAMPLING_ROWS, n), float32 bits | the step's
        # block tables at its own width], spread into block_tables before each replay. (A position's slot
        # is -1 past what its request holds, its position clamped to max_model_len - 1, its length the
        # position + 1: the keys its row attends to. The verify rows' are the span's first k + 1 columns,
        # staged again as arrays of their own so that the verify reads them contiguous, with no gather.)
        span = self.span = 2 * k + 1
        self.int64_rows = 3 * (k + 1) + 3 + 2 * span
        self.int32_start = self.int64_rows * n * 8
        self.int32_fixed = (k + 1 + span) * n
        int32_size = self.int32_fixed + SAMPLING_ROWS * n + n * max_blocks_per_seq
        self.static = torch.zeros(self.int32_start + 4 * int32_size, dtype=torch.uint8, device=device)
        i64 = self.static[:self.int32_start].view(torch.int64)
        self.tokens, i64 = i64[:n * (k + 1)].view(n, k + 1), i64[n * (k + 1):]
        (self.num_drafts, self.prob_slot, self.prev_row), i64 = i64[:3 * n].view(3, n), i64[3 * n:]
        self.verify_slots, self.verify_positions = i64[:2 * n * (k + 1)].view(2, n, k + 1)
        self.span_slots_positions = i64[2 * n * (k + 1):].view(2, n, span)  # [slots; positions]
        i32 = self.static[self.int32_start:].view(torch.int32)
        self.verify_lens = i32[:n * (k + 1)].view(n, k + 1)
        self.span_lens = i32[n * (k + 1):self.int32_fixed].view(n, span)
        self._staged_i32 = i32[self.int32_fixed:]  # [sampling params |] block tables, as staged
        self.sampling_params = self._staged_i32[:SAMPLING_ROWS * n].view(torch.float32).view(SAMPLING_ROWS, n)
        # The draft's rows in the span arrays: request b's row a + column, a its accepted drafts; the pair's
        # columns 0 and 1, the one-token rounds' 2 .. k (a round's rows contiguous)
        self._row_starts = torch.arange(n, device=device) * span
        self._pair_columns = torch.arange(2, device=device)
        self._round_columns = 2 + torch.arange(k - 1, device=device).unsqueeze(1)  # [k - 1, 1]
        self._query_starts = {q: torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=device)
                              for q in (1, 2, k + 1)}
        self._token_requests = {q: torch.arange(n, device=device).repeat_interleave(q) for q in (2, k + 1)}
        # A row's keys end at start + q_len, past max_model_len near a request's end (the draft's last round:
        # max_model_len + 2k): the attention reads that far through the table, so it has the columns.
        self.max_seq_len = max_model_len + 2 * k
        self.block_tables = torch.zeros(n, -(-self.max_seq_len // block_size), dtype=torch.int32, device=device)
        self.out = torch.zeros(n, 2 * k + 2, dtype=torch.int64, device=device)
        self._verified_host = torch.zeros(n, k + 2, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        # q of the drafts a sampled request proposed, kept for the step that verifies them: one slot per
        # request (the runner assigns them), the last slot for padding rows.
        self.draft_probs = None
        if draft is not None and num_prob_slots:
            self.draft_probs = torch.zeros(num_prob_slots + 1, k, vocab_size, dtype=torch.float32, device=device)
        # (batch size, sampling) -> the verify graph and the propose graph (a draft model's)
        self.graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self.capture_stream = engine_stream(device) if device.type == "cuda" else None
        self.capture_seconds = 0.0
        self.step_ms: dict[int, float] = {}  # batch size -> a greedy replay's GPU time (the cost model's)
        self.replay = device.type == "cuda"
        # Benchmarks: the synthetic acceptance rate as a device scalar (changed without new graphs), and
        # CUDA events around the two parts of each step.
        self.synthetic_rate = torch.tensor([synthetic_acceptance_rate or 0.0], device=device)
        self.timing = False
        self._timed: list[list[torch.cuda.Event]] = []  # each timed step's events, read when asked

    @property
    def scratch_slot(self) -> int:
        return self.draft_probs.shape[0] - 1 if self.draft_probs is not None else 0

    def padded_size(self, num_reqs: int) -> int:
        return next(s for s in self.sizes if s >= num_reqs)

    # host side

    def stage(self, stager, tokens: np.ndarray, start: np.ndarray, num_drafts: np.ndarray, kv_limit: np.ndarray,
              prob_slot: np.ndarray, prev_row: np.ndarray, sampling_params: np.ndarray | None,
              block_tables: np.ndarray) -> None:
        """Copy a step's inputs of B requests into the static buffers (rows B.. of a padded size are
        padding: nothing written, nothing accepted). block_tables [B', width], B' the padded size. A row
        whose prev_row is >= 0 takes its drafts from that row of the step before (its tokens[1:] are
        ignored)."""
        n, num_reqs, width = self.max_bs, len(start), self.k + 1
        head = np.zeros((width + 3) * n, dtype=np.int64)
        head[:n * width].reshape(n, width)[:num_reqs] = tokens
        drafts_, slot_, prev_ = head[n * width:].reshape(3, n)
        drafts_[:num_reqs] = num_drafts
        slot_[:] = self.scratch_slot
        slot_[:num_reqs] = prob_slot
        prev_[:] = -1
        prev_[:num_reqs] = prev_row
        slots, positions, lens = self.span_rows(start, kv_limit, block_tables)
        int32_arrays = [lens[:, :width], lens, block_tables]
        if sampling_params is not None:
            int32_arrays.insert(2, sampling_params.view(np.int32))
        stager.send_into([head, slots[:, :width], positions[:, :width], slots, positions], int32_arrays,
                         self.static, self.int32_start)
        rows, width = block_tables.shape
        start32 = self.sampling_params.numel() if sampling_params is not None else 0
        self.block_tables[:rows, :width].copy_(self._staged_i32[start32:start32 + rows * width].view(rows, width))

    def span_rows(self, start: np.ndarray, kv_limit: np.ndarray, block_tables: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The positions start .. start + 2k of each request (rows past them: 0 .., writing nothing) as
        slots [n, 2k + 1] int64 (-1 from kv_limit on), positions (clamped to max_model_len - 1) and lengths
        (position + 1, int32)."""
        n, num_reqs = self.max_bs, len(start)
        position = np.tile(np.arange(self.span, dtype=np.int64), (n, 1))
        position[:num_reqs] += start[:, None]
        slots = np.full((n, self.span), -1, dtype=np.int64)
        if num_reqs:
            mine = position[:num_reqs]
            columns = np.minimum(mine // self.block_size, block_tables.shape[1] - 1)
            blocks = np.take_along_axis(block_tables[:num_reqs], columns, axis=1).astype(np.int64)
            in_cache = blocks * self.block_size + mine % self.block_size
            slots[:num_reqs] = np.where(mine < kv_limit[:, None], in_cache, -1)
        return slots, np.minimum(position, self.max_model_len - 1), (position + 1).astype(np.int32)

    def execute(self, num_reqs: int, sampling: bool) -> tuple[np.ndarray, PendingDrafts | None]:
        """Run the staged step (replay its graphs where there are some). Returns out[:num_reqs, :k + 2]
        (tokens, count) on the host once the verify part is done, which the next execute overwrites,
        and, with a draft model, its proposals on their way to the host. With `timing` on, each step's
        verify and propose GPU time is kept for timings()."""
        bs, k = self.padded_size(num_reqs), self.k
        if not self.replay:
            self.run(bs, sampling)
            # eager (on a CPU, or on a GPU without graphs): the step is done, and these copies wait for it
            host = self.out[:num_reqs].to("cpu", copy=True)
            proposals = PendingDrafts(host[:, k + 2:]) if self.draft is not None else None
            return host[:, :k + 2].numpy(), proposals
        stream = current_stream(self.device)
        verified = self._verified_host[:num_reqs]
        verify_done = torch.cuda.Event()

        def verified_to_host() -> None:  # once the verify part is done, while the draft model runs
            verified.copy_(self.out[:num_reqs, :k + 2], non_blocking=True)
            verify_done.record(stream)

        proposals = events = None
        graphs = self.graphs.get((bs, sampling))
        if graphs is None:
            # The first step of this size and kind: capturing its graphs runs it once first, and that run
            # is the step. (Replaying it as well would verify its drafts against the q it just replaced.)
            self._capture(bs, sampling)
            verified_to_host()
        else:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)] if self.timing else None
            for i, graph in enumerate(graphs):
                if events:
                    events[i].record(stream)
                graph.replay()
                if i == 0:  # the verify part
                    verified_to_host()
        if self.draft is not None:
            proposals = PendingDrafts(self.out[:num_reqs, k + 2:].to("cpu", non_blocking=True), torch.cuda.Event())
            proposals.ready.record(stream)
        if events:
            events[-1].record(stream)
            self._timed.append(events)
        verify_done.synchronize()
        return verified.numpy(), proposals

    def timings(self) -> list[tuple[float, float]]:
        """(verify, propose) milliseconds of each step run with timing on (waits for the last to end)."""
        if self._timed:
            self._timed[-1][-1].synchronize()
        return [(e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2]) if len(e) > 2 else 0.0) for e in self._timed]

    def clear_timings(self) -> None:
        self._timed.clear()

    # the step

    @torch.inference_mode()
    def run(self, bs: int, sampling: bool) -> None:
        self.verify(bs, sampling)
        if self.draft is not None:
            self.propose(bs, sampling)

    def verify(self, bs: int, sampling: bool) -> None:
        """The target over the verify rows, and accept_drafts: out[:, :k + 2]."""
        k = self.k
        num_drafts, tokens, prev_row = self.num_drafts[:bs], self.tokens[:bs], self.prev_row[:bs]
        # the drafts that the step before proposed, still in its out (this part writes out[:, :k + 2] only)
        chained = self.out.index_select(0, prev_row.clamp(min=0))[:, k + 2:]
        tokens[:, 1:] = torch.where((prev_row >= 0).unsqueeze(1), chained, tokens[:, 1:])
        logits = self._forward(self.target, tokens, self.verify_slots[:bs].view(-1),
                               self.verify_positions[:bs].view(-1), self.verify_lens[:bs].view(-1))
        target_tokens = kernels.argmax(logits).view(bs, k + 1)
        logits = logits.view(bs, k + 1, -1)
        drafts = tokens[:, 1:]
        accept_args = {}
        if sampling and self.synthetic_acceptance_rate is None:
            metadata = graph_sampling_metadata(self.sampling_params[:, :bs])
            p = filtered_probs(logits.view(bs * (k + 1), -1).float(), _repeat_rows(metadata, k + 1))
            drawn = (p / exponential_noise(p, {})).argmax(dim=-1).view(bs, k + 1)
            target_tokens = torch.where(metadata.greedy.unsqueeze(1), target_tokens, drawn)
            q = self.draft_probs[self.prob_slot[:bs]] if self.draft_probs is not None else \
                torch.nn.functional.one_hot(drafts, p.shape[-1]).float()  # n-gram proposals: q is one-hot
            accept_args = dict(sampled_rows=~metadata.greedy, target_probs=p.view(bs, k + 1, -1), draft_probs=q)
        rate = self.synthetic_rate[0] if self.synthetic_acceptance_rate is not None else None
        out_tokens, num_tokens = accept_drafts(target_tokens, drafts, num_drafts, synthetic_acceptance_rate=rate,
                                               **accept_args)
        self.out[:bs, :k + 1] = out_tokens
        self.out[:bs, k + 1] = num_tokens

    def propose(self, bs: int, sampling: bool) -> None:
        """The draft over (the last accepted input, the bonus token) at (position, position + 1), then
        its k - 1 one-token rounds: the next k drafts, out[:, k + 2:]."""
        k = self.k
        metadata = graph_sampling_metadata(self.sampling_params[:, :bs]) if sampling else None
        last = self.out[:bs, k + 1:k + 2] - 1  # [bs, 1]: the accepted drafts' count
        pair = torch.cat([self.tokens[:bs].gather(1, last), self.out[:bs].gather(1, last)], dim=1)
        # the draft's rows in the span arrays (flattened): request b's row a + column
        first = self._row_starts[:bs] + last.squeeze(1)
        pair_rows = (first.unsqueeze(1) + self._pair_columns).view(-1)  # [bs * 2]
        slots_positions, lens = self.span_slots_positions.view(2, -1), self.span_lens.view(-1)
        pair_slots, pair_positions = slots_positions[:, pair_rows]
        logits = self._forward(self.draft, pair, pair_slots, pair_positions, lens[pair_rows])
        logits = logits.view(bs, 2, -1)[:, 1]
        rounds = self._one_token_rounds(first.unsqueeze(0) + self._round_columns, bs)
        proposals, probs = [], []
        for round_index in range(k):
            if round_index:
                positions, attention = rounds[round_index - 1]
                logits = self._round_logits(proposals[-1], positions, attention, bs)
            token, q = self._draft_sample(logits, metadata)
            proposals.append(token)
            probs.append(q)
        if metadata is not None and self.draft_probs is not None:
            self.draft_probs.index_copy_(0, self.prob_slot[:bs], torch.stack(probs, dim=1))
        self.out[:bs, k + 2:] = torch.stack(proposals, dim=1)

    @staticmethod
    def _draft_sample(logits: torch.Tensor, metadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        greedy = kernels.argmax(logits)
        if metadata is None:
            return greedy, None
        q = filtered_probs(logits.float(), metadata)
        drawn = (q / exponential_noise(q, {})).argmax(dim=-1)
        return torch.where(metadata.greedy, greedy, drawn), q

    def _forward(self, model: ModelFns, input_ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
        """model's logits [bs * q_len, V] for input_ids [bs, q_len], each request's next q_len positions
        (slots, positions and lens [bs * q_len] from the span arrays) after those in the cache."""
        bs, q_len = input_ids.shape
        tables = self.block_tables[:bs]
        metadata = AttentionMetadata(
            slot_mapping=slots, block_tables=tables, seq_lens=lens.view(bs, q_len)[:, -1],
            query_start_loc=self._query_starts[q_len][:bs + 1], max_query_len=q_len,
            max_seq_len=self.max_seq_len,
            token_rows=TokenRows(tables.index_select(0, self._token_requests[q_len][:bs * q_len]), lens))
        return self._logits(model, input_ids.reshape(-1), positions, metadata)

    def _one_token_rounds(self, rows: torch.Tensor, bs: int) -> list[tuple[torch.Tensor, AttentionMetadata]]:
        """(positions [bs], metadata) of the one-token rounds at rows [rounds, bs] of the flattened span
        arrays, all gathered in one go: a handful of launches, not a dozen small ones a round."""
        slots, positions = self.span_slots_positions.view(2, -1)[:, rows]
        lens = self.span_lens.view(-1)[rows]
        query_start_loc = self._query_starts[1][:bs + 1]
        return [(positions[r], AttentionMetadata(
            slot_mapping=slots[r], block_tables=self.block_tables[:bs], seq_lens=lens[r],
            query_start_loc=query_start_loc, max_query_len=1, max_seq_len=self.max_seq_len))
            for r in range(rows.shape[0])]

    def _round_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                      bs: int) -> torch.Tensor:
        """The draft's logits of a one-token round: through its decoder kernel in a one-request step."""
        decoder = self.draft.decoder
        if decoder is None or bs != 1:
            return self._logits(self.draft, input_ids, positions, metadata)
        return self.draft.compute_logits(decoder(input_ids, positions, metadata))

    @staticmethod
    def _logits(model: ModelFns, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """model's logits [T, V] for input_ids [T] at positions [T], whose attention metadata is given."""
        with forward_context(metadata, model.attention_layers):
            hidden = model.forward(input_ids, positions)
        return model.compute_logits(hidden)

    # graphs

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the greedy step of every size and time each replay (the cost model's step times)."""
        start = time.perf_counter()
        self._stage_no_requests()  # the warm-up and timing runs write no KV
        for bs in reversed(self.sizes):
            self._capture(bs, sampling=False)
        self.capture_seconds = time.perf_counter() - start
        self.step_ms = {bs: sum(time_graph(g) for g in self.graphs[(bs, False)]) for bs in self.sizes}
        logger.info("speculative decoding: captured %d CUDA graphs of k=%d (batch sizes %d..%d) in %.1f s",
                    len(self.sizes), self.k, self.sizes[0], self.max_bs, self.capture_seconds)

    def _stage_no_requests(self) -> None:
        slots, positions, lens = (torch.from_numpy(a).to(self.device) for a in self.span_rows(
            np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.int32)))
        width = self.k + 1
        self.verify_slots.copy_(slots[:, :width])
        self.verify_positions.copy_(positions[:, :width])
        self.verify_lens.copy_(lens[:, :width])
        self.span_slots_positions.copy_(torch.stack([slots, positions]))
        self.span_lens.copy_(lens)

    def reset(self) -> None:
        """Destroy every graph of this step (it replays none after)."""
        reset_graphs(self.graphs)

    def _capture(self, bs: int, sampling: bool) -> list[torch.cuda.CUDAGraph]:
        """Warm up on the staged inputs (a real step's, when a sampling graph is first needed: the warm-up
        is that step) and record its parts."""
        with torch.inference_mode():
            self.run(bs, sampling)  # warm up (and compile this size if it is new)
        parts = [self.verify] + ([self.propose] if self.draft is not None else [])
        graphs = []
        for part in parts:
            graphs.append(record_graph(functools.partial(part, bs, sampling), self.pool, self.capture_stream))
            self.pool = self.pool or graphs[-1].pool()
        self.graphs[(bs, sampling)] = graphs
        return graphs


@dataclass
class PendingDrafts:
    """A batched step's proposals [B, k] on their way to the host (ready: the copy's event; None on the CPU)."""
    host: torch.Tensor
    ready: torch.cuda.Event | None = None

    def row(self, i: int) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host[i].tolist()


def _repeat_rows(metadata, times: int):
    """The sampling metadata of each request repeated over its `times` consecutive rows."""
    from dataclasses import replace

    def rep(t):
        return None if t is None else t.repeat_interleave(times)

    return replace(metadata, temperature=rep(metadata.temperature), greedy=rep(metadata.greedy),
                   top_k=rep(metadata.top_k), top_p=rep(metadata.top_p), min_p=rep(metadata.min_p))
