"""The two paths of a speculative step (spec_runner.py) and the policy that turns speculation on and
off: decode steps run the batched step (the CUDA graphs' code, run as it is on the CPU), every other
step the eager path; each keeps greedy output the target's own, token for token, for any k, for the
draft model and n-gram lookup, whatever the policy decides step by step. (Tests that count drafts pin
the policy on with adaptive=False: on a GPU it would find that the tiny pair does not pay.)"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from fastllm import LLM, SamplingParams
from fastllm.spec_decode import batched_step, draft_decoder, spec_runner
from fastllm.spec_decode.policy import (PRIOR_DRAFTS, PROBE_BUDGET, PROBE_INTERVAL, WINDOW_DRAFT_TOKENS,
                                        WINDOW_STEPS, SpecPolicy, expected_tokens)
from tests.conftest import DRAFT, PROMPTS, STORIES, cached_llm, tokenize
from tests.models.test_llama_vs_hf import TINY, make_tiny_model
from tests.spec_decode.test_spec_decode import assert_third_token_follows_target

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# Text that repeats itself, so that prompt lookup finds something to propose.
REPEATING = ["Once upon a time there was a cat. The cat sat on a mat. The cat sat on a",
             "Tom had a ball. Tom had a ball and a dog. Tom had a ball and a dog and a"]


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture
def path_counts(monkeypatch):
    """How many steps ran the batched step and how many the eager path."""
    counts = {"batched": 0, "eager": 0}

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(batched_step.SpecDecodeStep, "run",
                        counting("batched", batched_step.SpecDecodeStep.run))
    monkeypatch.setattr(spec_runner.SpecDecodeRunner, "_execute_eager",
                        counting("eager", spec_runner.SpecDecodeRunner._execute_eager))
    return counts


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_decode_steps_take_the_batched_step_and_keep_the_targets_tokens(k, path_counts):
    reference = cached_llm().generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = cached_llm(speculative_config={"model": DRAFT, "num_speculative_tokens": k, "adaptive": False})
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference)
    assert path_counts["batched"] > 3 * path_counts["eager"] > 0  # the prefill step (and the ends) are eager


def test_drafts_read_on_the_device_are_the_ones_the_host_would_read(monkeypatch):
    """A batched step takes the drafts of the step before from that step's out on the device (prev_row);
    with that turned off (every draft read from its copy on the host and staged) the same drafts are
    verified: the same tokens, the same number accepted."""
    def run(chained: bool):
        llm = LLM(STORIES, dtype="float32", device="cpu", num_gpu_blocks=256,
                  speculative_config={"model": DRAFT, "num_speculative_tokens": 3, "adaptive": False})
        runner = llm.engine.worker.runner.spec
        execute_step, stage, rows = runner._execute_step, runner.step.stage, []

        def unchained(*args):
            runner._last_proposals = None  # no request's drafts are in the last step's out
            return execute_step(*args)

        def record(stager, tokens, start, num_drafts, kv_limit, prob_slot, prev_row, *rest):
            rows.append(int((prev_row >= 0).sum()))
            return stage(stager, tokens, start, num_drafts, kv_limit, prob_slot, prev_row, *rest)

        monkeypatch.setattr(runner.step, "stage", record)
        if not chained:
            monkeypatch.setattr(runner, "_execute_step", unchained)
        outputs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
        llm.engine.check_kv_pool_whole()
        return token_ids(outputs), llm.engine.scheduler.spec_stats.num_accepted_tokens, sum(rows)

    tokens, accepted, chained_rows = run(chained=True)
    assert chained_rows > 20
    assert run(chained=False) == (tokens, accepted, 0)
    assert accepted > 0


@pytest.mark.parametrize("k", [1, 3, 8])
def test_ngram_lookup_keeps_the_targets_tokens(k, path_counts):
    prompts = REPEATING + PROMPTS[:3]
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=30), GREEDY, GREEDY.clone(max_tokens=9), GREEDY]
    reference = cached_llm().generate(prompts, params, use_tqdm=False)
    llm = cached_llm(speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                                      "adaptive": False})
    stats = llm.engine.scheduler.spec_stats
    accepted = stats.num_accepted_tokens
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == token_ids(reference)
    assert stats.num_accepted_tokens > accepted  # the lookups found text the target agreed with
    assert path_counts["batched"] > 0


@pytest.mark.parametrize("engine", [
    dict(max_num_batched_tokens=16),  # chunked prefill; drafts trimmed to the budget
    dict(num_gpu_blocks=24, block_size=8, max_model_len=128),  # preemption by recompute
    dict(num_gpu_blocks=20, block_size=8, max_model_len=128, preemption_mode="swap", num_cpu_blocks=128),
])
def test_ngram_under_scheduling_pressure(engine):
    prompts = REPEATING * 3
    reference = cached_llm().generate(prompts, GREEDY, use_tqdm=False)
    llm = cached_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}, **engine)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == token_ids(reference)


class _Cycle(SpecPolicy):
    """Proposes k, 0, k, k, 0, 0, ...: every switch on and off, so the draft catches up after
    plain steps (eager) and verifies drafts proposed before a plain step."""

    def __init__(self, k):
        super().__init__(k, adaptive=True)
        self._pattern = itertools.cycle([k, 0, k, k, 0, 0, k, 0, 0, 0])

    def num_to_propose(self, batch_size):
        return next(self._pattern)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_switching_speculation_on_and_off_every_few_steps_keeps_the_targets_tokens(method):
    prompts = PROMPTS + REPEATING
    reference = cached_llm().generate(prompts, GREEDY, use_tqdm=False)
    spec = {"method": method, "num_speculative_tokens": 3, **({"model": DRAFT} if method == "draft_model" else {})}
    llm = LLM(STORIES, dtype="float32", device="cpu", speculative_config=spec, num_gpu_blocks=256)
    llm.engine.scheduler.spec_policy = _Cycle(3)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == token_ids(reference)
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    llm.engine.check_kv_pool_whole()


def test_drafts_after_plain_steps_are_the_draft_models_own_continuation(monkeypatch):
    """Plain steps drop the last proposals, whose KV the draft held past each request's next position: the
    next speculative step runs the draft over what it missed (one forward, then the batched step, not an
    eager one), and its drafts are what the draft model alone continues the text with, greedily."""
    engine = dict(dtype="float32", device="cpu", num_gpu_blocks=256)
    llm = LLM(STORIES, speculative_config={"model": DRAFT, "num_speculative_tokens": 3}, **engine)
    llm.engine.scheduler.spec_policy = _Cycle(3)
    runner = llm.engine.worker.runner.spec
    seen, ran = [], []
    execute, catch_up = runner.execute, runner._catch_up_draft

    def record(sched, req_ids):
        out = execute(sched, req_ids).result()
        for req_id, drafts in (out.spec_token_ids or {}).items():
            state = runner.runner.requests[req_id]  # (a batched step's drafts are read from their copy)
            seen.append((state.prompt_token_ids + state.output_token_ids, runner._draft_values(state, drafts)))
        return spec_runner.AsyncRunnerOutput.ready(out)

    monkeypatch.setattr(runner, "execute", record)
    monkeypatch.setattr(runner, "_catch_up_draft", lambda *a: ran.append(catch_up(*a)) or ran[-1])
    reference = cached_llm().generate(PROMPTS[:3], GREEDY.clone(max_tokens=48), use_tqdm=False)
    outputs = llm.generate(PROMPTS[:3], GREEDY.clone(max_tokens=48), use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference)
    assert any(why is None for why in ran)  # some steps after plain steps caught the draft up and ran batched
    draft = cached_llm(model=DRAFT, **engine)
    wanted = draft.generate([{"prompt_token_ids": tokens} for tokens, _ in seen],
                            [GREEDY.clone(max_tokens=len(d), ignore_eos=True) for _, d in seen], use_tqdm=False)
    assert [d for _, d in seen] == [list(o.outputs[0].token_ids) for o in wanted]
    llm.engine.check_kv_pool_whole()


def test_only_catch_up_steps_are_kept_out_of_the_speculative_step_cost(monkeypatch):
    """The policy sees every speculative decode step's time, eager ones included (a seeded request's), but
    for the steps whose draft first caught up on plain steps (a probe's cost)."""
    seen = []
    observe = SpecPolicy.observe
    monkeypatch.setattr(SpecPolicy, "observe", lambda self, *a: seen.append(a) or observe(self, *a))
    llm = LLM(STORIES, speculative_config={"model": DRAFT, "num_speculative_tokens": 3}, dtype="float32",
              device="cpu", num_gpu_blocks=256)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
                 use_tqdm=False)  # (a seed: every speculative step runs eagerly)
    speculative = [caught_up for spec, _, _, caught_up in seen if spec]
    assert len(speculative) > 5 and not any(speculative)
    seen.clear()
    llm.engine.scheduler.spec_policy = _Cycle(3)
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert any(caught_up for spec, _, _, caught_up in seen if spec)
    assert not any(caught_up for spec, _, _, caught_up in seen if not spec)
    llm.engine.check_kv_pool_whole()


