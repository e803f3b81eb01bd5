"""Cascade attention in the engine (the reference path on the CPU): the same greedy tokens with it on and
off, and as Hugging Face's, for groups of several sizes beside requests that share nothing, with chunked
prefill (mixed steps), preemption, n > 1 siblings and speculative decoding; and the steps really cascaded."""

from __future__ import annotations

import pytest

from fastllm import SamplingParams
from fastllm.worker import cascade
from tests.conftest import DRAFT, STORIES, assert_same_or_near_tie, cached_llm, hf_greedy, tokenize

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


@pytest.mark.parametrize("mode,budget", [(None, None), (True, None), (True, 16)],
                         ids=["auto", "on", "chunked"])
def test_requests_that_share_nothing_take_groups_of_one(mode, budget, monkeypatch):
    # (contexts count as long from a block here, so that the tiny model's lone requests have them)
    monkeypatch.setattr(cascade, "MIN_PREFIX_TOKENS", 4)
    monkeypatch.setattr(cascade, "MIN_GROUP_SIZE", 2)
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 8)
    llm = cached_llm(cascade_attention=mode, **({"max_num_batched_tokens": budget} if budget else {}), **BASE)
    run(llm)
    got, plans = run(llm)
    assert got == [[t] for t in expected()]
    alone = [p for p in plans if (p.kv_start[6:] > 0).all()]  # both lone requests in groups of their own
    assert alone and all(sorted(group_sizes(p))[:2] == [1, 1] for p in alone), [group_sizes(p) for p in plans]
    if budget:  # with prompt chunks beside them (mixed steps: the prefix kernel beside the prefill kernel)
        assert any(len(p.rows) > int((p.kv_start > 0).sum()) for p in alone)
    else:
        assert all(group_sizes(p) == [1, 1, 2, 4] for p in alone)


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


def staged_graphs(llm) -> list[bool]:
    """Stage the engine's decode steps for CUDA graphs, their plans padded to the graphs' bounds: the graph
    runner in its no-replay mode (the same buffers and code around the forward, without capture, so this
    runs on the CPU). Returns the list that each replay appends its cascade flag to; runner.graphs = None
    undoes it."""
    from fastllm.compile.cuda_graphs import CUDAGraphRunner

    runner = llm.engine.worker.runner
    sizes = [1, 2, 4, 8]
    graphs = CUDAGraphRunner(runner.forward, runner.model.compute_logits, runner.attention_layers, sizes,
                             BASE["max_model_len"] // BASE["block_size"], BASE["max_model_len"],
                             runner.args.vocab_size, runner.dtype, runner.device)
    graphs.graphs = dict.fromkeys(sizes)  # as if captured; replay=False never touches them
    graphs.replay = False
    graphs.enable_cascade()
    replayed, replay = [], graphs.replay_staged

    def recording(num, sample_rows=None, sampling=False, cascade=False):
        replayed.append(cascade)
        return replay(num, sample_rows, sampling, cascade)

    graphs.replay_staged = recording
    runner.graphs = graphs
    return replayed


def test_decode_steps_through_the_graph_inputs():
    # the padding of a graph's plan (rows -1, empty groups) changes no token
    llm = cached_llm(cascade_attention=True, **BASE)
    replayed = staged_graphs(llm)
    try:
        run(llm)
        got, _ = run(llm)
        alone, _ = run(llm, PROMPTS[6:])  # requests that share nothing: plain decode steps
    finally:
        llm.engine.worker.runner.graphs = None
    assert got == [[t] for t in expected()] and alone == [[t] for t in expected(PROMPTS[6:])]
    assert any(replayed) and not all(replayed), "cascade and plain decode steps should both replay"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_cascade_graphs(dtype):
    # compiled + CUDA graphs on the GPU: decode steps with groups replay cascade graphs (Triton kernels);
    # fp32 gives Hugging Face's tokens, bf16 the cascade-off engine's until a near-tie of its top two
    from fastllm import LLM

    kw = dict(device="cuda", dtype=dtype, num_gpu_blocks=400, **BASE)
    on_llm = LLM(STORIES, cascade_attention=True, **kw)
    run(on_llm)
    on, plans = run(on_llm)
    graphs = on_llm.engine.worker.runner.graphs
    assert plans and graphs is not None and graphs.cascade_graphs, "no cascade graph was replayed"
    on_llm.engine.check_kv_pool_whole()
    if dtype == "float32":
        assert on == [[t] for t in expected()]
    else:
        off = LLM(STORIES, cascade_attention=False, **kw).generate(PROMPTS, greedy(logprobs=2), use_tqdm=False)
        agree = assert_same_or_near_tie([ids for ids, in on], off)
        print(f"\nbf16 stories260K, cascade on vs off: leading tokens agreeing {agree}")
        assert sum(agree) >= len(PROMPTS) * MAX_TOKENS // 2, f"too few tokens compared: {agree}"
