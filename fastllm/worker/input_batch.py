"""The runner's persistent view of each request, and the flat batch built from it each step.

Per-step host work is kept to O(1) Python per request: each request keeps its block table as a
growing numpy row, and positions and slots are computed for the whole batch with numpy. A token
sampled by the step still in flight is not known on the host: its input row is filled on the
device from that step's sampled tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from fastllm.compile.cuda_graphs import SAMPLING_ROWS
from fastllm.layers.sampler import SamplingMetadata, SamplingRow
from fastllm.sampling_params import SamplingParams
from fastllm.worker.async_output import AsyncRunnerOutput
from fastllm.worker.attn_metadata import AttentionMetadata, CascadeMetadata, DecodeRows, leading_decodes
from fastllm.worker.cascade import CascadePlan
from fastllm.worker.staging import StepInputStager


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    max_total_tokens: int = 0  # prompt + max_tokens, within max_model_len (speculative decoding reads it)
    num_pending: int = field(default=0, init=False)  # sampled on the device, not yet appended here
    block_table: np.ndarray = field(init=False, repr=False)  # block_ids as int32, with spare capacity
    # Speculative decoding (spec_decode/spec_runner.py): leading positions whose draft-model KV is valid,
    # and the row of the draft's probabilities for this request's pending drafts (-1: none)
    draft_len: int = field(default=0, init=False)
    prob_slot: int = field(default=-1, init=False)
    # where this request's latest proposals are while the host has not read them: (PendingDrafts, its row)
    pending_drafts: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.set_block_ids(self.block_ids)

    def set_block_ids(self, block_ids: list[int]) -> None:
        self.block_ids = list(block_ids)
        self.block_table = np.zeros(max(16, 2 * len(block_ids)), dtype=np.int32)
        self.block_table[:len(block_ids)] = block_ids

    def append_block_ids(self, new_ids: list[int]) -> None:
        n = len(self.block_ids)
        if n + len(new_ids) > len(self.block_table):
            grown = np.zeros(2 * (n + len(new_ids)), dtype=np.int32)
            grown[:n] = self.block_table[:n]
            self.block_table = grown
        self.block_table[n:n + len(new_ids)] = new_ids
        self.block_ids.extend(new_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]


@dataclass
class StepInputs:
    # None when staged_for_graph: the graph reads its own static buffers
    input_ids: torch.Tensor | None  # [T] int64
    positions: torch.Tensor | None  # [T] int64
    attn_metadata: AttentionMetadata | None
    logits_indices: torch.Tensor | None  # [S] rows of the hidden states (graph: of the batch) that sample; None: all
    sample_states: list[CachedRequestState]  # the S requests that get a token this step
    sampling_metadata: SamplingMetadata | None  # None: nothing samples, or the graph draws (sampled_in_graph)
    staged_for_graph: bool = False  # inputs are in the CUDA graph runner's static buffers
    sampled_in_graph: bool = False  # and so are the sampling params: the replay draws the tokens
    cascade_in_graph: bool = False  # and a cascade plan: the replay is the cascade graph
    staged_for_mixed_graph: bool = False  # inputs are in the mixed-step graphs' buffers (mixed_graphs.py)
    # Speculative decoding: rows per sample state (its draft tokens + 1, in logits_indices' order), each
    # with the state's params in sampling_metadata; None when draft tokens are not verified (one row each)
    num_verify_rows: list[int] | None = None


def _stage_for_mixed_graph(mixed_graph, stager: StepInputStager, in_flight, batch, ids, positions, slots,
                           seq_lens, query_start_loc, logits_indices, vocab_size: int,
                           eos_token_id: int | None) -> StepInputs:
    """A prefill or mixed step staged into its mixed-graph bucket's static buffers (MixedGraphRunner.stage)."""
    logits_d = mixed_graph.stage(stager, in_flight, batch.from_device, ids, positions, slots, seq_lens,
                                 query_start_loc, batch.block_tables, logits_indices)
    return StepInputs(input_ids=None, positions=None, attn_metadata=None, logits_indices=logits_d,
                      sample_states=batch.sample_states, staged_for_mixed_graph=True,
                      sampling_metadata=_sampling_metadata(batch.sample_states, vocab_size, eos_token_id,
                                                           stager.device))


