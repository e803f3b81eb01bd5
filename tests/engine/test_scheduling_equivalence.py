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


def test_n3_siblings_fork_only_from_computed_blocks():
    """Prompts sharing prefixes in a 12-block pool: requests are preempted, recomputed with
    prefix-cache hits, and fork n=3 siblings from them. A sibling must never copy a block that
    another request's same step is still to fill (found by fuzzing async vs sync scheduling)."""
    base = [450, 215, 428, 378, 379, 243, 24, 216, 448, 107, 137, 333, 113, 173, 169]
    prompts = [base[:3], base[:7], base, [450], [365, 12, 166, 339, 363, 147, 242, 109, 182, 413, 68, 496, 31, 239],
               base[:8], base[:2], base[:10], base[:13], [90, 334, 423, 312, 386, 438, 19, 405, 356, 345]]
    g = lambda **k: SamplingParams(temperature=0.0, **k)  # noqa: E731
    params = [g(max_tokens=15, ignore_eos=True), g(n=3, max_tokens=30, stop_token_ids=[109]), g(n=3, max_tokens=25),
              g(max_tokens=15, ignore_eos=True), g(max_tokens=25), g(n=3, max_tokens=26, ignore_eos=True),
              g(max_tokens=10), g(max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=124, max_tokens=18, min_tokens=4),
              SamplingParams(temperature=0.7, seed=742, max_tokens=17)]
    llm = cached_llm(num_gpu_blocks=12, block_size=4, max_model_len=40, max_num_seqs=8)
    before = llm.engine.scheduler.num_preemptions
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > before
    for prompt, p, out in zip(prompts, params, outputs):
        if p.n > 1:
            [alone] = llm.generate([{"prompt_token_ids": prompt}], p.clone(n=1), use_tqdm=False)
            assert [c.token_ids for c in out.outputs] == [alone.outputs[0].token_ids] * 3


@pytest.mark.parametrize("spec", [None, {"model": "llama2xs-279K", "num_speculative_tokens": 3}],
                         ids=["plain", "draft"])
def test_most_blocks_in_use_holds_max_num_seqs_requests_of_the_whole_context(spec):
    """A profiled GPU pool never stops below EngineConfig.most_blocks_in_use(): max_num_seqs requests, each to
    the end of the context, run in that many blocks without a preemption (a draft's lookahead stops there
    too); a block fewer preempts."""
    from fastllm.config import EngineConfig

    shape = dict(max_num_seqs=4, max_model_len=64, block_size=4, speculative_config=spec,
                 enable_prefix_caching=False)
    most = EngineConfig.from_kwargs(STORIES, **shape).most_blocks_in_use()
    # Prompts of one length, sharing no block, run to the context's end together: each holds its last block.
    prompts = [{"prompt_token_ids": [1] + [100 + 10 * i + j for j in range(7)]} for i in range(4)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=64 - 8)
    for num_blocks, preempts in ((most, False), (most - 1, True)):
        llm = cached_llm(num_gpu_blocks=num_blocks, **shape)
        before = llm.engine.scheduler.num_preemptions
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 64 for o in outs)
        assert (llm.engine.scheduler.num_preemptions > before) == preempts, (num_blocks, most)
        llm.engine.check_kv_pool_whole()
