"""Scheduler: picks each step's work under a token budget and keeps the KV blocks in step with it.

There is no prefill phase and no decode phase. Every request has num_computed_tokens catching up
with num_tokens; a step gives each scheduled request a number of tokens to compute: a prompt
chunk, a whole prompt, or the single newest token. Order: running requests first (FCFS), then
swapped ones coming back, then waiting ones. When blocks run out, the newest running request (a beam
that has reported first) is preempted: its blocks are freed and it is recomputed later (default), or
moved to the CPU pool.

With async scheduling the engine schedules step N+1 before step N's tokens are known: a request
that will sample counts its in-flight token as pending (num_tokens_with_pending), so it is
scheduled for that token's KV at once; the runner reads the token itself from the device.

With speculative decoding a decode request is also scheduled for its draft tokens (spec_token_ids),
which the target verifies in the same forward. Each step also says how many tokens the proposer
drafts after it (num_spec_proposals: k, or 0 while the policy finds that speculation does not pay);
a request that will draft after the step holds that many more slots for a draft model's own KV
writes. The KV of rejected draft tokens is given back by lowering num_computed_tokens when the
step's output comes back.

A beam search (core/beam_search.py) runs its beams as requests that report their top logprobs instead
of appending a sampled token. Once all have reported, the search picks the continuations. A parent
whose continuation is the token its step sampled (its argmax, which the runner has already appended to
its copy) goes on in place, as a plain decode would; every other continuation is a fork of its parent
(all of its blocks shared, copy-on-write on the last partial one) with the chosen token appended, and
parents that do not go on are freed at once, so pruned and finished beams hold nothing. A beam is not
scheduled again while its position is in flight: its next token is not known yet.
When nothing but beam searches runs, they run ahead instead (core/beam_run_ahead.py): as slots whose next step
the device picks, launched before the host has read the last one.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from fastllm.config import CacheConfig, SchedulerConfig
from fastllm.core.beam_run_ahead import RunAheadSearch
from fastllm.core.beam_search import BeamSearch
from fastllm.core.block_hash import HashFn, hash_block_tokens
from fastllm.core.kv_cache_manager import KVCacheManager
from fastllm.core.scheduler_output import (
    BeamSlotStep,
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from fastllm.engine.request import Request, RequestStatus
from fastllm.spec_decode.policy import SpecPolicy
from fastllm.spec_decode.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


POOL_TOO_SHORT = "beam search: synchronous steps while the KV pool is too short to allocate a run-ahead step's " \
    "blocks ahead"


@dataclass
class _StepPlan:
    """What one schedule() call has decided so far."""

    budget: int  # tokens left under max_num_batched_tokens
    scheduled: dict[str, int] = field(default_factory=dict)  # req id -> tokens to compute
    # Blocks the runner already has, for running requests (-1: send the whole table).
    known_blocks: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: bool = False  # nothing new is admitted in a step that had to preempt

    def add(self, request: Request, num_new: int) -> None:
        self.scheduled[request.request_id] = num_new
        self.budget -= num_new


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        hash_fn: HashFn = hash_block_tokens,
        spec_policy: SpecPolicy | None = None,
        draft_writes_kv: bool = False,
        sliding_window: int | None = None,  # every layer's window: blocks behind it go back to the pool
        wait_for_sampled_tokens: bool = False,
        beam_run_ahead_off: str | None = "the scheduler was built without it",
    ):
        """beam_run_ahead_off: why beam searches never run ahead here (beam_run_ahead.run_ahead_off_reason), or
        None: they do when nothing else runs (the runner must run BeamSlotSteps)."""
        if scheduler_config.max_num_seqs is None:
            raise ValueError("max_num_seqs is unset: build the scheduler from EngineConfig.for_device(...)")
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.hash_fn = hash_fn if cache_config.enable_prefix_caching else None
        self.kv = KVCacheManager(num_gpu_blocks, self.block_size, cache_config.enable_prefix_caching,
                                 num_cpu_blocks if scheduler_config.preemption_mode == "swap" else 0, sliding_window)
        self.spec_policy = spec_policy  # None: no speculative decoding
        self.draft_writes_kv = draft_writes_kv  # a draft model (not n-gram lookup) writes KV past a step's tokens
        self.num_lookahead_tokens = 0  # this step's: the draft's slots past a request's tokens
        # Pipeline parallelism: a request whose sampled token is still in the pipeline waits for it (the
        # earlier stages learn tokens from the engine), so a decoding request is in one batch in flight.
        self.wait_for_sampled_tokens = wait_for_sampled_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.finished_req_ids: set[str] = set()  # since the last step; the runner drops them
        self._runner_knows: set[str] = set()
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()
        # The requests each step scheduled, until its output is applied. With a step in flight a
        # finished request's id may come back as a new request; its old step's token is not its.
        self._step_id = 0
        self._scheduled_requests: dict[int, dict[str, Request]] = {}
        self._step_filled: dict[int, list[tuple[int, int]]] = {}  # blocks each step fills (filled_identities)
        self._warned_swap_full = False
        self.beam_searches: dict[str, BeamSearch] = {}  # by the search's request id
        self._beam_of: dict[str, BeamSearch] = {}  # beam request id -> its search
        self._beam_sampled: dict[str, int] = {}  # beam request id -> its reported step's argmax
        self.finished_beam_searches: list[BeamSearch] = []  # until take_finished_beam_searches
        self.beam_run_ahead_off = beam_run_ahead_off
        self.run_ahead: dict[str, RunAheadSearch] = {}  # by search id: the searches running as slots
        self._slot_steps: dict[int, list[RunAheadSearch]] = {}  # step id -> the searches it ran ahead
        self._ended_slots: set[str] = set()  # searches whose slots' device state the runner drops
        self._said: set[str] = set()  # beam search paths and fallbacks logged (once each)
        self.num_run_ahead_steps = 0  # steps of run-ahead beam slots scheduled

    # requests in and out

    def add_request(self, request: Request) -> None:
        request.max_total_tokens = min(request.max_total_tokens, self.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            self._queue_of(request).remove(request)
            request.status = status
            self._free(request)

    def fail_step(self, scheduler_output: SchedulerOutput) -> tuple[list[Request], list[str]]:
        """A step that raised: its requests still going end as FINISHED_ERROR (blocks freed), and the
        beam searches its beams belong to end too; the others are untouched. Returns every request the
        step scheduled, and the ids of the searches ended."""
        scheduled = self._scheduled_requests.pop(scheduler_output.step_id, {})
        searches = []
        for ra in self._slot_steps.pop(scheduler_output.step_id, ()):
            if self.run_ahead.get(ra.search.request_id) is ra:
                self.finish_beam_search(ra.search.request_id)
                searches.append(ra.search.request_id)
        # Its prefix-cache blocks may hold no KV (a failure before or inside the forward): no hits on them.
        self.kv.uncache(self._step_filled.pop(scheduler_output.step_id, []))
        for request in scheduled.values():
            search = self._beam_of.get(request.request_id)
            if search is not None:
                if search.request_id in self.beam_searches:
                    self.finish_beam_search(search.request_id)
                    searches.append(search.request_id)
            elif not request.is_finished and self.requests.get(request.request_id) is request:
                self._queue_of(request).remove(request)
                request.status = RequestStatus.FINISHED_ERROR
                self._free(request)
        return list(scheduled.values()), searches

    def _queue_of(self, request: Request):
        status = request.status  # (no dict built a call: every pruned beam comes here)
        return self.running if status == RequestStatus.RUNNING else \
            self.swapped if status == RequestStatus.SWAPPED else self.waiting

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._runner_knows:
            self._runner_knows.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.run_ahead)

    @property
    def num_slots(self) -> int:
        """Beams running ahead as slots (core/beam_run_ahead.py): running, though neither in `running` nor
        in `requests`."""
        return sum(len(ra.search.beams) for ra in self.run_ahead.values())

    def beams_wait_for_steps_in_flight(self) -> bool:
        """Whether a running beam waits for a step in flight: its position is being computed, or its search
        advances once that step reports. Finishing the step before scheduling lets the beams join the next
        one; otherwise, beside requests that do not wait, they would run every other step."""
        if self.run_ahead and self._run_ahead_blocker() is not None:
            for ra in self.run_ahead.values():  # (their slots become requests once their steps are applied)
                ra.draining = True
        if any(ra.draining and ra.in_flight for ra in self.run_ahead.values()):
            return True
        return bool(self._beam_of) and any(self._beam_waits(r) for r in self.running)

    # one step

    def schedule(self) -> SchedulerOutput:
        slot_steps = self._schedule_beam_slots() if self.beam_searches else []
        if slot_steps:
            return self._build_slot_output(slot_steps)
        num_proposals = self.spec_policy.num_to_propose(len(self.running)) if self.spec_policy else 0
        self.num_lookahead_tokens = num_proposals if self.draft_writes_kv else 0
        plan = _StepPlan(self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_queued(plan)
        return self._build_output(plan, num_proposals)

    def _schedule_queued(self, plan: _StepPlan) -> None:
        """Swapped requests, then waiting ones. While nothing runs because every running request is a beam
        that has reported (it waits for the rest of its search, which may be queued for want of its blocks or
        its seat), such beams are preempted, newest first, until something is admitted."""
        while True:
            self._schedule_swapped(plan)
            if not self.swapped:
                self._schedule_waiting(plan)
            if plan.scheduled or not self.running or not all(map(self._has_reported, self.running)) \
                    or not any(not r.num_pending_tokens and not self._has_reported(r)
                               for r in (*self.swapped, *self.waiting)):
                return
            plan.swap_out += self._preempt(self.running.pop(self._victim_index()))  # (recomputed: no swap)

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Running requests first: their next chunk or token. Preempts (_victim_index) when blocks run out."""
        i = 0
        wait_for_tokens = self.wait_for_sampled_tokens
        while i < len(self.running) and plan.budget > 0:
            request = self.running[i]
            if self._waits_for_pending_token(request) or (wait_for_tokens and request.num_pending_tokens):
                i += 1  # nothing to compute until its newest token is known (in a pipeline: always)
                continue
            num_known = request.num_tokens_with_pending - request.num_computed_tokens
            num_new = min(num_known + len(request.spec_token_ids), plan.budget)
            plan.known_blocks[request.request_id] = len(self.kv.req_blocks.get(request.request_id, ()))
            while not self.kv.allocate_slots(request, num_new, num_lookahead_tokens=self._lookahead(request, num_new)):
                j = self._victim_index()
                victim = self.running.pop(j)
                i -= j < i
                plan.swap_out += self._preempt(victim)
                plan.preempted = True
                if victim is request:
                    return
            plan.add(request, num_new)
            if num_new > num_known:  # the draft tokens the budget leaves room for
                plan.spec_tokens[request.request_id] = request.spec_token_ids[:num_new - num_known]
            i += 1

    def _victim_index(self) -> int:
        """The running request to preempt: the newest beam that has reported (it has nothing to compute until
        its search advances, and keeps its report), else the newest request."""
        reported = [j for j, r in enumerate(self.running) if self._has_reported(r)]
        return reported[-1] if reported else len(self.running) - 1

    def _schedule_swapped(self, plan: _StepPlan) -> None:
        """Swapped requests come back before new ones are admitted."""
        while self.swapped and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            if request.num_pending_tokens:
                break  # swapped out while its last token was in flight: resume once it is known
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            lookahead = self._lookahead(request, num_new)
            if not self.kv.can_swap_in(request, num_new, lookahead):
                break
            self.swapped.popleft()
            plan.swap_in += self.kv.swap_in(request)
            # (not inside the assert: python -O drops it)
            allocated = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            assert allocated, "can_swap_in promised room for the next step"
            self._start_running(request)
            plan.known_blocks[request.request_id] = -1  # send the whole table
            plan.add(request, num_new)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Waiting requests, in arrival order (siblings of n > 1 wait for their first sample's prompt)."""
        skipped: list[Request] = []
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending_tokens:
                break  # preempted while its last token was in flight: recompute once it is known
            if self._waits_for_parent_prompt(request) or self._has_reported(request):
                # its prompt is still being computed, or it is a preempted beam that has reported (its search
                # needs nothing more of it: the forks that continue it are recomputed)
                skipped.append(self.waiting.popleft())
                continue
            num_new = self._admit(request, plan.budget)
            if num_new == 0:
                break
            self.waiting.popleft()
            self._start_running(request)
            plan.known_blocks[request.request_id] = -1
            plan.add(request, num_new)
        self.waiting.extendleft(reversed(skipped))

    @staticmethod
    def _waits_for_parent_prompt(request: Request) -> bool:
        parent = request.fork_of
        return (parent is not None and not parent.is_finished and parent.status != RequestStatus.PREEMPTED
                and parent.num_computed_tokens < parent.num_prompt_tokens and request.num_computed_tokens == 0)

    def _build_output(self, plan: _StepPlan, num_proposals: int) -> SchedulerOutput:
        """The step's records, then num_computed_tokens advanced (the runner gets the old values);
        num_proposals: the tokens to draft after the step."""
        rewritten = self.kv.take_rewritten()
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        step_requests: dict[str, Request] = {}
        for request in self.running:
            req_id = request.request_id
            num_new = plan.scheduled.get(req_id)
            if num_new is None:
                continue
            step_requests[req_id] = request
            if req_id not in self._runner_knows:
                self._runner_knows.add(req_id)
                new_reqs.append(self._new_request_data(request))
            else:
                cached_reqs.append(self._cached_request_data(request, plan.known_blocks.get(req_id, -1), rewritten))
            request.num_computed_tokens += num_new
            num_spec = len(plan.spec_tokens.get(req_id, ()))
            if num_new and request.num_computed_tokens - num_spec == request.num_tokens_with_pending:
                request.num_pending_tokens += 1  # caught up: this step samples its next token

        finished, self.finished_req_ids = self.finished_req_ids, set()
        ended, self._ended_slots = self._ended_slots, set()
        self._step_id += 1
        self._scheduled_requests[self._step_id] = step_requests
        self._step_filled[self._step_id] = self.kv.filled_identities()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=plan.scheduled,
            total_num_scheduled_tokens=sum(plan.scheduled.values()),
            finished_req_ids=finished,
            blocks_to_swap_out=plan.swap_out,
            blocks_to_swap_in=plan.swap_in,
            blocks_to_copy=self.kv.take_copies(),
            step_id=self._step_id,
            scheduled_spec_tokens=plan.spec_tokens,
            num_spec_proposals=num_proposals,
            ended_beam_slots=ended,
        )

    def _new_request_data(self, request: Request) -> NewRequestData:
        block_ids = [b.block_id for b in self.kv.req_blocks[request.request_id]]
        return NewRequestData(request.request_id, request.prompt_token_ids, request.sampling_params, block_ids,
                              request.num_computed_tokens, request.output_token_ids, request.max_total_tokens)

    def _cached_request_data(self, request: Request, known: int, rewritten: set[str]) -> CachedRequestData:
        """The whole table when the runner's copy is stale (resumed, or rewritten by copy-on-write);
        otherwise only the blocks added this step (none for most decodes). known < 0: stale."""
        req_id = request.request_id
        blocks = self.kv.req_blocks[req_id]
        if known < 0 or req_id in rewritten:
            return CachedRequestData(req_id, request.num_computed_tokens, [], [b.block_id for b in blocks])
        return CachedRequestData(req_id, request.num_computed_tokens, [b.block_id for b in blocks[known:]])

    def _admit(self, request: Request, budget: int) -> int:
        """Give a waiting request its blocks; returns the tokens to compute now (0: not now)."""
        parent = request.fork_of
        computed_blocks, num_cached = [], 0
        forked = False
        if parent is not None and parent.status == RequestStatus.RUNNING and request.num_computed_tokens == 0 \
                and parent.num_computed_tokens >= request.num_prompt_tokens \
                and self.kv.fork(parent, request, request.num_prompt_tokens - 1):
            # Share the parent's KV of the prompt minus its last token, whose logits we need.
            request.num_computed_tokens = request.num_prompt_tokens - 1
            forked = True
        elif request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None:
            # (A request that scores its prompt computes all of it: no prefix-cache hits.)
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
        if not self.config.enable_chunked_prefill and num_new < request.num_tokens - request.num_computed_tokens - num_cached:
            num_new = 0  # the whole remainder must fit in one step
        if num_new == 0 or not self.kv.allocate_slots(request, num_new, computed_blocks,
                                                      self._lookahead(request, num_new, num_cached)):
            if forked:
                self.kv.free(request)
                request.num_computed_tokens = 0
            return 0
        if forked:
            num_cached = request.num_computed_tokens
        else:
            request.num_computed_tokens += num_cached
            self.kv.record_prefix_query(request, num_cached)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached  # prompt tokens not computed at first admission
        return num_new

    def _lookahead(self, request: Request, num_new: int, num_cached: int = 0) -> int:
        """Slots past a step's tokens that the draft model writes: only for a request that drafts
        after the step (it catches up with its tokens)."""
        if not self.num_lookahead_tokens:
            return 0
        caught_up = request.num_computed_tokens + num_cached + num_new >= request.num_tokens_with_pending
        return self.num_lookahead_tokens if caught_up else 0

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _preempt(self, request: Request) -> list[tuple[int, int]]:
        self.num_preemptions += 1
        request.spec_token_ids = []  # the draft proposes again once the request runs
        request.num_preemptions += 1
        # (A beam waiting for the search would come back with nothing to compute: it is recomputed, and
        # once it has reported it waits in the queue, uncomputed, until its search advances.)
        if self.config.preemption_mode == "swap" and not self._beam_waits(request):
            if self.kv.can_swap_out(request):
                request.status = RequestStatus.SWAPPED
                self.swapped.appendleft(request)
                return self.kv.swap_out(request)
            if not self._warned_swap_full:
                self._warned_swap_full = True
                logger.warning("CPU swap pool is full: preempting by recompute instead (logged once)")
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        return []

    # after the step

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[tuple[Request, list[int]]]:
        """Append sampled tokens, apply stop conditions, free finished requests.
        Returns the requests that got tokens this step (finished ones included), each with the
        tokens appended (those after a stop are dropped). If applying them raises, the step's records
        stay for fail_step, which the engine calls next: its requests and searches end with the error."""
        step_id = scheduler_output.step_id
        scheduled = self._scheduled_requests.get(step_id)
        if scheduled is None:
            raise ValueError(f"step {step_id} was not scheduled here, or its output was already applied")
        updated = self._apply_output(scheduler_output, runner_output, scheduled)
        del self._scheduled_requests[step_id]
        self._step_filled.pop(step_id, None)
        self._slot_steps.pop(step_id, None)
        return updated

    def _apply_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                      scheduled: dict[str, Request]) -> list[tuple[Request, list[int]]]:
        updated = []
        for ra in self._slot_steps.get(scheduler_output.step_id, ()):
            self._apply_slot_step(ra, scheduler_output.step_id, runner_output.beam_candidates)
        spec_scheduled = scheduler_output.scheduled_spec_tokens
        for req_id, tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = scheduled.get(req_id)
            if not tokens or request is None or request.is_finished:
                continue  # finished while this step was in flight: its token is dropped
            if req_id in self._beam_of:
                self._beam_reported(request, runner_output.logprobs[req_id][0][2], tokens[0])
                continue
            num_spec = len(spec_scheduled.get(req_id, ()))
            if num_spec:  # the KV of the rejected draft tokens is computed again
                request.num_computed_tokens -= num_spec + 1 - len(tokens)
                self.spec_stats.record(num_spec, len(tokens) - 1)
                self.spec_policy.record(num_spec, len(tokens) - 1)
            request.num_pending_tokens -= 1
            status = None
            for num_appended, token in enumerate(tokens, 1):
                request.append_token(token)
                status = self._check_stop(request, token)
                if status is not None:
                    break
            if status is not None:
                self._queue_of(request).remove(request)
                request.status = status
                self._free(request)
            else:  # no more drafts than tokens left to generate after the target's next one
                proposed = runner_output.spec_token_ids.get(req_id, [])
                request.spec_token_ids = proposed[:max(0, request.max_total_tokens - request.num_tokens - 1)]
            updated.append((request, tokens[:num_appended]))
        if runner_output.num_failed_lookups:
            self.spec_policy.record_failed_lookups(runner_output.num_failed_lookups)
        return updated

    # beam search

    def add_beam_search(self, search: BeamSearch, first: Request) -> None:
        """Start a search whose first beam is `first` (the prompt)."""
        self._say("path", "beam search: synchronous steps (%s)" % self.beam_run_ahead_off if self.beam_run_ahead_off
                  else "beam search: run-ahead steps while only beam searches run (the device picks each step's "
                       "beams; core/beam_run_ahead.py)")
        self.add_request(first)
        search.max_tokens = min(search.max_tokens, first.max_total_tokens - first.num_prompt_tokens)
        search.set_beams([first], [0.0])
        self.beam_searches[search.request_id] = search
        self._beam_of[first.request_id] = search

    def finish_beam_search(self, request_id: str) -> None:
        """Abort a search: its beams' blocks are freed, it gives no output."""
        search = self.beam_searches.pop(request_id, None)
        ra = self.run_ahead.pop(request_id, None)
        if ra is not None:
            self.kv.free_slots(request_id)
            self._ended_slots.add(request_id)
            return
        for beam in search.beams if search is not None else ():
            self._drop_beam(beam)

    def new_beam_id(self, search: BeamSearch) -> str:
        """The search's next beam name that no request holds (a request of the caller's may have one)."""
        beam_id = search.next_beam_id()
        while beam_id in self.requests:
            beam_id = search.next_beam_id()
        return beam_id

    def take_finished_beam_searches(self) -> list[BeamSearch]:
        finished, self.finished_beam_searches = self.finished_beam_searches, []
        return finished

    def _beam_reported(self, beam: Request, top: list[tuple[int, float]], sampled: int) -> None:
        """sampled: the token the runner appended to its own copy of the beam (the step's argmax)."""
        beam.num_pending_tokens -= 1
        search = self._beam_of[beam.request_id]
        self._beam_sampled[beam.request_id] = sampled
        if not search.report(beam, top):
            return
        parents = search.beams
        continuations = search.advance()
        # A parent whose continuation is the token the runner appended goes on in place (its best one, unless
        # that ended it): a plain decode step on both sides, no new request, no per-block work. Its other
        # continuations are forks, made before it appends its token (they copy its tokens).
        stays = {id(c.parent): i for i, c in enumerate(continuations)
                 if c.token == self._beam_sampled[c.parent.request_id]}
        beams = [c.parent if stays.get(id(c.parent)) == i else self._fork_beam(search, c.parent, c.token)
                 for i, c in enumerate(continuations)]
        for parent in parents:  # after the forks, which hold the blocks they share with it
            del self._beam_sampled[parent.request_id]
            i = stays.get(id(parent))
            if i is not None:
                parent.append_token(continuations[i].token)
            forks = [b for b, c in zip(beams, continuations) if c.parent is parent and b is not parent]
            self._replace_beam(parent, forks, keep=i is not None)
        if search.done:
            del self.beam_searches[search.request_id]
            self.finished_beam_searches.append(search)
        else:
            search.set_beams(beams, [c.cum_logprob for c in continuations])

    def _fork_beam(self, search: BeamSearch, parent: Request, token: int) -> Request:
        """A new beam: the parent's tokens and token, sharing all the parent's blocks when it runs
        (else recomputed from the waiting queue, hitting the prefix cache)."""
        child = parent.copy_as(self.new_beam_id(search))
        child.append_token(token)
        if parent.status == RequestStatus.RUNNING and self.kv.fork(parent, child, parent.num_computed_tokens):
            child.status = RequestStatus.RUNNING
        else:
            child.num_computed_tokens = 0
        self.requests[child.request_id] = child
        self._beam_of[child.request_id] = search
        return child

    def _replace_beam(self, parent: Request, children: list[Request], keep: bool) -> None:
        """Put the parent's forks where it stands (running ones before it in the running list, the others
        at the head of the waiting queue), then free it unless it goes on itself (keep)."""
        running = [c for c in children if c.status == RequestStatus.RUNNING]  # (then so is the parent)
        if running:
            i = self.running.index(parent)
            self.running[i:i] = running
        self.waiting.extendleft(reversed([c for c in children if c.status != RequestStatus.RUNNING]))
        if not keep:
            self._drop_beam(parent)

    def _drop_beam(self, beam: Request) -> None:
        del self._beam_of[beam.request_id]
        self._beam_sampled.pop(beam.request_id, None)
        if not beam.is_finished:
            self._queue_of(beam).remove(beam)
            beam.status = RequestStatus.FINISHED_STOPPED
            self._free(beam)

    # beam search run ahead (core/beam_run_ahead.py)

    def _say(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.info("%s (logged once)", message)

    def _run_ahead_blocker(self) -> str | None:
        """Why the beam searches cannot run ahead now: work beside them, or a search not ready to (None: all ready)."""
        if self.waiting or self.swapped:
            return "requests or beams wait beside the beams"
        searches = {}
        for request in self.running:
            search = self._beam_of.get(request.request_id)
            if search is None:
                return "other (non-beam) requests run beside the beams"
            searches[search.request_id] = search
        if not all(RunAheadSearch.can_take_over(s, s.beams, self.kv) for s in searches.values()):
            return "a search's beams are not all one token from their next step (its prompt)"
        return None

    def _schedule_beam_slots(self) -> list[BeamSlotStep]:
        """The run-ahead searches' next steps (searches ready to run ahead join them); none while anything else
        runs, which drains them back to requests."""
        if self.beam_run_ahead_off is not None:
            return []
        blocker = self._run_ahead_blocker()
        if blocker is not None:
            self._say(blocker, f"beam search: synchronous steps while {blocker}")
        else:
            for search in {id(s): s for s in map(self._beam_of.get, (r.request_id for r in self.running))}.values():
                if self.kv.num_free_blocks < self.num_slots + len(search.beams):
                    self._say("pool", POOL_TOO_SHORT)
                    break
                self._take_over(search)
        steps = []
        for ra in list(self.run_ahead.values()):
            ra.draining |= blocker is not None
            step = ra.schedule_step(self.kv, self._step_id + 1) if ra.wants_step() else None
            if step is not None:
                steps.append(step)
            elif ra.wants_step():
                self._say("pool", POOL_TOO_SHORT)
                ra.draining = True
            if ra.draining and not ra.in_flight:
                self._leave_run_ahead(ra)
        return steps

    def _take_over(self, search: BeamSearch) -> None:
        """The search's beams become its slots: the runner drops their states, the scheduler their requests."""
        for beam in search.beams:
            self.running.remove(beam)
            del self.requests[beam.request_id]
            del self._beam_of[beam.request_id]
            if beam.request_id in self._runner_knows:
                self._runner_knows.discard(beam.request_id)
                self.finished_req_ids.add(beam.request_id)
        self.run_ahead[search.request_id] = RunAheadSearch(search, search.beams, self.kv)

    def _leave_run_ahead(self, ra: RunAheadSearch) -> None:
        """A drained search's slots become running requests again."""
        search = ra.search
        del self.run_ahead[search.request_id]
        self._ended_slots.add(search.request_id)
        for request in ra.to_requests(self.kv, lambda: self.new_beam_id(search)):
            self.requests[request.request_id] = request
            self._beam_of[request.request_id] = search
            self.running.append(request)

    def _apply_slot_step(self, ra: RunAheadSearch, step_id: int, candidates: dict) -> None:
        search_id = ra.search.request_id
        if self.run_ahead.get(search_id) is not ra:
            return  # ended (or drained) while the step was in flight: its output is not the search's
        ra.apply(step_id, candidates[search_id], self.kv)
        if ra.search.done:
            self.kv.free_slots(search_id)
            del self.run_ahead[search_id], self.beam_searches[search_id]
            self._ended_slots.add(search_id)
            self.finished_beam_searches.append(ra.search)
        elif ra.draining and not ra.in_flight:
            self._leave_run_ahead(ra)

    def _build_slot_output(self, steps: list[BeamSlotStep]) -> SchedulerOutput:
        self._step_id += 1
        self.num_run_ahead_steps += 1
        self._scheduled_requests[self._step_id] = {}
        self._step_filled[self._step_id] = []
        self._slot_steps[self._step_id] = [self.run_ahead[step.search_id] for step in steps]
        finished, self.finished_req_ids = self.finished_req_ids, set()
        ended, self._ended_slots = self._ended_slots, set()
        return SchedulerOutput([], [], {}, 0, finished, blocks_to_copy=self.kv.take_copies(), step_id=self._step_id,
                               beam_slot_steps=steps, ended_beam_slots=ended)

    def _waits_for_pending_token(self, request: Request) -> bool:
        """Whether the request has nothing to compute until its newest token is known: a beam that
        computed its tokens, or a request that stops by length once its in-flight token lands (a
        step would compute a token nobody reads)."""
        if request.request_id in self._beam_of:
            return self._beam_waits(request)
        return request.num_pending_tokens > 0 and request.num_tokens_with_pending >= request.max_total_tokens

    def _has_reported(self, request: Request) -> bool:
        search = self._beam_of.get(request.request_id)
        return search is not None and search.has_reported(request)

    def _beam_waits(self, request: Request) -> bool:
        """A beam that computed its tokens: the search picks its next one once every beam has reported."""
        return request.request_id in self._beam_of and request.num_computed_tokens >= request.num_tokens

    @staticmethod
    def _check_stop(request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_tokens = len(request.all_token_ids)
        if num_tokens - request.num_prompt_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_tokens >= request.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
