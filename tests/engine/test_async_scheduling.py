"""Async scheduling: step N+1 is scheduled and launched before step N's tokens reach the host.
It must give exactly the tokens of running each step to completion, under every path that
touches the in-flight token (preemption, chunked prefill, n > 1, penalties, seeds, stop rules),
and it must really overlap: the next step's input is read from the device."""

from __future__ import annotations

import os
import random

import pytest

from fastllm import SamplingParams
from tests.conftest import PROMPTS, cached_llm

MIXED = [
    SamplingParams(temperature=0.0, max_tokens=40),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=40, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=40, min_tokens=30),
    SamplingParams(temperature=0.0, max_tokens=40, stop=["Lily"]),
    SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[13]),
    SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=24),
    SamplingParams(temperature=0.0, max_tokens=3),
]


# The CPU reference kernels compute each row alone, so the two loops agree to the bit. The GPU
# kernels are not batch-invariant (split counts follow the batch size), and async scheduling runs
# a request stopped by a token one extra step, so batches differ at the tail: there, logprobs are
# compared to fp32 rounding and tokens exactly.
GPU = os.environ.get("FASTLLM_TEST_DEVICE", "cpu") == "cuda"
# A small pool and few graphs: two of these engines live at once, also on the GPU.
BASE = {"num_gpu_blocks": 512, "max_num_seqs": 16}


def run(llm, prompts=PROMPTS, params=MIXED):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason,
              [{t: p.logprob for t, p in step.items()} for step in c.logprobs or []]) for c in o.outputs]
            for o in outputs]


def expect(outputs):
    if not GPU:
        return outputs
    return [[(ids, text, reason, [pytest.approx(step, abs=1e-4) for step in logprobs])
             for ids, text, reason, logprobs in o] for o in outputs]


@pytest.mark.parametrize("engine_args", [
    BASE,
    {**BASE, "max_num_batched_tokens": 16, "max_model_len": 128},
    {"max_num_seqs": 16, "num_gpu_blocks": 16, "block_size": 8, "max_model_len": 96, "preemption_mode": "recompute"},
    {"max_num_seqs": 16, "num_gpu_blocks": 16, "block_size": 8, "max_model_len": 96, "preemption_mode": "swap", "num_cpu_blocks": 64},
], ids=["plain", "chunked", "recompute", "swap"])
@pytest.mark.parametrize("penalties", [True, False], ids=["penalties", "no-penalties"])
def test_async_equals_sync(engine_args, penalties):
    # A request with penalties makes its steps wait for the last tokens; without one, every
    # decode step takes its input token from the device.
    params = MIXED if penalties else [SamplingParams(temperature=0.0, max_tokens=40) if p.has_penalties else p
                                      for p in MIXED]
    sync = run(cached_llm(async_scheduling=False, **engine_args), params=params)
    async_llm = cached_llm(async_scheduling=True, **engine_args)
    before = async_llm.engine.scheduler.num_preemptions
    assert run(async_llm, params=params) == expect(sync)
    if engine_args["num_gpu_blocks"] < 100:
        assert async_llm.engine.scheduler.num_preemptions > before, "the pool was meant to be too small"


def test_next_step_is_launched_before_the_last_tokens_are_read():
    llm = cached_llm(async_scheduling=True, **BASE)
    runner = llm.engine.worker.runner
    launches = []  # per launch: was the previous step's output still unread?
    execute = runner.execute_model

    def recording_execute(sched):
        last = runner._last_output
        launches.append(last is not None and not last.done and not sched.is_empty)
        return execute(sched)

    runner.execute_model = recording_execute
    try:
        llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    finally:
        del runner.execute_model
    # Every step after the first prefill overlaps the one before it.
    assert sum(launches) == 19, launches


