"""SamplingParams.prompt_logprobs: every prompt token's logprob, rank and the top-N, equal to Hugging
Face's teacher-forced log-softmax; whole through chunked prefill, prefix caching (skipped for such
requests), preemption, n > 1 and speculative decoding."""

from __future__ import annotations

import pytest
import torch

from fastllm import SamplingParams
from tests.conftest import DRAFT, PROMPTS, STORIES, cached_llm, hf_logits

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun"


def check_against_hf(out, num: int) -> None:
    ids = out.prompt_token_ids
    scored = out.prompt_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    ref = torch.log_softmax(hf_logits(STORIES, ids), dim=-1)
    for p in range(1, len(ids)):
        row, entry = ref[p - 1], scored[p]
        token = ids[p]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(num)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - lp) < 1e-4


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=7)], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_hf(engine):
    llm = cached_llm(**engine)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=4)
    outputs = llm.generate([PROMPT, PROMPTS[1], PROMPTS[2]], [params, plain, params], use_tqdm=False)
    check_against_hf(outputs[0], 3)
    check_against_hf(outputs[2], 3)
    assert outputs[1].prompt_logprobs is None


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs():
    llm = cached_llm()
    llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)  # the prompt's blocks are now cached
    stats = llm.engine.scheduler.kv.pool.stats
    hits = stats.hits
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert stats.hits == hits
    check_against_hf(out, 0)


def test_n_samples_share_one_list_and_preemption_adds_nothing_twice():
    llm = cached_llm(num_gpu_blocks=12, block_size=8, max_model_len=64)
    params = SamplingParams(temperature=0.8, n=3, max_tokens=40, prompt_logprobs=1, seed=5)
    preemptions = llm.engine.scheduler.num_preemptions
    outputs = llm.generate([PROMPT[:60], PROMPT[10:70]], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > preemptions
    for out in outputs:
        assert len(out.outputs) == 3
        check_against_hf(out, 1)


def test_with_speculative_decoding():
    llm = cached_llm(speculative_model=DRAFT, num_speculative_tokens=3, max_num_batched_tokens=9)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=2), use_tqdm=False)[0]
    check_against_hf(out, 2)


def test_bad_prompt_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.gpu
def test_gpu_prompt_logprobs_equal_hf_with_graphs_on():
    """Compiled with CUDA graphs; a 1-token last chunk (budget 7) must not replay a graph, which has no
    hidden states to score."""
    llm = cached_llm(device="cuda", dtype="float32", max_num_batched_tokens=7, num_gpu_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    for prompt in (PROMPT, PROMPT[:43]):
        check_against_hf(llm.generate(prompt, params, use_tqdm=False)[0], 3)
