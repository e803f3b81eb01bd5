"""Automatic prefix caching: the same outputs with caching on and off, and a pool that stays
consistent (cached blocks are never rewritten, never handed out while in use)."""

from __future__ import annotations

import pytest

from fastllm import SamplingParams
from fastllm.core.block_hash import hash_block_tokens
from tests.conftest import PROMPTS, cached_llm, hf_greedy, STORIES

BASE = dict(max_model_len=128, block_size=4)
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big red ball.")


def greedy(max_tokens=32, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def shared_prefix_prompts():
    # Prefixes sharing 0..all of their blocks, ending mid-block, one prompt equal to another.
    return [STORY + " " + s for s in ("Lily", "She was happy", "Then", "The ball")] + [
        STORY[:40], STORY[:41], STORY, STORY, "A dog", PROMPTS[3]]


def run(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("extra", [{}, dict(num_gpu_blocks=48), dict(max_num_batched_tokens=16),
                                   dict(num_gpu_blocks=48, preemption_mode="swap", num_cpu_blocks=64)],
                         ids=["plain", "evicting", "chunked", "swap"])
def test_same_outputs_with_and_without_caching(extra):
    prompts = shared_prefix_prompts()
    off = cached_llm(enable_prefix_caching=False, **BASE, **extra)
    on = cached_llm(enable_prefix_caching=True, **BASE, **extra)
    want = run(off, prompts, greedy())
    stats = on.engine.scheduler.kv.pool.stats
    hits_before = stats.hits
    # Twice: the second round finds the first round's blocks (or what eviction left of them).
    assert run(on, prompts, greedy()) == want
    assert run(on, prompts, greedy()) == want
    assert stats.hits > hits_before
    if "num_gpu_blocks" in extra:
        assert stats.evictions > 0, "the pool was meant to be small enough to evict cached blocks"
    on.engine.scheduler.kv.check_invariants()


def test_hit_rate_and_skipped_compute():
    llm = cached_llm(enable_prefix_caching=True, **BASE, num_gpu_blocks=400)
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    stats = llm.engine.scheduler.kv.pool.stats
    first = llm.generate(STORY + " Lily", greedy(), use_tqdm=False)[0]
    q0, h0 = stats.queries, stats.hits
    second = llm.generate(STORY + " Lily", greedy(), use_tqdm=False)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    prompt_len = len(first.prompt_token_ids)
    assert stats.queries - q0 == prompt_len
    # all full blocks but the one holding the last prompt token
    assert stats.hits - h0 == (prompt_len - 1) // 4 * 4


def test_n_and_preemption_with_caching():
    off = cached_llm(enable_prefix_caching=False, num_gpu_blocks=60, **BASE)
    on = cached_llm(enable_prefix_caching=True, num_gpu_blocks=60, **BASE)
    prompts = shared_prefix_prompts()[:6]
    want = [[c.token_ids for c in o.outputs] for o in off.generate(prompts, greedy(n=3), use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in on.generate(prompts, greedy(n=3), use_tqdm=False)]
    assert got == want
    assert on.engine.scheduler.num_preemptions > 0


def test_outputs_match_hf_with_warm_cache():
    llm = cached_llm(enable_prefix_caching=True, **BASE)
    from tests.conftest import tokenize
    prompts = [STORY + " Lily", STORY + " Then"]
    run(llm, prompts, greedy())  # warm
    for ids, got in zip(tokenize(prompts), run(llm, prompts, greedy(max_tokens=48))):
        assert got == hf_greedy(STORIES, ids, 48)


def colliding_hash(parent, tokens, extra=b""):
    """Every block hashes alike: only token/parent confirmation keeps the cache correct."""
    return b"same"


def test_colliding_hash_cannot_corrupt_outputs():
    from fastllm.engine.llm_engine import LLMEngine
    from fastllm.config import EngineConfig
    from fastllm.entrypoints.llm import LLM

    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(EngineConfig.from_kwargs(None, dtype="float32", device="cpu", **BASE),
                           hash_fn=colliding_hash)
    import itertools
    llm._ids = itertools.count()
    reference = cached_llm(enable_prefix_caching=False, **BASE)
    prompts = shared_prefix_prompts()
    want = run(reference, prompts, greedy())
    assert run(llm, prompts, greedy()) == want
    assert run(llm, prompts, greedy()) == want
    llm.engine.check_kv_pool_whole()


def test_sha256_chain_is_prefix_sensitive():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [1, 2, 3, 4])
    assert a != b and len(a) == 32
    assert hash_block_tokens(None, [1, 2, 3, 4]) == a
    assert hash_block_tokens(None, [1, 2, 3, 4], b"lora") != a
