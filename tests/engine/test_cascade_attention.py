"""Cascade attention in the engine (the reference path on the CPU): the same greedy tokens with it on and
off, and as Hugging Face's, for groups of several sizes beside requests that share nothing, with chunked
prefill (mixed steps), preemption, n > 1 siblings and speculative decoding; and the steps really cascaded."""

from __future__ import annotations

import pytest

from fastllm import SamplingParams
from tests.conftest import DRAFT, STORIES, cached_llm, hf_greedy, tokenize

MAX_TOKENS = 24
PREFIX_A = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with "
            "her friends.")
PREFIX_B = "One day, a big dog came to the park. The dog was"
# a group of 4 on one prefix, a group of 2 on another, two requests that share nothing
PROMPTS = [PREFIX_A + s for s in (" One day", " She saw", " Her mom", " Then")] + \
          [PREFIX_B + s for s in (" happy", " sad")] + ["The sun was", "Tim had a red"]
BASE = dict(block_size=4, max_model_len=160)


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, **kw)


def run(llm, prompts=PROMPTS, **kw):
    """Token ids per completion, and the plans of the steps that cascaded."""
    runner = llm.engine.worker.runner
    plans, plan = [], runner.cascade.plan

    def recording(states, num_scheduled):
        out = plan(states, num_scheduled)
        if out is not None:
            plans.append(out)
        return out

    runner.cascade.plan = recording
    try:
        outputs = llm.generate(prompts, greedy(**kw), use_tqdm=False)
    finally:
        del runner.cascade.plan
    return [[c.token_ids for c in o.outputs] for o in outputs], plans


_hf: dict = {}


def expected(prompts=PROMPTS):
    for ids in tokenize(prompts):
        if tuple(ids) not in _hf:
            _hf[tuple(ids)] = hf_greedy(STORIES, ids, MAX_TOKENS)
    return [_hf[tuple(ids)] for ids in tokenize(prompts)]


def group_sizes(plan) -> list[int]:
    return sorted(int(n) for n in (plan.row_start[1:] - plan.row_start[:-1]))


def test_same_tokens_with_cascade_on_and_off():
    off, plans_off = run(cached_llm(cascade_attention=False, **BASE))
    # the second round of the warm engine: every request of a group hits its prefix in the cache
    llm = cached_llm(cascade_attention=True, **BASE)
    run(llm)
    on, plans = run(llm)
    assert not plans_off
    assert on == off == [[t] for t in expected()]
    assert plans, "no step cascaded"
    decode_plans = [p for p in plans if len(p.rows) == 6]
    assert decode_plans and all(group_sizes(p) == [2, 4] for p in decode_plans), [group_sizes(p) for p in plans]
    assert all(p.kv_start[6:].tolist() == [0, 0] for p in decode_plans)  # the lone requests


def test_chunked_prefill_mixed_steps():
    # a 16-token budget: prompts go in chunks beside the decodes of the others (mixed steps cascade too)
    llm = cached_llm(cascade_attention=True, max_num_batched_tokens=16, **BASE)
    run(llm)
    got, plans = run(llm)
    assert got == [[t] for t in expected()]
    mixed = [p for p in plans if len(p.rows) > int((p.kv_start > 0).sum())]
    assert mixed, "no mixed step (a chunk's several rows in a group) cascaded"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(mode):
    llm = cached_llm(cascade_attention=True, num_gpu_blocks=41, preemption_mode=mode,
                     num_cpu_blocks=64 if mode == "swap" else None, **BASE)
    before = llm.engine.scheduler.num_preemptions
    got, plans = run(llm)
    assert llm.engine.scheduler.num_preemptions > before, "the pool was meant to be too small"
    assert got == [[t] for t in expected()] and plans


def test_n_siblings_share_their_prompt():
    # no prefix caching: the siblings of an n = 3 request share the prompt's blocks by forking
    llm = cached_llm(cascade_attention=True, enable_prefix_caching=False, **BASE)
    got, plans = run(llm, PROMPTS[4:], n=3)
    assert got == [[t] * 3 for t in expected(PROMPTS[4:])]
    assert plans and max(max(group_sizes(p)) for p in plans) == 3


def test_speculative_decoding():
    kw = dict(speculative_model=DRAFT, num_speculative_tokens=3, **BASE)
    off, _ = run(cached_llm(cascade_attention=False, **kw))
    llm = cached_llm(cascade_attention=True, **kw)
    run(llm)
    on, plans = run(llm)
    assert on == off and plans
