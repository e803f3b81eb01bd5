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

A write at a position outside the slots the request holds (kv_limit: the draft's rounds near its
max_tokens, padding rows) is dropped (slot -1), so no other request's KV can be touched.
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
from fastllm.worker.staging import step_stream

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ModelFns:
    forward: Callable  # (input_ids [T], positions [T]) -> hidden [T, H]
    compute_logits: Callable  # hidden [N, H] -> logits [N, V]
    attention_layers: list
    # (input_ids [B], positions [B], metadata) -> hidden [B, H] of a one-token round in one launch, for B up to
    # its max_rows (draft_decoder.py); None: the rounds run forward
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
        # Inputs, packed as one staging copy lays them out: int64 [tokens (n, k + 1) | start | num_drafts
        # | kv_limit | prob_slot | prev_row], then int32 [sampling params (SAMPLING_ROWS, n), float32 bits
        # | the step's block tables at its own width], spread into block_tables before each replay.
        self.int64_rows = k + 6
        self.int32_start = self.int64_rows * n * 8
        self.static = torch.zeros(self.int32_start + 4 * (SAMPLING_ROWS * n + n * max_blocks_per_seq),
                                  dtype=torch.uint8, device=device)
        i64 = self.static[:self.int32_start].view(torch.int64)
        self.tokens = i64[:n * (k + 1)].view(n, k + 1)
        self.start, self.num_drafts, self.kv_limit, self.prob_slot, self.prev_row = i64[n * (k + 1):].view(5, n)
        i32 = self.static[self.int32_start:].view(torch.int32)
        self.sampling_params = i32[:SAMPLING_ROWS * n].view(torch.float32).view(SAMPLING_ROWS, n)
        self._staged_i32 = i32  # [sampling params |] block tables, as staged
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
        self.capture_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
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
        i64 = np.zeros(self.int64_rows * n, dtype=np.int64)
        i64[:n * width].reshape(n, width)[:num_reqs] = tokens
        start_, drafts_, limit_, slot_, prev_ = i64[n * width:].reshape(5, n)
        start_[:num_reqs], drafts_[:num_reqs], limit_[:num_reqs] = start, num_drafts, kv_limit
        slot_[:] = self.scratch_slot
        slot_[:num_reqs] = prob_slot
        prev_[:] = -1
        prev_[:num_reqs] = prev_row
        int32_arrays = [block_tables]
        if sampling_params is not None:
            int32_arrays.insert(0, sampling_params.view(np.int32))
        stager.send_into([i64], int32_arrays, self.static, self.int32_start)
        rows, width = block_tables.shape
        start32 = self.sampling_params.numel() if sampling_params is not None else 0
        self.block_tables[:rows, :width].copy_(self._staged_i32[start32:start32 + rows * width].view(rows, width))

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
        stream = step_stream(self.device)
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
        start, num_drafts = self.start[:bs], self.num_drafts[:bs]
        tokens = self.tokens[:bs]
        prev_row = self.prev_row[:bs]
        # the drafts that the step before proposed, still in its out (this part writes out[:, :k + 2] only)
        chained = self.out.index_select(0, prev_row.clamp(min=0))[:, k + 2:]
        tokens[:, 1:] = torch.where((prev_row >= 0).unsqueeze(1), chained, tokens[:, 1:])
        logits = self._forward(self.target, tokens, start, k + 1, bs)
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
        position = self.start[:bs] + last.squeeze(1)
        pair = torch.cat([self.tokens[:bs].gather(1, last), self.out[:bs].gather(1, last)], dim=1)
        logits = self._forward(self.draft, pair, position, 2, bs).view(bs, 2, -1)[:, 1]
        rounds = self._one_token_rounds(position + 2, k - 1, bs)
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

    def _forward(self, model: ModelFns, input_ids: torch.Tensor, start: torch.Tensor, q_len: int,
                 bs: int) -> torch.Tensor:
        """model's logits [bs * q_len, V] for input_ids [bs, q_len] at positions start + 0 .. q_len - 1
        of each request, whose earlier positions are in the cache."""
        positions = start.unsqueeze(1) + torch.arange(q_len, device=start.device)
        tables = self.block_tables[:bs]
        token_rows = None
        if q_len > 1:
            token_rows = TokenRows(tables.repeat_interleave(q_len, dim=0), (positions + 1).view(-1).to(torch.int32))
        metadata = AttentionMetadata(
            slot_mapping=self._slots(positions, bs).view(-1), block_tables=tables,
            seq_lens=(start + q_len).to(torch.int32),
            query_start_loc=torch.arange(0, (bs + 1) * q_len, q_len, dtype=torch.int32, device=start.device),
            max_query_len=q_len, max_seq_len=self.max_seq_len, token_rows=token_rows)
        clamped = positions.clamp(max=self.max_model_len - 1).view(-1)
        return self._logits(model, input_ids.reshape(-1), clamped, metadata)

    def _one_token_rounds(self, first: torch.Tensor, rounds: int, bs: int
                          ) -> list[tuple[torch.Tensor, AttentionMetadata]]:
        """(positions [bs], metadata) of `rounds` rounds of one token a request at first + 0, 1, ..., all
        computed in one go: a handful of launches, not a dozen small ones a round."""
        positions = first.unsqueeze(1) + torch.arange(rounds, device=first.device)  # [bs, rounds]
        slots = self._slots(positions, bs).t().contiguous()  # [rounds, bs]: a round's row is contiguous
        seq_lens = (positions + 1).to(torch.int32).t().contiguous()
        clamped = positions.clamp(max=self.max_model_len - 1).t().contiguous()
        query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=first.device)
        return [(clamped[r], AttentionMetadata(
            slot_mapping=slots[r], block_tables=self.block_tables[:bs], seq_lens=seq_lens[r],
            query_start_loc=query_start_loc, max_query_len=1, max_seq_len=self.max_seq_len))
            for r in range(rounds)]

    def _slots(self, positions: torch.Tensor, bs: int) -> torch.Tensor:
        """The KV-cache slots of positions [bs, n] of each request; -1 (a dropped write) from its kv_limit
        on."""
        tables = self.block_tables[:bs]
        blocks = tables.gather(1, (positions // self.block_size).clamp(max=tables.shape[1] - 1))
        slots = blocks.to(torch.int64) * self.block_size + positions % self.block_size
        return torch.where(positions < self.kv_limit[:bs].unsqueeze(1), slots, -1)

    def _round_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                      bs: int) -> torch.Tensor:
        """The draft's logits of a one-token round: through its decoder kernel where it takes bs rows."""
        decoder = self.draft.decoder
        if decoder is None or bs > decoder.max_rows:
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
        self.kv_limit.zero_()  # no request: the warm-up and timing runs write no KV
        for bs in reversed(self.sizes):
            self._capture(bs, sampling=False)
        self.capture_seconds = time.perf_counter() - start
        self.step_ms = {bs: sum(time_graph(g) for g in self.graphs[(bs, False)]) for bs in self.sizes}
        logger.info("speculative decoding: captured %d CUDA graphs of k=%d (batch sizes %d..%d) in %.1f s",
                    len(self.sizes), self.k, self.sizes[0], self.max_bs, self.capture_seconds)

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