def test_measured_costs_turn_speculation_off_and_probes_turn_it_back_on():
    """With step costs where drafts cannot pay (the speculative step 10x a plain one), the engine
    stops proposing after its first measurements and decodes plainly but for a probe every
    PROBE_INTERVAL steps; the output stays the target's."""
    reference = cached_llm().generate(PROMPTS[:2], GREEDY.clone(max_tokens=120), use_tqdm=False)
    llm = LLM(STORIES, dtype="float32", device="cpu", speculative_model=DRAFT, num_gpu_blocks=256)
    policy = llm.engine.scheduler.spec_policy
    policy.set_step_costs({b: 10.0 for b in (1, 2, 4)}, {b: 1.0 for b in (1, 2, 4)})
    outputs = llm.generate(PROMPTS[:2], GREEDY.clone(max_tokens=120), use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference)
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_drafts < 30  # 2 requests x ~120 steps: verifications only at the start and in probes
    llm.engine.check_kv_pool_whole()


def test_policy_decides_from_costs_and_acceptance():
    policy = SpecPolicy(4, adaptive=True)
    assert policy.num_to_propose(1) == 4  # no costs measured: always
    policy.set_step_costs({1: 8.0, 8: 10.0}, {1: 5.0, 8: 6.0, 64: 9.0})
    for _ in range(20):
        policy.record(4, 4)
    assert policy.num_to_propose(1) == 4  # ~5 tokens for 8 ms against 1 for 5 ms
    assert policy.num_to_propose(64) == 0  # past the largest speculative graph
    for _ in range(200):
        policy.record(4, 0)
    assert policy.acceptance_rate == PRIOR_DRAFTS / (WINDOW_DRAFT_TOKENS + PRIOR_DRAFTS)  # none accepted
    decisions = [policy.num_to_propose(1) for _ in range(32 + 64 + 128)]
    probes = [i for i, k in enumerate(decisions) if k]
    # Off, but for probes ever further apart (the first comes 32 plain steps after the one at batch 64).
    assert probes == [30, 30 + 64, 30 + 64 + 128]


