"""Every split gives one process's greedy tokens: TP = 2 and 4, PP = 2 (stories260K's 5 layers as
3 + 2) and TP 2 x PP 2, over gloo on the CPU in float32, on stories260K and on random tiny configs of
each architecture (Llama 3.1, Mistral, Qwen2's qkv bias, Qwen3's q/k norms, from their safetensors;
and a Qwen2 config whose vocabulary of 509 leaves padding on the last rank, with dummy weights).
The tests of one split run together and share its worker processes (reuse_workers): each engine
loads its model into the ranks the one before it left.

The stories260K engines run with a 24-token budget (long prompts are chunked), a KV pool small enough
to preempt (swap for some splits, recompute for the others) and prefix caching (a second round of
prompts extends the first round's). Their reference is one process with the same settings.

Logits differ from one process in the last bits (a row-parallel projection sums its partial products
in another order), so the tokens are compared as far as the reference's top-2 logprob gap is clear:
a near-tie may go either way. Every split of every model is held to a minimum of compared tokens.
"""

from __future__ import annotations

import pytest
import torch

from fastllm import SamplingParams
from fastllm.worker.executor import end_parked_workers
from tests.conftest import PROMPTS, STORIES, cached_llm
from tests.distributed.conftest import SMALL_KV, odd_vocab_config, shutdown_parallel_llm, start_parallel_llm
from tests.models.test_llama_vs_hf import TINY, make_tiny_model

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2, reuse_workers=True),
    "tp4": dict(tensor_parallel_size=4, reuse_workers=True),
    "pp2": dict(pipeline_parallel_size=2, reuse_workers=True),
    "tp2pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, reuse_workers=True),
}
PREEMPTION = {"tp2": "swap", "tp4": "recompute", "pp2": "swap", "tp2pp2": "recompute"}
SCHEDULING = dict(max_num_batched_tokens=24, max_model_len=128, block_size=8, num_gpu_blocks=20)
MAX_TOKENS = 16
MARGIN = 1e-4  # a top-2 logprob gap below this is a near-tie (float32 reorderings move logits ~1e-6)
LOGPROB_TOL = 1e-4
LONG = " and then they played in the park with the big red ball until the sun went down"


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=2, **kw)


def compare(got, want) -> int:
    """Tokens equal to the reference's up to its first near-tie, with close logprobs; returns how many
    tokens were compared."""
    compared = 0
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        for i, token in enumerate(w.token_ids):
            top = sorted((lp.logprob for lp in w.logprobs[i].values()), reverse=True)
            assert g.token_ids[i] == token, f"token {i} of {w.token_ids} (got {g.token_ids})"
            assert abs(g.logprobs[i][token].logprob - w.logprobs[i][token].logprob) < LOGPROB_TOL
            compared += 1
            if len(top) > 1 and top[0] - top[1] < MARGIN:
                break  # a near-tie: the rest may part legitimately
    return compared


def generate_both(llm, ref, prompts):
    return llm.generate(prompts, greedy(), use_tqdm=False), ref.generate(prompts, greedy(), use_tqdm=False)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    yield request.param
    end_parked_workers()


@pytest.fixture
def stories_pair(layout):
    mode = PREEMPTION[layout]
    settings = dict(SCHEDULING, preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else None)
    llm = start_parallel_llm(STORIES, **LAYOUTS[layout], **settings)
    yield llm, cached_llm(**settings)
    shutdown_parallel_llm(llm)


def test_stories_greedy_with_chunks_preemption_and_prefix_hits(stories_pair):
    llm, ref = stories_pair
    first = PROMPTS[:6] + [PROMPTS[0] + LONG, PROMPTS[2] + LONG]
    assert compare(*generate_both(llm, ref, first)) >= 0.9 * len(first) * MAX_TOKENS
    # Extensions of the long prompts: their cached blocks are hits.
    second = [PROMPTS[0] + LONG + " again", PROMPTS[2] + LONG + " and ate"]
    stats = llm.engine.scheduler.kv.pool.stats
    hits = stats.hits
    assert compare(*generate_both(llm, ref, second)) >= 0.9 * len(second) * MAX_TOKENS
    assert stats.hits > hits, "the second round should reuse the first round's blocks"
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    # Seeded sampling draws the same tokens as one process (every rank samples the same gathered logits).
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=s) for s in range(4)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in ref.generate(PROMPTS[:4], params, use_tqdm=False)]


def test_stories_steps_one_at_a_time(layout):
    # async_scheduling=False: each step's tokens are read before the next is scheduled (the workers
    # must read them at the same point: the runner's next step depends on it).
    settings = dict(async_scheduling=False, max_num_batched_tokens=24, **SMALL_KV)
    want = cached_llm(**settings).generate(PROMPTS[:4], greedy(), use_tqdm=False)
    llm = start_parallel_llm(STORIES, **LAYOUTS[layout], **settings)
    try:
        got = llm.generate(PROMPTS[:4], greedy(), use_tqdm=False)
    finally:
        shutdown_parallel_llm(llm)
    assert compare(got, want) >= 0.9 * 4 * MAX_TOKENS


@pytest.mark.parametrize("arch", sorted(TINY) + ["qwen2-vocab509"])
def test_tiny_architecture(arch, layout, tmp_path_factory):
    if arch == "qwen2-vocab509":  # dummy weights; the last rank's vocabulary rows end in padding
        path, kwargs, vocab = odd_vocab_config(tmp_path_factory), dict(load_format="dummy"), 509
    else:
        path, kwargs, vocab = make_tiny_model(tmp_path_factory, arch), {}, 512
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=generator).tolist()}
               for n in (5, 17, 33)]
    kwargs.update(SMALL_KV)
    want = cached_llm(path, **kwargs).generate(prompts, greedy(), use_tqdm=False)
    llm = start_parallel_llm(path, **LAYOUTS[layout], **kwargs)
    try:
        got = llm.generate(prompts, greedy(), use_tqdm=False)
    finally:
        shutdown_parallel_llm(llm)
    assert compare(got, want) >= 0.75 * len(prompts) * MAX_TOKENS
