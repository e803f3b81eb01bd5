"""Run-ahead beam steps: a beam search's next step is launched before the host has read its last one.

A synchronous beam step ends before the next is scheduled (the search picks the next inputs on the host), so
all of the host's work between two forwards is exposed. When the engine runs nothing but beam searches whose
beams each have one token to compute, a search goes on as slots instead of requests, one a running beam:

- the device picks each next slot's parent and token: the best 2 * beam_width of cum logprob + token logprob
  over the beams' top logprobs, ties in beam then rank order, and the first beam_width of them that are not
  EOS (transformers' rule); it gathers the slots' block tables by parent and copies each slot's partial last
  block from its parent (worker/beam_slots.py), so the next step launches on the picks at once;
- each step's block for the position a slot writes is allocated ahead (KVCacheManager.allocate_ahead), so no
  host bookkeeping stands between two steps;
- the host applies the same ranked candidates one step later (BeamSearch.advance_ranked: finished
  hypotheses, length penalty, early stopping, scores) and regroups the slots' blocks as the device did
  (KVCacheManager.regroup_slots). A search that ends by EOS or early stopping has launched one step more,
  whose output is dropped.

Anything else to run (a request, a search's prompt, a beam to recompute) or a pool too short for a step's
blocks drains the run-ahead searches: they launch nothing more, and once their steps in flight are applied
their slots become requests again (sharing their parents' blocks), which the synchronous path runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from fastllm.core.beam_search import BeamSearch
from fastllm.core.kv_cache_manager import KVCacheManager, cdiv
from fastllm.core.scheduler_output import BeamSlotStep
from fastllm.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from fastllm.config import EngineConfig


def run_ahead_off_reason(config: "EngineConfig") -> str | None:
    """Why this engine's beam searches never run ahead (None: they may)."""
    if not config.scheduler.beam_run_ahead:
        return "beam_run_ahead=False"
    if not config.scheduler.async_scheduling:
        return "async_scheduling=False"
    if config.speculative.enabled:
        return "speculative decoding is on"
    if config.parallel.world_size > 1:
        return "tensor/pipeline parallelism"
    if config.model.kv_sliding_window is not None:
        return "a sliding window frees blocks behind it"
    if config.cache.cascade_attention is True:
        return "cascade_attention=True (run-ahead steps attend without it)"
    return None


@dataclass(slots=True)
class BeamSlot:
    """A running beam of a run-ahead search: its generated tokens (what BeamSearch.advance_ranked reads)."""

    output_token_ids: list[int]


class RunAheadSearch:
    """One search's slots on the host: where its next step computes, its steps in flight, its picks."""

    def __init__(self, search: BeamSearch, beams: list[Request], kv: KVCacheManager):
        """Take over the search's running beams (each one token from its next step), their blocks included."""
        self.search = search
        self.template = beams[0]  # what the search's requests are copied from when it drains
        self.position = beams[0].num_computed_tokens  # the next step's input position
        assert all(b.num_computed_tokens == self.position == b.num_tokens - 1 for b in beams)
        self.block_size = kv.block_size
        kv.adopt_slots(search.request_id, [b.request_id for b in beams])
        self.entry = ([kv_ids(t) for t in kv.slot_tables[search.request_id]], [b.all_token_ids[-1] for b in beams],
                      list(search.cum_logprobs))
        search.set_beams([BeamSlot(b.output_token_ids) for b in beams], search.cum_logprobs)
        self.parents: list[int] | None = list(range(len(beams)))  # picks known, not yet regrouped by a step
        self.in_flight: deque[tuple[int, int]] = deque()  # (step id, position) launched, not applied
        self.draining = False

    @staticmethod
    def can_take_over(search: BeamSearch, beams: list[Request], kv: KVCacheManager) -> bool:
        """The search has forked to its full width (a step's picks are that many slots, so the slots stay as
        many as the blocks allocated ahead for them; a prompt chunked to its last token is one beam), and
        every beam runs, at one position, with one token to compute and nothing reported or in flight."""
        if len(beams) != search.params.beam_width or len(beams) != len(search.beams):
            return False
        position = beams[0].num_computed_tokens
        return all(b.status == RequestStatus.RUNNING and b.num_pending_tokens == 0 and not search.has_reported(b)
                   and b.num_computed_tokens == position == b.num_tokens - 1
                   and len(kv.req_blocks.get(b.request_id, ())) == cdiv(position, kv.block_size) for b in beams)

    def wants_step(self) -> bool:
        """Another step may still generate: the input at `position` is generated token number
        position - prompt + 1, and a step generates the one after it."""
        generated = self.position - len(self.search.prompt_token_ids) + 1
        return not self.draining and generated < self.search.max_tokens

    def schedule_step(self, kv: KVCacheManager, step_id: int) -> BeamSlotStep | None:
        """The next step, its blocks allocated ahead; None (nothing changed) when the pool is short."""
        search, p = self.search, self.position
        ahead = kv.allocate_ahead(search.request_id, len(search.beams))
        if ahead is None:
            return None
        step = BeamSlotStep(search.request_id, p, ahead, p % self.block_size != 0, search.params.beam_width,
                            search.eos_token_id)
        if self.entry is not None:
            step.entry_tables, step.entry_tokens, step.entry_cum_logprobs = self.entry
            self.entry = None
        if self.parents is not None:
            kv.regroup_slots(search.request_id, self.parents, p // self.block_size)
            self.parents = None
        self.in_flight.append((step_id, p))
        self.position += 1
        return step

    def apply(self, step_id: int, candidates: list[tuple[float, int, int]], kv: KVCacheManager) -> None:
        """A step's ranked candidates (cum logprob, slot, token), as the device ranked them: the search's rules,
        then the slots of the step after it (regrouped now if it was launched, else by the next schedule_step)."""
        launched_id, _ = self.in_flight.popleft()
        assert launched_id == step_id, f"step {step_id} applied while step {launched_id} was the oldest in flight"
        search = self.search
        slots = search.beams
        continuations = search.advance_ranked(candidates)
        if search.done:
            return
        index = {id(s): i for i, s in enumerate(slots)}
        parents = [index[id(c.parent)] for c in continuations]
        search.set_beams([BeamSlot(c.parent.output_token_ids + [c.token]) for c in continuations],
                         [c.cum_logprob for c in continuations])
        if self.in_flight:
            kv.regroup_slots(search.request_id, parents, self.in_flight[0][1] // self.block_size)
        else:
            self.parents = parents

    def to_requests(self, kv: KVCacheManager, new_id: Callable[[], str]) -> list[Request]:
        """Drained (nothing in flight): the slots as running requests, each sharing its parent's blocks, one token
        from its next step, as the synchronous path leaves a search after its advance."""
        assert not self.in_flight and self.parents is not None
        search, prompt = self.search, self.search.prompt_token_ids
        requests = []
        for slot in search.beams:
            request = self.template.copy_as(new_id())
            request.all_token_ids = prompt + slot.output_token_ids
            request.block_hashes = []
            request._update_hashes()
            request.num_computed_tokens = self.position
            request.status = RequestStatus.RUNNING
            requests.append(request)
        kv.slots_to_requests(search.request_id, self.parents, [r.request_id for r in requests])
        search.set_beams(requests, search.cum_logprobs)
        return requests


def kv_ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]