def test_without_graphs_the_log_says_every_step_proposes_k(caplog):
    with caplog.at_level(logging.INFO, logger="fastllm.engine.llm_engine"):
        LLM(STORIES, dtype="float32", device="cpu", cpu_kv_cache_gib=0.03,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert "every decode step proposes 3 tokens: the adaptive policy needs CUDA graphs' step times" \
        in caplog.text


def test_policy_judges_after_a_few_drafts_that_never_pay():
    """At batch 1 (one tried draft a step when none is accepted) speculation stops after a few steps, as soon
    as PRIOR_DRAFTS / (steps + PRIOR_DRAFTS) stops paying, not after the tens of steps (39 here) that a prior
    worth a whole window kept it on."""
    policy = SpecPolicy(4, adaptive=True)
    policy.set_step_costs({1: 12.0}, {1: 6.0})
    steps = 0
    while policy.num_to_propose(1) and steps < 100:
        policy.record(4, 0)
        steps += 1
    assert steps == PRIOR_DRAFTS  # a = 4 / 8 gives 1.94 tokens a 12 ms step against 1 a 6 ms one


def test_policy_turns_on_with_a_margin_and_off_only_when_drafts_stop_paying():
    """Between paying by MARGIN and not paying at all the choice stays as it was, so an estimate that
    wanders around one threshold does not switch speculation on and off every few steps."""
    policy = SpecPolicy(4, adaptive=True)
    for _ in range(20):
        policy.record(4, 4)  # a = 1: 5 tokens a speculative step
    decisions = []
    for spec_ms in [4.9, 4.7, 4.9, 5.1, 4.9, 4.7]:  # against 1 token a 1 ms plain step: 1.02x, 1.06x, ...
        policy.set_step_costs({1: spec_ms}, {1: 1.0})
        decisions.append(policy.num_to_propose(1))
    assert decisions == [0, 4, 4, 0, 0, 4]


def test_acceptance_window_spans_a_few_steps_at_large_batches():
    policy = SpecPolicy(4, adaptive=True)
    policy.set_step_costs({1: 2.0, 32: 2.0}, {1: 1.0, 32: 1.0})
    policy.num_to_propose(32)  # the window: WINDOW_STEPS steps of 32 requests' 4 drafts
    window = WINDOW_STEPS * 4 * 32
    for _ in range(window):
        policy.record(4, 4)
    for _ in range(64):
        policy.record(4, 0)  # one tried draft each
    assert policy.acceptance_rate == (window - 64 + PRIOR_DRAFTS) / (window + PRIOR_DRAFTS)
    policy.num_to_propose(1)  # back to WINDOW_DRAFT_TOKENS: only the rejections are left
    assert policy.acceptance_rate == PRIOR_DRAFTS / (WINDOW_DRAFT_TOKENS + PRIOR_DRAFTS)


def test_acceptance_is_the_mean_over_the_last_tried_drafts():
    policy = SpecPolicy(4, adaptive=True)
    assert policy.acceptance_rate == 1.0  # the prior alone
    policy.record(4, 0)
    assert policy.acceptance_rate == PRIOR_DRAFTS / (1 + PRIOR_DRAFTS)
    for _ in range(WINDOW_DRAFT_TOKENS // 4):
        policy.record(4, 4)
    for _ in range(8):
        policy.record(4, 0)  # one tried draft each: the window drops its oldest full verifications
    assert policy.acceptance_rate == (WINDOW_DRAFT_TOKENS - 8 + PRIOR_DRAFTS) / (WINDOW_DRAFT_TOKENS + PRIOR_DRAFTS)
    rng, estimates = np.random.default_rng(0), []
    for _ in range(2000):  # each draft accepted with probability 0.8 until the first rejection
        accepted = next((i for i in range(4) if rng.random() >= 0.8), 4)
        policy.record(4, accepted)
        estimates.append(policy.acceptance_rate)
    # the window's mean, pulled towards 1 by the prior's share; any one window's is noisier
    want = (0.8 * WINDOW_DRAFT_TOKENS + PRIOR_DRAFTS) / (WINDOW_DRAFT_TOKENS + PRIOR_DRAFTS)
    assert abs(np.mean(estimates[100:]) - want) < 0.02


def test_policy_spaces_probes_by_their_cost():
    """A probe whose catch-up step costs 100 ms beyond plain 5 ms steps waits at least
    100 / (PROBE_BUDGET * 5) plain steps before the next one, not twice the last interval."""
    policy = SpecPolicy(4, adaptive=True)
    policy.set_step_costs({1: 12.0}, {1: 5.0})
    for _ in range(200):
        policy.record(4, 0)
    decisions = []
    for _ in range(32 + 64 + 1200):
        k = policy.num_to_propose(1)
        decisions.append(k)
        if k and len([d for d in decisions if d]) == 2:  # the second probe: its catch-up step, then its verify
            policy.observe(True, 1, 0.105, caught_up=True)
            policy.observe(True, 1, 0.012)
        else:  # (a probe's verify at the speculative step's cost: one measured step replaces the replay time)
            policy.observe(bool(k), 1, 0.012 if k else 0.005)
    probes = [i for i, k in enumerate(decisions) if k]
    budgeted = 100.0 / (PROBE_BUDGET * 5.0)  # the second probe's extra ms (~100 + 7), over 2% of a step
    # the first probe's verify costs 7 ms beyond a plain step: 7 / (PROBE_BUDGET * 5) = 70 plain steps, more
    # than the doubled interval (64)
    assert probes[:2] == [31, 31 + 70]
    assert probes[2] - probes[1] >= budgeted and probes[2] - probes[1] > 2 * 64
    assert policy.step_ms(True, 1) < 13.0  # the catch-up step did not enter the speculative step's cost


def test_lookups_that_find_nothing_turn_speculation_off():
    """An n-gram lookup that finds nothing gives its request one token a step, at a speculative step's cost
    (the step waits for its tokens to look up again): counted as a rejected draft, a run of them stops the
    lookups as a run of rejections would."""
    policy = SpecPolicy(4, adaptive=True)
    policy.set_step_costs({1: 1.2}, {1: 1.0})
    steps = 0
    while policy.num_to_propose(1) and steps < 100:
        policy.record_failed_lookups(1)
        steps += 1
    # the first step where a = PRIOR / (steps + PRIOR) gives fewer than 1.2 tokens a step
    assert steps == next(n for n in range(1, 100) if expected_tokens(PRIOR_DRAFTS / (n + PRIOR_DRAFTS), 4) < 1.2)


def test_the_engine_reports_lookups_that_found_nothing(monkeypatch):
    misses = []
    monkeypatch.setattr(SpecPolicy, "record_failed_lookups", lambda self, n: misses.append(n))
    generator = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (40,), generator=generator).tolist()} for _ in range(3)]
    params = GREEDY.clone(max_tokens=12)
    reference = cached_llm().generate(prompts, params, use_tqdm=False)
    llm = LLM(STORIES, dtype="float32", device="cpu", num_gpu_blocks=256, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 4})
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == token_ids(reference)
    assert sum(misses) > 3  # (random prompts: few of their 4-grams come again)
    llm.engine.check_kv_pool_whole()


