"""Run-ahead beam steps on the device (core/beam_run_ahead.py is the host's side).

Each run-ahead search keeps on the device its last step's slot tables and the picks that make its next step's
slots: each slot's parent row, input token and cum logprob (float64, the host's sums to the bit). A step:
  1. each slot's table is its parent's, with the slot's ahead block at column position // block_size; where the
     position is not a block's first, that block is first filled with a copy of the parent's block there
     (CacheEngine.copy_indexed: raw bytes, so an FP8 cache's too);
  2. the forward on the slots' tokens (a decode graph's replay where one fits) and each row's top 2W logprobs
     (the sampler's beam path, as a synchronous beam step computes them);
  3. the picks: the best 2W of cum + logprob by a stable sort (ties in slot then rank order, as the host's
     sorted() leaves them), and the first W whose token is not EOS are the next step's slots. The 2W
     candidates are copied to the host, which applies transformers' rules to them a step later.
Nothing here waits for the host: the next step can launch on these picks at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from fastllm.core.scheduler_output import BeamSlotStep, ModelRunnerOutput, SchedulerOutput
from fastllm.layers.sampler import beam_step_candidates
from fastllm.tracing import nvtx_range
from fastllm.worker.attn_metadata import AttentionMetadata, forward_context
from fastllm.worker.streams import current_stream


@dataclass
class _SearchState:
    tables: torch.Tensor  # [rows, max_blocks] int32: the last step's slots' block tables
    parents: torch.Tensor  # [W] int64: each next slot's row in `tables`
    tokens: torch.Tensor  # [W] int64: each next slot's input token
    cum: torch.Tensor  # [W] float64: each next slot's cum logprob


class BeamSlotOutput:
    """A run-ahead step's candidates on their way to the host (AsyncRunnerOutput's part for beam slots)."""

    def __init__(self, steps: list[BeamSlotStep], cum: torch.Tensor, ids: torch.Tensor):
        self.search_ids = [s.search_id for s in steps]
        self.counts = [2 * s.beam_width for s in steps]
        self.wait_s = 0.0
        self._result: ModelRunnerOutput | None = None
        self._cum = cum.to("cpu", non_blocking=True) if cum.is_cuda else cum
        self._ids = ids.to("cpu", non_blocking=True) if ids.is_cuda else ids
        self._ready = None
        if cum.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record(current_stream(cum.device))

    @property
    def done(self) -> bool:
        return self._result is not None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            if self._ready is not None:
                start = time.perf_counter()
                self._ready.synchronize()
                self.wait_s = time.perf_counter() - start
            cum, (parents, tokens) = self._cum.tolist(), self._ids.tolist()
            candidates, start = {}, 0
            for search_id, count in zip(self.search_ids, self.counts):
                end = start + count
                candidates[search_id] = list(zip(cum[start:end], parents[start:end], tokens[start:end]))
                start = end
            self._result = ModelRunnerOutput([], [], beam_candidates=candidates)
        return self._result


class BeamSlotRunner:
    def __init__(self, runner):
        self.runner = runner
        self.block_size = runner.block_size
        self.max_blocks = -(-runner.config.model.max_model_len // self.block_size)
        self.states: dict[str, _SearchState] = {}

    def drop(self, search_ids) -> None:
        for search_id in search_ids:
            self.states.pop(search_id, None)

    def execute(self, sched: SchedulerOutput) -> BeamSlotOutput:
        steps, bs = sched.beam_slot_steps, self.block_size
        for step in steps:
            if step.entry_tables is not None:
                self.states[step.search_id] = self._entry(step)
        rows = [len(s.ahead_block_ids) for s in steps]
        n = sum(rows)
        positions = np.repeat(np.array([s.position for s in steps], dtype=np.int64), rows)
        ahead = np.concatenate([np.asarray(s.ahead_block_ids, dtype=np.int64) for s in steps])
        slots = ahead * bs + positions % bs
        seq_lens = (positions + 1).astype(np.int32)
        width = int(positions.max()) // bs + 1
        runner = self.runner
        graph = runner.graphs if runner.graphs is not None and runner.graphs.fits([1] * n, None) else None
        with nvtx_range("beam_slots_inputs"):
            if graph is not None:
                ahead_d = self._stage_for_graph(graph, n, positions, slots, seq_lens, ahead)
            else:
                (positions_d, slots_d, ahead_d), (seq_lens_d, qsl_d) = runner.stager.send(
                    [positions, slots, ahead], [seq_lens, np.arange(n + 1, dtype=np.int32)])
            tables, tokens = self._slot_tables(steps, rows, ahead_d)
        if graph is not None:
            padded = graph.padded_size(n)
            graph.block_tables[:n, :width].copy_(tables[:, :width])
            if padded > n:
                graph.block_tables[n:padded, :width].zero_()  # padding rows read the null block
            graph.take_in_flight_tokens(tokens)
            with nvtx_range("forward_graph"):
                logits, _ = graph.replay_staged(n)
        else:
            metadata = AttentionMetadata(slot_mapping=slots_d, block_tables=tables[:, :width].contiguous(),
                                         seq_lens=seq_lens_d, query_start_loc=qsl_d, max_query_len=1,
                                         max_seq_len=int(seq_lens.max()))
            with nvtx_range("forward"), forward_context(metadata, runner.attention_layers):
                hidden = runner.forward(tokens, positions_d)
            logits = runner.model.compute_logits(hidden)
        with nvtx_range("beam_slots_pick"):
            top = beam_step_candidates(logits, 2 * max(s.beam_width for s in steps)).logprobs
            cum, ids = self._pick(steps, rows, tables, *top)
        return BeamSlotOutput(steps, cum, ids)

    def _entry(self, step: BeamSlotStep) -> _SearchState:
        """A search's first run-ahead step: its slots as the host had them (parents: each slot itself)."""
        rows = len(step.entry_tables)
        tables = np.zeros((rows, self.max_blocks), dtype=np.int32)
        for i, table in enumerate(step.entry_tables):
            tables[i, :len(table)] = table
        device = self.runner.device
        return _SearchState(torch.from_numpy(tables).to(device), torch.arange(rows, device=device),
                            torch.tensor(step.entry_tokens, dtype=torch.int64, device=device),
                            torch.tensor(step.entry_cum_logprobs, dtype=torch.float64, device=device))

    def _stage_for_graph(self, graph, n: int, positions, slots, seq_lens, ahead) -> torch.Tensor:
        """The step's inputs into the decode graphs' static buffers in one copy (input_batch._stage_for_graph's
        layout): every row's token is read from `argmax` (token_src), where take_in_flight_tokens puts the picks;
        the ahead blocks ride in the sample rows' place. Returns them on the device."""
        size = graph.max_bs
        static = np.zeros((4, size), dtype=np.int64)
        static[1, :n] = positions
        static[2:] = -1
        static[2, :n] = slots
        static[3, :n] = np.arange(n)
        lens = np.ones(size, dtype=np.int32)
        lens[:n] = seq_lens
        runner = self.runner
        runner.stager.send_into([static, ahead], [lens], graph.static, graph.int32_start)
        return graph.static_i64[4 * size:4 * size + n]

    def _slot_tables(self, steps, rows, ahead_d) -> tuple[torch.Tensor, torch.Tensor]:
        """Every search's slots' tables (their parents', the ahead block at the step's column, the parents' partial
        blocks copied into them) and input tokens, in the step's row order."""
        tables, tokens, src, dst = [], [], [], []
        start = 0
        for step, num in zip(steps, rows):
            state = self.states[step.search_id]
            ahead = ahead_d[start:start + num]
            start += num
            column = step.position // self.block_size
            table = state.tables.index_select(0, state.parents)
            if step.copy_tail:
                src.append(table[:, column].long())
                dst.append(ahead)
            table[:, column] = ahead
            state.tables = table
            tables.append(table)
            tokens.append(state.tokens)
        if src:
            for cache in self.runner.caches:
                cache.copy_indexed(torch.cat(src), torch.cat(dst))
        return torch.cat(tables), torch.cat(tokens)

    def _pick(self, steps, rows, tables, top_ids, top_vals) -> tuple[torch.Tensor, torch.Tensor]:
        """Each search's best 2W candidates (cum logprob [2W] float64; slot and token [2, 2W] int64) and its
        next slots (the first W not EOS); returns every search's candidates, concatenated."""
        cums, ids = [], []
        start = 0
        for step, num in zip(steps, rows):
            state = self.states[step.search_id]
            k = 2 * step.beam_width
            vals, tokens = top_vals[start:start + num, :k], top_ids[start:start + num, :k]
            start += num
            cand = (state.cum[:, None] + vals.double()).flatten()
            order = torch.sort(cand, descending=True, stable=True).indices[:k]
            cum, token, parent = cand[order], tokens.flatten()[order], order // k
            ends = token == (-1 if step.eos_token_id is None else step.eos_token_id)
            running = torch.sort(ends.to(torch.int32), stable=True).indices[:step.beam_width]
            state.parents, state.tokens, state.cum = parent[running], token[running], cum[running]
            cums.append(cum)
            ids.append(torch.stack([parent, token]))
        return torch.cat(cums), torch.cat(ids, dim=1)
