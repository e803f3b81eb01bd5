"""The model runner's speculative steps (DESIGN.md "Speculative decoding").

A step that verifies draft tokens or proposes new ones comes here. Two paths, one result:
- decode steps (every request verifies its newest token and its drafts, the batch fits a captured
  size, sampling the graphs can do) run batched_step.py: replayed from a CUDA graph on GPUs, the
  same code as it is elsewhere; a draft behind after plain steps first runs over what it missed;
- every other step (prompt chunks, seeds / penalties / logprobs, more requests than the largest
  graph) runs eagerly over the flat batch: the target's forward, the sampler, accept_drafts on the
  padded verify rows, then the proposer.
Either way the step returns once its tokens are on the host (the scheduler needs their count to schedule
the next step), so speculative steps run one at a time; the engine overlaps the steps that neither
verify nor propose, as without speculation. A batched step returns before its draft model's rounds end:
its proposals stay on the device, reported as PENDING_DRAFT tokens (the scheduler needs only their
number), and the next batched step takes them from there while the host schedules it; a step that needs
their values on the host (an eager one) reads them from their copy (PendingDrafts).

Each request's draft_len (draft model) says how many of its leading positions hold valid draft KV (a
plain step leaves it at most at the request's next position: the KV past it held proposals it dropped);
prob_slot (draft model, sampled requests) is its row of the step's draft_probs, where the q of its
last proposals waits for the step that verifies them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import numpy as np
import torch

from fastllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from fastllm.layers.sampler import SamplingRow, filtered_probs, gather_logprobs, process_logits
from fastllm.spec_decode.batched_step import ModelFns, PendingDrafts, SpecDecodeStep
from fastllm.spec_decode.draft_model import DraftModel, DraftRequest
from fastllm.spec_decode.ngram import NgramProposer
from fastllm.spec_decode.rejection_sampler import accept_drafts
from fastllm.tracing import nvtx_range
from fastllm.worker.async_output import AsyncRunnerOutput
from fastllm.worker.attn_metadata import forward_context
from fastllm.worker.input_batch import build_step_inputs, graph_sampling_params

logger = logging.getLogger(__name__)

# Decode steps of up to this many requests replay speculative graphs; larger batches are compute-bound,
# where speculation rarely pays (the adaptive rule turns it off there).
MAX_SPEC_GRAPH_SIZE = 128
# Sampled (not greedy) steps keep the target's and the draft's probabilities, [rows, vocab] float32 and
# the sort of top-k / top-p, in the graphs' memory pool, which the KV sizing did not see: sampled steps
# of more verify rows (batch x (k + 1)) than this run eagerly.
MAX_SAMPLED_GRAPH_ROWS = 64
# The memory for the q of sampled requests' pending drafts (k x vocab float32 each); requests beyond it
# decode without drafts.
DRAFT_PROBS_BYTES = 256 << 20
DRAFT_BEHIND = "the draft model catches up after plain steps"  # (an eager step's reason)
PENDING_DRAFT = -1  # a proposed token still on the device (in the scheduler's spec_token_ids)


class SpecDecodeRunner:
    def __init__(self, runner):
        self.runner = runner
        config = runner.config
        spec = config.speculative
        self.k = spec.num_speculative_tokens
        self.synthetic_acceptance_rate = spec.synthetic_acceptance_rate
        self.drafter = DraftModel(config, runner.dtype, runner.args.vocab_size, runner.device) \
            if spec.uses_draft_model else None
        self.ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.method == "ngram" else None
        self.step: SpecDecodeStep | None = None
        self._free_slots: list[int] = []
        self._logged: set[str] = set()
        self._last_proposals: PendingDrafts | None = None  # the last batched step's, still in its out

    def set_synthetic_acceptance_rate(self, rate: float) -> None:
        """Benchmarks: change the forced acceptance rate (the engine was built with one)."""
        assert self.synthetic_acceptance_rate is not None, "the engine was built without a synthetic acceptance rate"
        self.synthetic_acceptance_rate = rate
        self.step.synthetic_rate.fill_(rate)

    def _log_once(self, key: str, message: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.info(message, *args)

    # setup

    def build_step(self, target_forward, draft_forward, sizes: list[int], capture: bool) -> None:
        """The batched step over the compiled (or eager) forwards; capture its graphs when asked."""
        runner, model_config = self.runner, self.runner.config.model
        largest = min(MAX_SPEC_GRAPH_SIZE, runner.config.scheduler.max_num_seqs)
        sizes = sorted({s for s in sizes if s <= largest} | {largest})
        target = ModelFns(target_forward, runner.model.compute_logits, runner.attention_layers)
        draft = None
        num_slots = 0
        vocab = runner.args.vocab_size
        if self.drafter is not None:
            draft = ModelFns(draft_forward, self.drafter.model.compute_logits, self.drafter.attention_layers,
                             self.drafter.decoder)
            num_slots = max(1, min(runner.config.scheduler.max_num_seqs, DRAFT_PROBS_BYTES // (4 * self.k * vocab)))
        self.step = SpecDecodeStep(target, draft, self.k, sizes, -(-model_config.max_model_len // runner.block_size),
                                   model_config.max_model_len, runner.block_size, vocab, runner.device,
                                   self.synthetic_acceptance_rate, num_slots)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        if capture:
            self.step.capture()
        else:
            self.step.replay = False
        how = "replay CUDA graphs" if capture else "run eagerly (no CUDA graphs here)"
        logger.info("speculative decoding (%s, k=%d): decode steps of up to %d requests %s",
                    runner.config.speculative.method, self.k, self.step.max_bs, how)

    # request states

    def add_request(self, state) -> None:
        state.draft_len = state.num_computed_tokens  # prefix-cache hits and forks share the draft's KV too
        params = state.sampling_params
        if self.drafter is not None and not params.greedy:
            if self._free_slots:
                state.prob_slot = self._free_slots.pop()
            else:
                self._log_once("slots", "speculative decoding: more sampled requests than draft-probability "
                               "slots; the rest decode without drafts (logged once)")

    def remove_request(self, state) -> None:
        if state.prob_slot >= 0:
            self._free_slots.append(state.prob_slot)
            state.prob_slot = -1

    def proposes_for(self, state) -> bool:
        """Whether drafts are proposed for this request; a sampled one (draft model) needs a probability
        slot and takes one that has come free since it arrived."""
        params = state.sampling_params
        if self.drafter is None or params.greedy:
            return True
        if state.prob_slot < 0 and self._free_slots:
            state.prob_slot = self._free_slots.pop()
        return state.prob_slot >= 0

    def discard_drafts(self, req_ids: list[str]) -> None:
        """A plain step drops the drafts last proposed for its requests: the draft's KV past each one's next
        position held them, not the tokens the plain steps compute, so draft_len stops there (a later
        speculative step runs the draft over what it missed)."""
        for req_id in req_ids:
            state = self.runner.requests[req_id]
            state.draft_len = min(state.draft_len, state.num_computed_tokens + 1)

    # one step

    def execute(self, sched: SchedulerOutput, req_ids: list[str]) -> AsyncRunnerOutput:
        runner = self.runner
        last = runner._last_output
        if last is not None and not last.done:
            last.result()  # the tokens of the step before are inputs here (and go to the proposer)
        if self.ngram is not None and not sched.scheduled_spec_tokens:
            return self._plain_then_lookup(sched, req_ids)
        states = [runner.requests[r] for r in req_ids]
        num_scheduled = [sched.num_scheduled_tokens[r] for r in req_ids]
        spec = [sched.scheduled_spec_tokens.get(r, []) for r in req_ids]
        why, caught_up = self._eager_reason(sched, states, num_scheduled, spec), False
        if why == DRAFT_BEHIND:
            why = self._catch_up_draft(sched, states, num_scheduled, spec)
            caught_up = why is None
        if why is None:
            sampled = any(not s.sampling_params.argmax_only for s in states)
            with nvtx_range("spec_step"):
                out = self._execute_step(sched, req_ids, states, spec, sampled)
            if caught_up:  # (its time is a probe's, not a speculative step's: SpecPolicy.observe)
                runner.last_decode_step = (True, len(states), True)
        else:
            self._log_once(why, "speculative decoding: a step runs eagerly, not the batched step: %s "
                           "(logged once per reason)", why)
            spec = [self._draft_values(state, drafts) for state, drafts in zip(states, spec)]
            out = self._execute_eager(sched, req_ids, states, num_scheduled, spec)
        return AsyncRunnerOutput.ready(out)

    @property
    def step_timings(self) -> list[tuple[float, float]]:
        """(verify, propose) ms of each batched step run with step.timing on (benchmarks)."""
        return self.step.timings() if self.step is not None else []

    @staticmethod
    def _draft_values(state, drafts: list[int]) -> list[int]:
        """The drafts' token ids: PENDING_DRAFT ones read from their batched step's copy on the host."""
        if not drafts or drafts[0] != PENDING_DRAFT:
            return drafts
        pending, row = state.pending_drafts
        return pending.row(row)[:len(drafts)]

    def _plain_then_lookup(self, sched, req_ids) -> AsyncRunnerOutput:
        """No drafts to verify (n-gram lookup found none): the plain step (a decode step's graph), waited
        for, since its tokens are the text the next lookups search."""
        out = self.runner._execute_plain(sched, req_ids).result()
        if self.runner.last_decode_step is not None:  # (a step of speculation's, as the policy weighs them)
            self.runner.last_decode_step = (True, *self.runner.last_decode_step[1:])
        sampled = [self.runner.requests[r] for r, t in zip(out.req_ids, out.sampled_token_ids) if t]
        proposals, misses = self._ngram_proposals(sampled, sched.num_spec_proposals)
        return AsyncRunnerOutput.ready(dataclasses.replace(out, spec_token_ids=proposals, num_failed_lookups=misses))

    def _catch_up_draft(self, sched, states, num_scheduled, spec) -> str | None:
        """A decode step after plain steps (a probe, or speculation back on) whose only reason to run eagerly
        is the draft's missing KV (the caller found DRAFT_BEHIND): run the draft over the tokens it missed
        (one forward, nothing drafted). The step's reason to run eagerly after that (None: it runs batched)."""
        behind = [(s, drafts) for s, drafts in zip(states, spec) if s.draft_len < s.num_computed_tokens + len(drafts)]
        if any(drafts for _, drafts in behind):
            return DRAFT_BEHIND  # (drafts to verify: the eager path writes their KV)
        with nvtx_range("draft_catch_up"):
            self.drafter.propose([DraftRequest(s.token_slice(s.draft_len, s.num_computed_tokens), s.draft_len,
                                               s.block_table[:len(s.block_ids)], 0, None) for s, _ in behind])
        for state, _ in behind:
            state.draft_len = state.num_computed_tokens
        return self._eager_reason(sched, states, num_scheduled, spec)

    def _eager_reason(self, sched, states, num_scheduled, spec) -> str | None:
        step = self.step
        if step is None:
            return "no batched step"
        if len(states) > step.max_bs:
            return f"more than {step.max_bs} requests"
        if self.runner._scoring_prompts:
            return "prompt logprobs"
        sampled = False
        for state, count, drafts in zip(states, num_scheduled, spec):
            params = state.sampling_params
            if count != 1 + len(drafts) or state.num_computed_tokens + 1 != state.num_tokens:
                return "a prompt chunk"
            if self.drafter is not None and not self.proposes_for(state):
                return "a request that does not speculate"
            if self.drafter is not None and state.draft_len < state.num_computed_tokens + len(drafts):
                return DRAFT_BEHIND
            if not params.argmax_only:
                if not params.samples_in_graph:
                    return "a request with a seed, penalties, min_tokens or logprobs"
                sampled = True
        if sampled and step.padded_size(len(states)) * (self.k + 1) > MAX_SAMPLED_GRAPH_ROWS:
            return f"sampled requests in more than {MAX_SAMPLED_GRAPH_ROWS} verify rows"
        return None

    def _execute_step(self, sched, req_ids, states, spec, sampled: bool) -> ModelRunnerOutput:
        step, k, block_size = self.step, self.k, self.runner.block_size
        num_reqs = len(states)
        tokens = np.zeros((num_reqs, k + 1), dtype=np.int64)
        num_drafts = np.fromiter((len(d) for d in spec), dtype=np.int64, count=num_reqs)
        prev_row = np.full(num_reqs, -1, dtype=np.int64)  # a request's row in the last batched step
        for i, (state, drafts) in enumerate(zip(states, spec)):
            tokens[i, 0] = state.output_token_ids[-1] if state.output_token_ids else state.prompt_token_ids[-1]
            if drafts and drafts[0] == PENDING_DRAFT and state.pending_drafts[0] is self._last_proposals:
                prev_row[i] = state.pending_drafts[1]  # its drafts are read where that step left them
            else:
                drafts = self._draft_values(state, drafts)
                tokens[i, 1:1 + len(drafts)] = drafts
        start = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
        held = np.fromiter((len(s.block_ids) for s in states), dtype=np.int64, count=num_reqs)
        tables = np.zeros((step.padded_size(num_reqs), int(held.max())), dtype=np.int32)
        for i, state in enumerate(states):
            tables[i, :held[i]] = state.block_table[:held[i]]
        # (a request without a slot, greedy, writes its q into the scratch slot, not into another's slot 0)
        slots = np.fromiter((s.prob_slot if s.prob_slot >= 0 else step.scratch_slot for s in states),
                            dtype=np.int64, count=num_reqs)
        params = graph_sampling_params(states, step.max_bs, self.runner.args.vocab_size) if sampled else None
        step.stage(self.runner.stager, tokens, start, num_drafts, held * block_size, slots, prev_row, params, tables)
        out, pending = step.execute(num_reqs, sampled)
        self._last_proposals = pending
        self.runner.last_decode_step = (True, num_reqs, False)
        new_tokens, proposals = [], {}
        for i, state in enumerate(states):
            count = int(out[i, k + 1])
            emitted = out[i, :count].tolist()
            state.output_token_ids.extend(emitted)
            new_tokens.append(emitted)
            if self.drafter is not None:
                state.draft_len = min(int(start[i]) + count + k, int(held[i]) * block_size)
                if sched.num_spec_proposals and self.proposes_for(state):
                    proposals[state.req_id] = [PENDING_DRAFT] * k
                    state.pending_drafts = (pending, i)
        misses = 0
        if self.ngram is not None:
            proposals, misses = self._ngram_proposals(states, sched.num_spec_proposals)
        return ModelRunnerOutput(req_ids, new_tokens, spec_token_ids=proposals, num_failed_lookups=misses)

    def _execute_eager(self, sched, req_ids, states, num_scheduled, spec) -> ModelRunnerOutput:
        runner = self.runner
        starts = [s.num_computed_tokens for s in states]
        catches_up = self.drafter is not None and any(s.draft_len < s.num_computed_tokens for s in states)
        with nvtx_range("prepare_inputs"):
            inputs = build_step_inputs(states, num_scheduled, runner.block_size, runner.args.vocab_size,
                                       runner.eos_token_id, runner.stager, spec_tokens=spec,
                                       cascade=runner.cascade.plan(states, num_scheduled))
        with nvtx_range("forward"), forward_context(inputs.attn_metadata, runner.attention_layers):
            hidden = runner.forward(inputs.input_ids, inputs.positions)
        prompt_logprobs = runner._score_prompts(hidden, states, num_scheduled) if runner._scoring_prompts else {}
        for state, count in zip(states, num_scheduled):
            state.num_computed_tokens += count
        new_tokens: dict[str, list[int]] = {}
        logprobs = {}
        if inputs.sample_states:
            with nvtx_range("verify"):
                new_tokens, logprobs = self._verify(hidden, inputs, dict(zip(req_ids, spec)))
        with nvtx_range("propose"):
            proposals, misses = self._propose(states, starts, num_scheduled, new_tokens, sched.num_spec_proposals)
        if all(count == 1 + len(drafts) for count, drafts in zip(num_scheduled, spec)):  # decodes only
            runner.last_decode_step = (True, len(states), catches_up)
        return ModelRunnerOutput(req_ids, [new_tokens.get(r, []) for r in req_ids], logprobs, proposals,
                                 prompt_logprobs, num_failed_lookups=misses)

    def _verify(self, hidden: torch.Tensor, inputs, spec_of: dict[str, list[int]]):
        """Each sampling request's new tokens (appended to its state) and, for those that asked, one logprobs
        entry per new token."""
        runner = self.runner
        logits = runner._logits(hidden, inputs)
        metadata = inputs.sampling_metadata
        out = runner.sampler(logits, metadata)
        states = inputs.sample_states
        drafts = [spec_of[s.req_id] for s in states]
        if any(drafts):
            tokens = self._accept(logits, metadata, out.sampled, states, drafts)
        else:
            tokens = [[t] for t in out.sampled.tolist()]
        num_rows = inputs.num_verify_rows or [1] * len(states)
        logprobs = token_logprobs(logits, states, [0, *itertools.accumulate(num_rows)][:-1], tokens) \
            if metadata.max_num_logprobs is not None else {}
        for state, t in zip(states, tokens):
            state.output_token_ids.extend(t)
        return {s.req_id: t for s, t in zip(states, tokens)}, logprobs

    def _accept(self, logits, metadata, sampled, states, drafts) -> list[list[int]]:
        """accept_drafts over the flat verify rows (request i's len(drafts[i]) + 1 of them), padded."""
        device = logits.device
        counts = np.asarray([len(d) for d in drafts], dtype=np.int64)
        k = int(counts.max())
        first = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
        index = torch.as_tensor(first[:, None] + np.minimum(np.arange(k + 1), counts[:, None]), device=device)
        padded = np.zeros((len(drafts), k), dtype=np.int64)
        for i, d in enumerate(drafts):
            padded[i, :len(d)] = d
        draft_ids = torch.as_tensor(padded, device=device)
        num_drafts = torch.as_tensor(counts, device=device)
        kwargs = {}
        if not metadata.all_greedy and self.synthetic_acceptance_rate is None:
            p = filtered_probs(process_logits(logits.float(), metadata), metadata)[index]
            kwargs = dict(sampled_rows=~metadata.greedy[torch.as_tensor(first, device=device)], target_probs=p,
                          draft_probs=self._draft_probs(states, draft_ids, p.shape[-1]),
                          generators={i: s.generator for i, (s, d) in enumerate(zip(states, drafts))
                                      if s.generator is not None and d})
        tokens, num_tokens = accept_drafts(sampled[index], draft_ids, num_drafts,
                                           synthetic_acceptance_rate=self.synthetic_acceptance_rate, **kwargs)
        rows = torch.cat([tokens, num_tokens.unsqueeze(1)], dim=1).tolist()
        return [row[:row[-1]] for row in rows]

    def _draft_probs(self, states, draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
        """q [S, k, V] of the drafts being verified: the draft model's, kept in the prob slots, or
        one-hot for n-gram proposals (drawn from nothing but the text)."""
        if self.drafter is None:
            return torch.nn.functional.one_hot(draft_ids, vocab).float()
        slots = torch.as_tensor([max(s.prob_slot, 0) for s in states], device=draft_ids.device)
        return self.step.draft_probs[slots, :draft_ids.shape[1]]

    def _propose(self, states, starts, num_scheduled, new_tokens: dict[str, list[int]],
                 k: int) -> tuple[dict[str, list[int]], int]:
        """The next proposals, and how many n-gram lookups found none."""
        if self.ngram is not None:
            return self._ngram_proposals([s for s in states if s.req_id in new_tokens], k)
        return self._draft_proposals(states, starts, num_scheduled, new_tokens, k), 0

    def _ngram_proposals(self, states, k: int) -> tuple[dict[str, list[int]], int]:
        if not k:
            return {}, 0
        proposals, misses = {}, 0
        for state in states:
            if self.proposes_for(state):
                tokens = np.asarray(state.prompt_token_ids + state.output_token_ids)
                found = self.ngram.propose(tokens, k)
                if not found and self.synthetic_acceptance_rate is not None:
                    # Benchmarks: random-weight text never repeats, so no lookup would hit. With acceptance
                    # set, a miss proposes the last k tokens: the lookup is paid for, its hit rate taken as 1.
                    found = tokens[-k:].tolist()
                if found:
                    proposals[state.req_id] = found
                else:
                    misses += 1
        return proposals, misses

    def _draft_proposals(self, states, starts, num_scheduled, new_tokens, k: int) -> dict[str, list[int]]:
        """Run the draft from each request's draft_len over what the target computed this step and
        draft k tokens after the newest token of each request that sampled (and may speculate)."""
        requests, owners = [], []
        for state, start, count in zip(states, starts, num_scheduled):
            end = start + count
            num_proposals = 0
            if state.req_id in new_tokens:  # it sampled: its tokens are known up to the newest
                end = state.num_tokens
                # (no more than it can use: the target's own next token is one of those left)
                num_proposals = max(0, min(k, state.max_total_tokens - end - 1)) if self.proposes_for(state) else 0
                if num_proposals == 0:
                    end -= 1  # the newest token's KV is only needed to draft after it
            begin = min(state.draft_len, start)
            if begin >= end:
                continue
            # (a seeded request's drafts come from its generator too, so that its run repeats)
            row = SamplingRow(state.sampling_params, state.generator, [], [], None) if num_proposals else None
            requests.append(DraftRequest(state.token_slice(begin, end), begin,
                                         state.block_table[:len(state.block_ids)], num_proposals, row))
            owners.append(state)
            state.draft_len = end + max(0, num_proposals - 1)
        if not requests:
            return {}
        tokens, probs = self.drafter.propose(requests)
        proposals = {}
        for state, request, t, p in zip(owners, requests, tokens, probs):
            if request.num_proposals:
                proposals[state.req_id] = t
                if p is not None:
                    self.step.draft_probs[state.prob_slot, :len(t)] = p
        return proposals


def token_logprobs(logits: torch.Tensor, states, first_rows: list[int], tokens: list[list[int]]) -> dict:
    """req id -> one logprobs entry per new token, for the states that asked: the target's raw logprobs at
    the verify row that gave the token (request i's j-th token comes from row first_rows[i] + j), as a
    plain step's sampler reports them (collect_logprobs' entries)."""
    asked = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None and tokens[i]]
    if not asked:
        return {}
    device = logits.device
    rows = torch.as_tensor([first_rows[i] + j for i in asked for j in range(len(tokens[i]))], device=device)
    emitted = torch.as_tensor([t for i in asked for t in tokens[i]], device=device)
    num = max(states[i].sampling_params.logprobs for i in asked)
    raw = torch.log_softmax(logits[rows].float(), dim=-1)
    token_logprob, rank, top_ids, top_vals = (t.tolist() for t in gather_logprobs(raw, emitted, num))
    out, at = {}, 0
    for i in asked:
        n = states[i].sampling_params.logprobs
        out[states[i].req_id] = [(token_logprob[r], rank[r], list(zip(top_ids[r][:n], top_vals[r][:n])))
                                 for r in range(at, at + len(tokens[i]))]
        at += len(tokens[i])
    return out