def test_synthetic_acceptance_makes_every_ngram_lookup_propose(monkeypatch):
    """Benchmarks only: with a synthetic acceptance rate, a lookup that finds nothing proposes the request's
    last k tokens anyway (random-weight text never repeats), so n-gram rows time verify steps; accepted at
    the rate set, here every draft."""
    import dataclasses

    from fastllm.config import EngineConfig, SpeculativeConfig
    from fastllm.engine.llm_engine import LLMEngine

    misses = []
    monkeypatch.setattr(SpecPolicy, "record_failed_lookups", lambda self, n: misses.append(n))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (40,), generator=generator).tolist() for _ in range(3)]
    config = EngineConfig.from_kwargs(STORIES, dtype="float32", device="cpu", num_gpu_blocks=256)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=4,
                             prompt_lookup_max=4, adaptive=False, synthetic_acceptance_rate=1.0)
    engine = LLMEngine(dataclasses.replace(config, speculative=spec))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY.clone(max_tokens=13, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.scheduler.spec_stats
    assert sum(misses) == 0 and stats.num_drafts >= 3 * 3  # (found nothing: test_the_engine_reports_...)
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    engine.check_kv_pool_whole()


def test_speculative_steps_that_run_eagerly_are_what_speculation_costs():
    """A batch whose steps run eagerly (seeds, penalties, logprobs) pays their time: speculation stops paying
    when those steps cost more than its tokens give, though the graphs' replay times said it would pay."""
    policy = SpecPolicy(4, adaptive=True)
    policy.set_step_costs({1: 8.0}, {1: 5.0})
    for _ in range(20):
        policy.record(4, 2)  # a = 2 / 3: 2.6 tokens a step
    assert policy.num_to_propose(1) == 4  # 2.6 tokens for 8 ms against 1 for 5 ms
    for _ in range(20):
        policy.observe(True, 1, 0.030)  # eager speculative steps of 30 ms
    assert policy.num_to_propose(1) == 0


def test_policy_weighs_wall_time_not_only_gpu_time():
    """A plain step that is host-bound (async scheduling hides the GPU's 0.08 ms, not the host's 0.4)
    makes drafts pay that the graphs' replay times alone would refuse."""
    policy = SpecPolicy(2, adaptive=True)
    policy.set_step_costs({1: 0.4}, {1: 0.08})
    for _ in range(50):
        policy.record(2, 1)  # a = 0.5: 1.75 tokens a step
    assert policy.num_to_propose(1) == 0
    for _ in range(30):
        policy.observe(False, 1, 0.4e-3)
        policy.observe(True, 1, 0.6e-3)
    assert policy.num_to_propose(1) == 2  # 1.75 tokens in 0.6 ms beat 1 in 0.4 ms


def test_the_first_measured_step_replaces_the_replay_time():
    """The graphs' replay times stand in for a size's step costs only until its first step of that kind is
    measured. A host-bound model's plain steps take 0.207 ms against a 0.068 ms replay: blended in a fifth at
    a time from the replay, the estimate crept up one plain step after another and every few steps turned
    failing n-gram lookups back on (the log of the stories260K n-gram benchmark, H200); measured once, it
    turns speculation on once more, keeps it on while it pays and then leaves it to the probes."""
    policy = SpecPolicy(4, adaptive=True)
    policy.set_step_costs({1: 0.151}, {1: 0.068})
    decisions = []
    for _ in range(30):  # (the first probe comes 32 steps after speculation stops)
        decisions.append(policy.num_to_propose(1))
        if decisions[-1]:
            policy.record_failed_lookups(1)
            policy.observe(True, 1, 0.35e-3)
        else:
            policy.observe(False, 1, 0.207e-3)
        if len(decisions) == 2:
            assert policy.step_ms(True, 1) == pytest.approx(0.35)
            assert policy.step_ms(False, 1) == pytest.approx(0.207)
    switches = sum(a != b for a, b in zip(decisions, decisions[1:]))
    assert switches == 3 and decisions[:3] == [4, 0, 4] and not any(decisions[10:])  # on, off, on, off
    policy.set_step_costs({1: 0.151}, {1: 0.068})  # new replay times stand in again until measured
    policy.observe(False, 1, 0.3e-3)
    assert policy.step_ms(False, 1) == pytest.approx(0.3)


def test_a_pause_in_one_step_does_not_turn_speculation_off():
    """A step stalled by a pause (a garbage collection, 200 ms against 8) is one of the size's last measured
    steps, and their low median leaves it out: blended into a running average it alone turned speculation
    off. As a size's first measured step it does turn speculation off, until the next probe measures again."""
    policy = SpecPolicy(4, adaptive=True)
    policy.set_step_costs({1: 8.0}, {1: 5.0})
    for _ in range(20):
        policy.record(4, 2)  # a = 2 / 3: 2.6 tokens a step, 1.6x at 8 ms against 5
    for seconds in (0.008, 0.008, 0.008, 0.200):
        assert policy.num_to_propose(1) == 4
        policy.observe(True, 1, seconds)
    assert policy.num_to_propose(1) == 4 and policy.step_ms(True, 1) == pytest.approx(8.0)

    policy.set_step_costs({1: 8.0}, {1: 5.0})  # again, the pause first
    policy.observe(True, 1, 0.200)
    decisions = []
    for _ in range(40):
        decisions.append(policy.num_to_propose(1))
        policy.observe(bool(decisions[-1]), 1, 0.008 if decisions[-1] else 0.005)
    probe = PROBE_INTERVAL - 1  # (the decision that turned it off is the first of the interval's plain steps)
    assert decisions[0] == 0 and decisions.index(4) == probe and all(decisions[probe:])


def test_spec_tiny_random_configs(tmp_path_factory):
    """Each architecture drafted by another of the same vocabulary: the target's greedy tokens."""
    models = {name: make_tiny_model(tmp_path_factory, name) for name in TINY}
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=generator).tolist()} for n in (5, 17, 33)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    names = sorted(models)
    for target, draft in zip(names, names[1:] + names[:1]):
        reference = cached_llm(models[target]).generate(prompts, params, use_tqdm=False)
        llm = cached_llm(models[target], speculative_config={"model": models[draft], "num_speculative_tokens": 3,
                                                             "adaptive": False})
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == token_ids(reference), (target, draft)


