"""The same greedy tokens as Hugging Face under every scheduling path: chunked prefill, a KV
pool small enough to force preemption (recompute and swap), and n > 1 sharing a prompt."""

from __future__ import annotations

import pytest

from fastllm import SamplingParams
from tests.conftest import PROMPTS, STORIES, cached_llm, hf_greedy, tokenize

MAX_TOKENS = 64


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kw)


def expected():
    return [hf_greedy(STORIES, ids, MAX_TOKENS) for ids in tokenize(PROMPTS)]


def test_chunked_prefill_16_token_budget():
    llm = cached_llm(max_num_batched_tokens=16, max_model_len=128)
    long_prompts = [p + " " + " ".join(["and then they played"] * 6) for p in PROMPTS[:3]]
    prompts = PROMPTS + long_prompts
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    for ids, out in zip(tokenize(prompts), outputs):
        assert len(ids) > 16 or out.prompt in PROMPTS
        assert out.outputs[0].token_ids == hf_greedy(STORIES, ids, MAX_TOKENS)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(mode):
    # 8 requests x ~70 tokens need ~40 blocks of 16; 12 usable blocks force preemption.
    llm = cached_llm(num_gpu_blocks=13, block_size=16, max_model_len=128, preemption_mode=mode,
                     num_cpu_blocks=64 if mode == "swap" else None)
    scheduler = llm.engine.scheduler
    before = scheduler.num_preemptions
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert scheduler.num_preemptions > before, "the pool was meant to be too small"
    assert [o.outputs[0].token_ids for o in outputs] == expected()


def test_swap_falls_back_to_recompute_when_cpu_pool_is_small():
    llm = cached_llm(num_gpu_blocks=13, block_size=16, max_model_len=128, preemption_mode="swap", num_cpu_blocks=2)
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected()


@pytest.mark.parametrize("block_size", [4, 16])
def test_n3_greedy_samples_are_equal(block_size):
    llm = cached_llm(block_size=block_size)
    outputs = llm.generate(PROMPTS, greedy(n=3), use_tqdm=False)
    for want, out in zip(expected(), outputs):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for completion in out.outputs:
            assert completion.token_ids == want


def test_n3_with_preemption_and_copy_on_write():
    # prompt lengths vary, so (len - 1) % 4 hits both the shared-partial-block (CoW) and aligned cases
    llm = cached_llm(num_gpu_blocks=40, block_size=4, max_model_len=96, preemption_mode="recompute")
    worker = llm.engine.worker
    copies, forks = [], []
    execute = worker.execute_model

    def recording_execute(sched):
        copies.extend(sched.blocks_to_copy)
        forks.extend(r for r in sched.scheduled_new_reqs if r.num_computed_tokens > 0)
        return execute(sched)

    worker.execute_model = recording_execute
    try:
        outputs = llm.generate(PROMPTS, greedy(n=3), use_tqdm=False)
    finally:
        del worker.execute_model
    assert llm.engine.scheduler.num_preemptions > 0
    assert forks and copies, "siblings should share the prompt's blocks and copy the partial one on write"
    for want, out in zip(expected(), outputs):
        assert all(c.token_ids == want for c in out.outputs)