def test_a_finished_request_id_can_be_reused_at_once():
    """The id of a request that finished while its next step was in flight is free again; that
    step's stray token must not reach the new request of the same id."""
    llm = cached_llm(async_scheduling=True, **BASE)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first_prompt, second_prompt = PROMPTS[0], PROMPTS[1]
    want = llm.generate([second_prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    # Stop on a token (not by length): the step after it is already in flight when it is seen.
    greedy = llm.generate([first_prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    engine.add_request("a", first_prompt, params.clone(stop_token_ids=[stop]))
    engine.add_request("keep-busy", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    got = None
    reused = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "a" and out.finished:
                if not reused:
                    reused = True
                    engine.add_request("a", second_prompt, params)
                else:
                    got = out.outputs[0].token_ids
    assert reused and got == want


def test_no_token_is_computed_past_max_tokens():
    """A request whose in-flight token is its last is not scheduled again."""
    llm = cached_llm(async_scheduling=True, **BASE)
    scheduled = []
    worker = llm.engine.worker
    execute = worker.execute_model

    def recording_execute(sched):
        scheduled.append(sched.total_num_scheduled_tokens)
        return execute(sched)

    worker.execute_model = recording_execute
    try:
        [out] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)
    finally:
        del worker.execute_model
    # the prompt, then one step per new token but the last (whose KV is never needed)
    assert len(out.outputs[0].token_ids) == 6
    assert sum(scheduled) == len(out.prompt_token_ids) + 5, scheduled


def random_workload(rng: random.Random, max_len: int):
    """Prompts that often share prefixes, with a random mix of sampling rules."""
    base = [rng.randint(1, 500) for _ in range(max_len)]
    prompts, params = [], []
    for _ in range(rng.randint(2, 10)):
        n = rng.randint(1, max_len)
        prompts.append(base[:n] if rng.random() < 0.5 else [rng.randint(1, 500) for _ in range(n)])
        kw = {"max_tokens": rng.randint(1, 2 * max_len - n), "ignore_eos": rng.random() < 0.3}
        if rng.random() < 0.5:
            kw.update(temperature=0.0)
        else:
            kw.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randint(0, 999), top_k=rng.choice([0, 20]))
        if rng.random() < 0.2:
            kw["n"] = rng.randint(2, 3)
        if rng.random() < 0.2:
            kw["stop_token_ids"] = [rng.randint(1, 500)]
        if rng.random() < 0.1:
            kw["repetition_penalty"] = 1.2
        params.append(SamplingParams(**kw))
    return [{"prompt_token_ids": p} for p in prompts], params


@pytest.mark.parametrize("engine_args", [
    {"num_gpu_blocks": 12, "block_size": 4, "max_model_len": 40, "max_num_seqs": 8},
    {"num_gpu_blocks": 12, "block_size": 4, "max_model_len": 40, "max_num_seqs": 8, "preemption_mode": "swap",
     "num_cpu_blocks": 8},
    {"num_gpu_blocks": 20, "block_size": 4, "max_model_len": 40, "max_num_batched_tokens": 8, "max_num_seqs": 6},
], ids=["recompute", "small-swap", "chunked"])
def test_random_workloads_async_equals_sync(engine_args):
    """Random workloads in tiny pools (preemption, prefix hits, forks, chunks): the same tokens and
    finish reasons both ways (logprobs may differ in the last bits where chunking differs), and
    greedy n > 1 siblings equal to each other."""
    sync = cached_llm(async_scheduling=False, **engine_args)
    async_llm = cached_llm(async_scheduling=True, **engine_args)
    for seed in range(3):
        prompts, params = random_workload(random.Random(seed), engine_args["max_model_len"] // 2)
        want = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in sync.generate(prompts, params, use_tqdm=False)]
        got = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in async_llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, f"seed {seed}"
        for p, out in zip(params, want):  # greedy siblings share a prompt's KV and must agree
            if p.n > 1 and p.temperature == 0:
                assert all(c == out[0] for c in out), f"seed {seed}: greedy siblings differ"
