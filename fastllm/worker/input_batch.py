"""The runner's persistent view of each request, and the flat batch built from it each step."""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


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
    input_ids, positions, slots = [], [], []
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    seq_lens = np.zeros(num_reqs, dtype=np.int32)
    max_blocks = max(len(s.block_ids) for s in states)
    block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    logits_indices, sample_states = [], []
    for i, (state, n) in enumerate(zip(states, num_scheduled)):
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        input_ids.extend(state.token_slice(start, end))
        pos = np.arange(start, end)
        positions.append(pos)
        table = np.asarray(state.block_ids, dtype=np.int64)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        block_tables[i, :len(state.block_ids)] = state.block_ids
        query_start_loc[i + 1] = query_start_loc[i] + n
        seq_lens[i] = end
        if end == state.num_tokens:  # caught up: the last row's logits give the next token
            logits_indices.append(query_start_loc[i + 1] - 1)
            sample_states.append(state)

    def to_device(array, dtype):
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=to_device(np.concatenate(slots), torch.int64),
        block_tables=to_device(block_tables, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        query_start_loc=to_device(query_start_loc, torch.int32),
        max_query_len=max(num_scheduled),
        max_seq_len=int(seq_lens.max()),
    )
    rows = [SamplingRow(s.sampling_params, s.generator, s.prompt_token_ids, s.output_token_ids, eos_token_id)
            for s in sample_states]
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=to_device(np.concatenate(positions), torch.int64),
        attn_metadata=metadata,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64).to(device, non_blocking=True),
        sample_req_ids=[s.req_id for s in sample_states],
        sampling_metadata=SamplingMetadata.build(rows, vocab_size, device) if rows else None,
    )
