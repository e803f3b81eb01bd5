"""The runner's persistent view of each request, and the flat batch built from it each step.

Per-step host work is kept to O(1) Python per request: each request keeps its block table as a
growing numpy row, and positions and slots are computed for the whole batch with numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fastllm.layers.sampler import SamplingMetadata, SamplingRow
from fastllm.sampling_params import SamplingParams
from fastllm.worker.attn_metadata import AttentionMetadata


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    block_table: np.ndarray = field(init=False, repr=False)  # block_ids as int32, with spare capacity

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
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows of the hidden states to sample from
    sample_req_ids: list[str]  # the S requests that get a token this step
    sampling_metadata: SamplingMetadata | None


def build_step_inputs(
    states: list[CachedRequestState], num_scheduled: list[int], block_size: int, vocab_size: int,
    eos_token_id: int | None, device: torch.device,
) -> StepInputs:
    """Flatten the scheduled requests into one unpadded batch."""
    num_reqs = len(states)
    counts = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
    ends = starts + counts
    max_blocks = max(len(s.block_ids) for s in states)
    block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    input_ids: list[int] = []
    sample_rows, sample_states = [], []
    for i, state in enumerate(states):
        start, end = int(starts[i]), int(ends[i])
        input_ids.extend(state.token_slice(start, end))
        block_tables[i, :len(state.block_ids)] = state.block_table[:len(state.block_ids)]
        if end == state.num_tokens:  # caught up: the last row's logits give the next token
            sample_rows.append(i)
            sample_states.append(state)

    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start_loc[1:])
    row_of_token = np.repeat(np.arange(num_reqs), counts)
    positions = np.arange(int(query_start_loc[-1])) - np.repeat(query_start_loc[:-1].astype(np.int64) - starts, counts)
    slots = block_tables[row_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size

    def to_device(array, dtype):
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64),
        block_tables=to_device(block_tables, torch.int32),
        seq_lens=to_device(ends, torch.int32),
        query_start_loc=to_device(query_start_loc, torch.int32),
        max_query_len=int(counts.max()),
        max_seq_len=int(ends.max()),
    )
    rows = [SamplingRow(s.sampling_params, s.generator, s.prompt_token_ids, s.output_token_ids, eos_token_id)
            for s in sample_states]
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=to_device(positions, torch.int64),
        attn_metadata=metadata,
        logits_indices=to_device(query_start_loc[1:][sample_rows] - 1, torch.int64),
        sample_req_ids=[s.req_id for s in sample_states],
        sampling_metadata=SamplingMetadata.build(rows, vocab_size, device) if rows else None,
    )