def test_sampled_tokens_through_the_batched_step_follow_the_target(path_counts):
    """The third token of 'Once upon a time' + 2 sampled tokens comes from verifying drafts in the
    batched step (waves of 8 requests: a prefill step, then decode steps of the 8); given the most
    common first pair, its distribution is the target's softmax(logits / T) over the top-k."""
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3)
    prompt = tokenize([PROMPTS[0]])[0]
    llm = cached_llm(speculative_config={"model": DRAFT, "num_speculative_tokens": 4, "adaptive": False})
    stats = llm.engine.scheduler.spec_stats
    drafts = stats.num_drafts
    outputs = []
    for _ in range(80):
        outputs += llm.generate([{"prompt_token_ids": prompt}] * 8, params, use_tqdm=False)
    assert stats.num_drafts - drafts >= 640 and path_counts["batched"] >= path_counts["eager"] == 80
    assert_third_token_follows_target(outputs, prompt, params)


def test_a_request_aborted_mid_speculation_frees_both_models_kv():
    llm = LLM(STORIES, dtype="float32", device="cpu", speculative_model=DRAFT, num_gpu_blocks=128)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.scheduler.spec_stats.num_drafts > 0
    engine.abort_request(["0", "2"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.abort_request(["1", "3"])
    engine.check_kv_pool_whole()


@pytest.mark.parametrize("kwargs, field", [
    (dict(speculative_config={"model": DRAFT, "num_speculative_tokens": 17}), "num_speculative_tokens"),
    (dict(speculative_config={"method": "eagle", "num_speculative_tokens": 2}), "speculative_config.method"),
    (dict(speculative_config={"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}),
     "speculative_config.prompt_lookup_max"),
    (dict(speculative_config={"model": DRAFT, "bogus": 1}), "speculative_config"),
    (dict(speculative_config={"model": DRAFT, "synthetic_acceptance_rate": 0.5}), "speculative_config"),
    (dict(speculative_config='{"model": "llama2xs-279K",'), "speculative_config"),
    (dict(speculative_config={"model": DRAFT, "num_speculative_tokens": 2}, num_speculative_tokens=3),
     "num_speculative_tokens"),
    (dict(num_speculative_tokens=3), "num_speculative_tokens"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 0}), "num_speculative_tokens"),
    (dict(speculative_model=DRAFT, num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_config={}), "speculative_config"),
    (dict(speculative_config={"model": 5}), "speculative_config.model"),
    (dict(speculative_config={"method": "draft_model"}), "speculative_config.model"),
    (dict(speculative_config={"method": "ngram", "quantization": "fp8"}), "speculative_config.quantization"),
    (dict(speculative_config={"model": DRAFT, "quantization": "int8"}), "speculative_config.quantization"),
    (dict(speculative_config={"model": DRAFT, "quantization": "fp8"}), "speculative_config.quantization"),
    (dict(speculative_config="{}"), "speculative_config"),
])
def test_bad_speculative_config_is_a_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LLM(STORIES, device="cpu", **kwargs)


def test_a_draft_of_another_vocabulary_is_refused(tmp_path):
    config = json.loads((Path(STORIES) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's vocabulary \(1000"):
        LLM(STORIES, device="cpu", speculative_config={"model": str(tmp_path)})


def test_json_speculative_config_as_the_cli_gives_it():
    llm = cached_llm(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    spec = llm.engine.config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == \
        ("ngram", 2, 4, 2)


def test_greedy_neighbours_leave_a_sampled_requests_draft_probabilities_alone(path_counts):
    """The batched step keeps the q each sampled request's drafts were drawn from in its own slot; a
    greedy request in the same batch (no slot) must not write its q there. Each pending draft of the
    top_k=6 request was drawn from a q of exactly 6 tokens, the draft among them."""
    llm = LLM(STORIES, dtype="float32", device="cpu", speculative_model=DRAFT, num_speculative_tokens=4,
              num_gpu_blocks=128, async_scheduling=False)  # (each step's proposals are applied before it returns)
    engine, runner = llm.engine, llm.engine.worker.runner
    engine.add_request("greedy-before", PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("sampled", PROMPTS[0], SamplingParams(temperature=1.0, top_k=6, max_tokens=30, ignore_eos=True))
    engine.add_request("greedy-after", PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    checked = 0
    for _ in range(6):
        engine.step()
        state = runner.requests["sampled"]
        drafts = runner.spec._draft_values(state, engine.scheduler.requests["sampled"].spec_token_ids)
        q = runner.spec.step.draft_probs[state.prob_slot, :len(drafts)]
        assert ((q > 0).sum(dim=-1) == 6).all(), (q > 0).sum(dim=-1)
        assert all(q[j, d] > 0 for j, d in enumerate(drafts))
        checked += len(drafts)
    assert checked >= 20 and path_counts["batched"] >= 4
    engine.abort_request(["greedy-before", "sampled", "greedy-after"])
    engine.check_kv_pool_whole()


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_requests_that_run_to_max_model_len_keep_the_targets_tokens(method, path_counts):
    """Near max_model_len a batched step's k + 1 verify rows (and the draft's rounds) reach past the
    last position a request can hold; the rows that are real must still attend to exactly their own
    keys. max_tokens=None: every request runs to max_model_len."""
    engine = dict(max_model_len=32, block_size=8, num_gpu_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    reference = cached_llm(**engine).generate(PROMPTS, params, use_tqdm=False)
    spec = {"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3} \
        if method == "ngram" else {"model": DRAFT, "num_speculative_tokens": 4}
    llm = cached_llm(speculative_config=spec, **engine)
    assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == token_ids(reference)
    assert path_counts["batched"] > 0


def test_sampled_requests_take_probability_slots_as_they_come_free(monkeypatch):
    """With two slots for four sampled requests, the two that arrive last speculate once the first two
    have ended and given their slots back."""
    vocab, k = 512, 4
    monkeypatch.setattr(spec_runner, "DRAFT_PROBS_BYTES", 2 * 4 * k * vocab)
    llm = LLM(STORIES, dtype="float32", device="cpu", speculative_model=DRAFT, num_speculative_tokens=k,
              num_gpu_blocks=256)
    assert len(llm.engine.worker.runner.spec._free_slots) == 2
    short, long = SamplingParams(temperature=0.8, max_tokens=3), SamplingParams(temperature=0.8, max_tokens=40)
    llm.generate(PROMPTS[:4], [short, short, long, long], use_tqdm=False)
    # The short ones verify at most 2 drafts each; the long ones speculate for most of their 40 tokens.
    assert llm.engine.scheduler.spec_stats.num_drafts > 10
    llm.engine.check_kv_pool_whole()


def test_draft_rounds_in_the_persistent_kernel_propose_what_the_drafts_forward_does(monkeypatch):
    """The draft's one-token rounds through its decoder kernel (draft_decoder.py; the interpreter's launches
    here, forced on the CPU): the same proposals as its forward, step for step, and the target's tokens."""
    spec = {"model": DRAFT, "num_speculative_tokens": 3, "adaptive": False}
    proposals = {"forward": [], "decoder": []}
    current = ["forward"]
    original = batched_step.SpecDecodeStep.propose

    def propose(self, bs, sampling):
        original(self, bs, sampling)
        proposals[current[0]].append(self.out[:bs, self.k + 2:].clone())
    monkeypatch.setattr(batched_step.SpecDecodeStep, "propose", propose)

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)  # (the interpreter: ~2 s a round)
    reference = cached_llm(speculative_config=spec).generate(PROMPTS[:1], params, use_tqdm=False)
    rounds = []
    original_call = draft_decoder.DraftDecoder.__call__
    monkeypatch.setattr(draft_decoder.DraftDecoder, "__call__",
                        lambda self, *a: rounds.append(a[0].shape[0]) or original_call(self, *a))
    monkeypatch.setattr(draft_decoder, "unsupported", lambda model, device: None)
    current[0] = "decoder"
    llm = LLM(STORIES, speculative_config=spec, dtype="float32", device="cpu", cpu_kv_cache_gib=0.03)
    try:
        outputs = llm.generate(PROMPTS[:1], params, use_tqdm=False)  # (one request: the kernel's rounds)
        llm.engine.check_kv_pool_whole()
    finally:
        llm.engine.shutdown()
    assert token_ids(outputs) == token_ids(reference)
    assert rounds and len(rounds) == 2 * len(proposals["decoder"]), "k - 1 = 2 decoder rounds a step"
    assert len(proposals["decoder"]) == len(proposals["forward"]) >= 3, len(proposals["decoder"])
    for got, expected in zip(proposals["decoder"], proposals["forward"]):
        assert torch.equal(got, expected)