def build_step_inputs(
    states: list[CachedRequestState], num_scheduled: list[int], block_size: int, vocab_size: int,
    eos_token_id: int | None, stager: StepInputStager, in_flight: AsyncRunnerOutput | None = None,
    graph=None, spec_tokens: list[list[int]] | None = None, cascade: CascadePlan | None = None,
    mixed_graph=None,
) -> StepInputs:
    """Flatten the scheduled requests into one unpadded batch (or, for a graph, padded to its size).
    in_flight: the last step's output while its tokens are still on the device (rows whose input is
    such a token read it there).
    graph: a CUDAGraphRunner that fits this decode step: the inputs are staged straight into its
    static buffers, padded to its replay size.
    spec_tokens: each request's draft tokens, the last of its scheduled tokens (speculative decoding):
    every row of a sampling request from its last known token on gives logits (verify rows).
    cascade: the step's shared-prefix groups (worker/cascade.py), sent with the rest.
    mixed_graph: a MixedGraphRunner that fits this step (not a decode graph's): the inputs are staged
    straight into its static buffers, padded to its bucket."""
    counts = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
    ends = starts + counts
    # A graph's replay size of rows: the padding rows stay 0, the null block.
    table_rows = graph.padded_size(len(states)) if graph is not None else len(states)
    batch = _gather(states, num_scheduled, spec_tokens, in_flight, table_rows)
    query_start_loc, positions, slots = flat_positions(starts, counts, batch.block_tables, block_size)
    logits_indices, verify_rows = _logits_indices(query_start_loc, batch.sample_rows, spec_tokens)
    # Every token samples (a decode step): the hidden states are the logits' rows as they are.
    every_row = len(logits_indices) == int(query_start_loc[-1])
    if every_row:
        logits_indices = np.zeros(0, np.int64)
    ids = np.asarray(batch.input_ids, dtype=np.int64)
    seq_lens = ends.astype(np.int32)
    if graph is not None:
        assert not spec_tokens, "draft tokens are verified without CUDA graphs"
        return _stage_for_graph(graph, stager, in_flight, batch.from_device, ids, positions, slots, seq_lens,
                                batch.block_tables, None if every_row else logits_indices, batch.sample_states,
                                vocab_size, eos_token_id, cascade)
    if mixed_graph is not None:
        assert not spec_tokens and cascade is None, "draft tokens and cascade groups run without mixed graphs"
        return _stage_for_mixed_graph(mixed_graph, stager, in_flight, batch, ids, positions, slots, seq_lens,
                                      query_start_loc, None if every_row else logits_indices, vocab_size,
                                      eos_token_id)
    scatter = np.asarray(batch.from_device, dtype=np.int64).reshape(-1, 2).T
    tables = aligned_tables(batch.block_tables)
    decodes = leading_decodes(counts)
    split = 0 < decodes < len(counts)  # the decodes through the decode kernel, the rest through prefill's
    # (the rest's own copies: views at an offset would not be 16-byte aligned, a variant Triton compiles)
    rest = [tables[decodes:], seq_lens[decodes:], query_start_loc[decodes:]] if split else []
    (ids_d, positions_d, slots_d, logits_d, scatter_d), (tables_d, seq_lens_d, qsl_d, *more_d) = stager.send(
        [ids, positions, slots, logits_indices, scatter],
        [tables, seq_lens, query_start_loc, *rest, *(cascade.arrays() if cascade is not None else ())])
    rest_d, cascade_d = more_d[:len(rest)], more_d[len(rest):]
    if batch.from_device:
        ids_d.index_copy_(0, scatter_d[0], in_flight.sampled.index_select(0, scatter_d[1]))
    metadata = AttentionMetadata(
        slot_mapping=slots_d, block_tables=tables_d, seq_lens=seq_lens_d, query_start_loc=qsl_d,
        max_query_len=int(counts.max()), max_seq_len=int(ends.max()),
        cascade=None if cascade is None else CascadeMetadata(*cascade_d, cascade.max_group_rows, cascade.max_prefix_len,
                                                             cascade.max_suffix_len),
        decode_rows=DecodeRows(decodes, seq_lens_d[:decodes], *rest_d) if split else None,
    )
    drafts = None if verify_rows is None else [spec_tokens[i] for i in batch.sample_rows]
    return StepInputs(
        input_ids=ids_d,
        positions=positions_d,
        attn_metadata=metadata,
        logits_indices=None if every_row else logits_d,
        sample_states=batch.sample_states,
        sampling_metadata=_sampling_metadata(batch.sample_states, vocab_size, eos_token_id, stager.device, drafts),
        num_verify_rows=None if verify_rows is None else verify_rows.tolist(),
    )


TABLE_WIDTH_ALIGN = 16


