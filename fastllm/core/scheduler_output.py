"""The plain records that cross from the scheduler to the model runner and back. No tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Everything the runner needs about a request it has not seen (sent once)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens after the prompt that already exist (a forked sibling starts with none).
    output_token_ids: list[int] = field(default_factory=list)
    max_total_tokens: int = 0  # where it stops by length (the draft model drafts no further)


@dataclass(slots=True)
class CachedRequestData:
    """The per-step difference for a request the runner already holds."""

    req_id: str
    num_computed_tokens: int
    new_block_ids: list[int]
    # The whole block table, when it changed other than by appending (resumed after
    # preemption or swap, copy-on-write); new_block_ids is then empty.
    block_ids: list[int] | None = None


@dataclass
class BeamSlotStep:
    """One run-ahead beam search's step (core/beam_run_ahead.py): a row per slot, each computing `position`.
    The runner takes the slots' tokens, parents and tables from the search's previous step on the device
    (worker/beam_slots.py), except at the search's first such step, which carries them (entry_*)."""

    search_id: str
    position: int  # every slot's input position
    ahead_block_ids: list[int]  # [slots] the block each slot writes `position` into (its table's last entry)
    copy_tail: bool  # position is not a block's first: each ahead block starts as a copy of its parent's block
    beam_width: int  # the slots of the next step (this step's rows: len(ahead_block_ids))
    eos_token_id: int | None  # the token that ends a beam (None: ignore_eos)
    entry_tables: list[list[int]] | None = None  # [slots] block ids up to `position` (its block included if any)
    entry_tokens: list[int] | None = None  # [slots] input tokens
    entry_cum_logprobs: list[float] | None = None  # [slots]


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # the runner drops their state
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    step_id: int = 0  # the scheduler's count of steps; update_from_output pairs the output with it
    # req id -> draft tokens to verify this step: the last of its num_scheduled_tokens (speculative decoding)
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # tokens the proposer drafts after this step for each request that samples and may speculate (0: none)
    num_spec_proposals: int = 0
    # Run-ahead beam searches' steps (then the step's only work), and the searches whose device state goes
    beam_slot_steps: list[BeamSlotStep] = field(default_factory=list)
    ended_beam_slots: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and not self.beam_slot_steps


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # the scheduled requests, in batch order
    # The new tokens of each request: one for a request that reached the end of its known tokens,
    # none for one that computed only part of its prompt (a chunk), and with speculative decoding
    # the accepted draft tokens followed by one the target sampled.
    sampled_token_ids: list[list[int]]
    # For requests that asked for logprobs, one entry per new token: (the token's logprob, its rank,
    # [(token id, logprob) top-N]).
    logprobs: dict[str, list[tuple[float, int, list[tuple[int, float]]]]] = field(default_factory=dict)
    # req id -> the draft's proposals for the step after this one
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req id -> (position of the first scored prompt token, its entries like logprobs'): prompt_logprobs
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    # run-ahead search id -> its step's best 2 * beam_width candidates (cum logprob, slot, token), best first
    beam_candidates: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    # n-gram lookups for the next step that found nothing to propose (the policy counts each as a rejected draft)
    num_failed_lookups: int = 0