def aligned_tables(tables: np.ndarray) -> np.ndarray:
    """Block tables padded with null blocks to a width that is a multiple of TABLE_WIDTH_ALIGN. The width is
    the attention kernels' row stride, and Triton specializes integer arguments on divisibility by 16 and
    on 1: unpadded, a step's longest request would pick one of three compiled variants, the others then
    compiling in the middle of serving."""
    width, padded = tables.shape[1], aligned_width(tables.shape[1])
    return tables if padded == width else np.pad(tables, ((0, 0), (0, padded - width)))


def aligned_width(width: int) -> int:
    """A block-table width rounded up to a multiple of TABLE_WIDTH_ALIGN (aligned_tables)."""
    return -(-width // TABLE_WIDTH_ALIGN) * TABLE_WIDTH_ALIGN


@dataclass
class _Gathered:
    """A step's requests as flat host lists: what build_step_inputs stages."""

    input_ids: list[int]
    from_device: list[tuple[int, int]]  # (flat input row, row of in_flight.sampled): tokens still on the device
    sample_rows: list[int]  # requests that sample this step (their last row's logits give the next token)
    sample_states: list[CachedRequestState]
    block_tables: np.ndarray  # [table_rows, widest table] int32; padding rows 0 (the null block)


def _gather(states, num_scheduled, spec_tokens, in_flight, table_rows: int) -> _Gathered:
    """Each request's input tokens (known ones, the in-flight one's place, its drafts), block table row, and
    whether it samples: one pass, O(1) Python a request."""
    batch = _Gathered([], [], [], [], np.zeros((table_rows, max(len(s.block_ids) for s in states)), dtype=np.int32))
    input_ids = batch.input_ids
    for i, (state, count) in enumerate(zip(states, num_scheduled)):
        start = state.num_computed_tokens
        drafts = spec_tokens[i] if spec_tokens else ()
        end = start + count - len(drafts)  # the draft tokens come after the known ones
        num_tokens = state.num_tokens
        if end <= num_tokens:
            input_ids.extend(state.token_slice(start, end))
        else:  # the newest token is still on the device
            assert end == num_tokens + 1 and in_flight is not None, "only the last step's token may be unknown"
            if start < num_tokens:
                input_ids.extend(state.token_slice(start, num_tokens))
            batch.from_device.append((len(input_ids), in_flight.rows[state.req_id]))
            input_ids.append(0)
        input_ids.extend(drafts)
        num_blocks = len(state.block_ids)
        batch.block_tables[i, :num_blocks] = state.block_table[:num_blocks]
        if end == num_tokens + state.num_pending:  # caught up: the last row's logits give the next token
            batch.sample_rows.append(i)
            batch.sample_states.append(state)
    return batch


def _logits_indices(query_start_loc: np.ndarray, sample_rows: list[int],
                    spec_tokens: list[list[int]] | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The flat rows whose logits are sampled: each sampling request's last row, or with drafts (speculative
    decoding) its last len(drafts) + 1 rows (verify_rows, per sampling request; None without drafts)."""
    logits_indices = query_start_loc[1:][sample_rows].astype(np.int64) - 1
    if not spec_tokens:
        return logits_indices, None
    verify_rows = np.fromiter((len(spec_tokens[i]) for i in sample_rows), dtype=np.int64, count=len(sample_rows)) + 1
    offsets = np.arange(int(verify_rows.sum())) - np.repeat(np.cumsum(verify_rows) - verify_rows, verify_rows)
    return np.repeat(logits_indices - verify_rows + 1, verify_rows) + offsets, verify_rows


def flat_positions(starts: np.ndarray, counts: np.ndarray, block_tables: np.ndarray,
                   block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A flat batch's query_start_loc [B + 1] (int32), positions [T] and KV slots [T] (int64): request
    i's counts[i] tokens from position starts[i], its blocks in row i of block_tables."""
    rows = np.arange(len(counts))
    if counts.sum() == len(counts):  # a decode step, one token each: the common case, in fewer numpy calls
        query_start_loc = np.arange(len(counts) + 1, dtype=np.int32)
        row_of_token, positions = rows, starts
    else:
        query_start_loc = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        row_of_token = np.repeat(rows, counts)
        first = query_start_loc[:-1].astype(np.int64)
        positions = np.arange(int(query_start_loc[-1])) - np.repeat(first - starts, counts)
    slots = block_tables[row_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return query_start_loc, positions, slots


def _sampling_metadata(sample_states, vocab_size, eos_token_id, device, drafts=None) -> SamplingMetadata | None:
    """drafts: each sample state's draft tokens (speculative decoding): its verify row j (of len + 1)
    is sampled as if drafts[:j] were already output, for the penalties and the min_tokens mask."""
    if sample_states and all(s.sampling_params.argmax_only for s in sample_states):
        return SamplingMetadata.argmax_rows()  # no per-row records to build
    if drafts is None and sample_states and all(s.sampling_params._beam_step for s in sample_states):
        return SamplingMetadata.beam_rows(len(sample_states), max(s.sampling_params.logprobs for s in sample_states))
    rows = [SamplingRow(s.sampling_params, s.generator, s.prompt_token_ids, s.output_token_ids, eos_token_id,
                        s.num_pending) for s in sample_states]
    if drafts is not None:
        rows = [row if not j else dataclasses.replace(row, output_token_ids=row.output_token_ids + d[:j])
                for row, d in zip(rows, drafts) for j in range(len(d) + 1)]
    return SamplingMetadata.build(rows, vocab_size, device) if rows else None


def _stage_for_graph(graph, stager, in_flight, from_device, ids, positions, slots, seq_lens, block_tables,
                     sample_rows, sample_states, vocab_size, eos_token_id, cascade=None) -> StepInputs:
    """A decode step's inputs copied straight into the graph's static buffers, padded to its replay
    size: int64 [ids | positions | slots | token_src] of max_bs rows each, then the rows that sample
    unless all do (a one-token prefill chunk does not), int32 [seq_lens of max_bs rows | block table
    rows up to the replay size, at this step's width]. Padding rows: slot -1 (no KV write), one
    token of the null block 0.
    No device views or metadata are made (but the sample rows'): the graph reads the buffers."""
    num_reqs, n = len(ids), graph.max_bs
    static = np.zeros((4, n), dtype=np.int64)
    static[0, :num_reqs], static[1, :num_reqs] = ids, positions
    static[2:] = -1
    static[2, :num_reqs] = slots
    if from_device:  # rows whose input is still on the device: the graph gathers it (token_src)
        rows, src = np.asarray(from_device, dtype=np.int64).T
        static[3, rows] = src
        graph.take_in_flight_tokens(in_flight.sampled)
    static_lens = np.ones(n, dtype=np.int32)
    static_lens[:num_reqs] = seq_lens
    int64_arrays = [static] if sample_rows is None else [static, sample_rows]
    # The graph draws the tokens when every row that samples allows it, not all are plain argmax and the
    # batch is small enough (cuda_graphs.MAX_SAMPLING_GRAPH_SIZE); the sampler's metadata (device tensors)
    # is then not needed.
    params = [s.sampling_params for s in sample_states]
    sampling = bool(params) and not all(p.argmax_only for p in params) and all(p.samples_in_graph for p in params) \
        and graph.samples(num_reqs) and cascade is None  # (a cascade graph samples no more than the argmax)
    metadata = None if sampling else _sampling_metadata(sample_states, vocab_size, eos_token_id, stager.device)
    int32_arrays = [static_lens, block_tables]
    if sampling:
        params = graph_sampling_params(sample_states, graph.sampling_params.shape[1], vocab_size, sample_rows)
        int32_arrays.insert(1, params.view(np.int32))
    stager.send_into(int64_arrays, int32_arrays, graph.static, graph.int32_start)
    graph.take_block_tables(*block_tables.shape, sampling=sampling)
    if cascade is not None:
        graph.take_cascade_plan(cascade, stager)
    logits_d = None if sample_rows is None else graph.static_i64[4 * n:4 * n + len(sample_rows)]
    return StepInputs(input_ids=None, positions=None, attn_metadata=None, logits_indices=logits_d,
                      sample_states=sample_states, sampling_metadata=metadata, staged_for_graph=True,
                      sampled_in_graph=sampling, cascade_in_graph=cascade is not None)


def graph_sampling_params(sample_states, num_rows: int, vocab_size: int, sample_rows=None) -> np.ndarray:
    """float32 [temperature, top_k, top_p, min_p] x num_rows for a graph's sampling params, state i's in
    row sample_rows[i] (default i): greedy (temperature 0) where a row does not sample, as the sampler's
    metadata sets them where it does."""
    params = np.zeros((SAMPLING_ROWS, num_rows), dtype=np.float32)
    params[1], params[2] = vocab_size, 1.0
    rows = range(len(sample_states)) if sample_rows is None else sample_rows
    for row, state in zip(rows, sample_states):
        p = state.sampling_params
        if not p.greedy:
            params[:, row] = (p.temperature, p.top_k if p.top_k > 0 else vocab_size, p.top_p, p.min_p)
    return params
