"""FP8 weights (quantization="fp8") and an FP8 KV cache (kv_cache_dtype="fp8") with the engine's other
features, through the dequantizing references on the CPU (conftest's allow_fp8_* fixtures lift the
engine's refusal there). Each feature is held to its own oracle with FP8 on both sides: prefix hits give
the misses' tokens, swapped requests the unpreempted ones', speculative decoding the target's own greedy
tokens, n > 1 siblings and beam search (copy-on-write of e4m3 blocks) what the model scores from scratch,
cascade attention the plain path's tokens; a sliding-window model (Mistral) and Qwen3's q/k norms decode
past their window / through the fused norms alike chunked and unchunked. The KV pool is whole after each.

Equality is exact here, as for 16/32-bit weights, with one caveat FP8 adds: a row computed in a batch of
another size (a decode step's one row against a recomputed prefill's many) sums in another order, and where
that moves an activation or a K/V value across an e4m3 rounding boundary the logprobs part by up to a few
tenths (test_fp8_rounding.py measures it). These workloads cross none on the CPU's float32 GEMMs."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fastllm import BeamSearchParams, SamplingParams
from fastllm.kernels.reference import FP8
from tests.conftest import DRAFT, PROMPTS, STORIES, cached_llm
from tests.models.test_llama_vs_hf import make_tiny_model

FP8_BOTH = dict(quantization="fp8", kv_cache_dtype="fp8")
MAX_TOKENS = 12
PREFIX = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"
SHARED = [PREFIX + s for s in (" with", ". One day", " and")] + PROMPTS[1:3]


@pytest.fixture(autouse=True)
def fp8_on_cpu(allow_fp8_on_cpu, allow_fp8_kv_cache_on_cpu):
    pass


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **kw)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def fp8_llm(model=STORIES, **kw):
    kw.setdefault("max_model_len", 128)
    llm = cached_llm(model, **FP8_BOTH, **kw)
    runner = llm.engine.worker.runner
    assert runner.cache.gpu.dtype == FP8 and any(getattr(m, "fp8", None) for m in runner.model.modules())
    return llm


def test_prefix_hits_give_the_misses_tokens():
    off = tokens(fp8_llm(enable_prefix_caching=False, block_size=4).generate(SHARED, greedy(), use_tqdm=False))
    llm = fp8_llm(enable_prefix_caching=True, block_size=4)
    first = tokens(llm.generate(SHARED, greedy(), use_tqdm=False))
    hits = llm.engine.scheduler.kv.pool.stats.hits
    second = tokens(llm.generate(SHARED, greedy(), use_tqdm=False))
    assert llm.engine.scheduler.kv.pool.stats.hits > hits
    assert first == second == off


@contextlib.contextmanager
def swaps_checked(cache):
    """Within the block, every block the cache swaps in must hold the bytes it held when swapped out."""
    held, counts = {}, [0, 0]
    swap_out, swap_in = cache.swap_out, cache.swap_in
    raw = lambda pool, b: pool[:, :, b].view(torch.uint8).clone()  # noqa: E731

    def checked_out(pairs):
        swap_out(pairs)
        held.update({cpu: raw(cache.gpu, gpu) for gpu, cpu in pairs})
        counts[0] += len(pairs)

    def checked_in(pairs):
        swap_in(pairs)
        for cpu, gpu in pairs:
            assert torch.equal(raw(cache.gpu, gpu), held.pop(cpu)), f"block {cpu} came back changed"
        counts[1] += len(pairs)

    cache.swap_out, cache.swap_in = checked_out, checked_in
    try:
        yield counts
    finally:
        del cache.swap_out, cache.swap_in


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("spec", [{}, dict(speculative_model=DRAFT, num_speculative_tokens=3)],
                         ids=["plain", "draft"])
def test_preempted_requests_give_the_unpreempted_tokens(mode, spec):
    """Swapped e4m3 blocks come back byte for byte (with a draft, its 16/32-bit cache swaps beside them)."""
    want = tokens(fp8_llm(block_size=4).generate(SHARED, greedy(24), use_tqdm=False))
    llm = fp8_llm(block_size=4, num_gpu_blocks=40, preemption_mode=mode,
                  num_cpu_blocks=64 if mode == "swap" else None, enable_prefix_caching=False, **spec)
    before = llm.engine.scheduler.num_preemptions
    with contextlib.ExitStack() as stack:
        counts = [stack.enter_context(swaps_checked(c)) for c in llm.engine.worker.runner.caches]
        got = tokens(llm.generate(SHARED, greedy(24), use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > before, "the pool was meant to be too small"
    assert all((c[0] > 0 and c[1] == c[0]) if mode == "swap" else c == [0, 0] for c in counts), counts
    assert got == want


@pytest.mark.parametrize("spec", [dict(speculative_model=DRAFT, num_speculative_tokens=3),
                                  dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})],
                         ids=["draft", "ngram"])
def test_speculative_decoding_gives_the_targets_tokens(spec):
    prompts = SHARED + ["Tom had a dog. Tom had a dog. Tom had a"]
    want = tokens(fp8_llm().generate(prompts, greedy(16), use_tqdm=False))
    llm = fp8_llm(**spec)
    runner = llm.engine.worker.runner
    if runner.drafter is not None:  # the draft's cache and weights stay 16/32-bit
        assert runner.drafter.cache.gpu.dtype == runner.dtype
        assert not any(getattr(m, "fp8", None) for m in runner.drafter.model.modules())
    stats = llm.engine.scheduler.spec_stats
    before = stats.num_accepted_tokens
    assert tokens(llm.generate(prompts, greedy(16), use_tqdm=False)) == want
    assert stats.num_accepted_tokens > before  # drafts were verified against the FP8 cache, and kept


def test_compiled_forward_gives_the_eager_tokens():
    """torch.compile (compile_on_cpu) traces the FP8 linear and the e4m3 cache's attention ops, the KV
    scales constants of the graph."""
    want = tokens(fp8_llm().generate(PROMPTS, greedy(), use_tqdm=False))
    llm = fp8_llm(compile_on_cpu=True)
    assert llm.engine.worker.runner.compile_how is not None
    assert tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == want


def test_cascade_attention_gives_the_plain_paths_tokens():
    off = tokens(fp8_llm(cascade_attention=False, block_size=4).generate(SHARED, greedy(), use_tqdm=False))
    llm = fp8_llm(cascade_attention=True, block_size=4)
    runner, cascaded = llm.engine.worker.runner, []
    plan = runner.cascade.plan
    runner.cascade.plan = lambda *a: cascaded.append(plan(*a)) or cascaded[-1]
    try:
        llm.generate(SHARED, greedy(), use_tqdm=False)
        on = tokens(llm.generate(SHARED, greedy(), use_tqdm=False))
    finally:
        del runner.cascade.plan
    assert any(p is not None for p in cascaded), "no step cascaded"
    assert on == off


def scored_from_scratch(llm, prompt_ids: list[int], generated: list[int]) -> float:
    """The model's summed logprob of `generated` after the prompt, teacher-forced in one prefill."""
    out = llm.generate({"prompt_token_ids": prompt_ids + generated}, greedy(1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return sum(out.prompt_logprobs[len(prompt_ids) + i][t].logprob for i, t in enumerate(generated))


def test_n_siblings_share_the_prompts_blocks():
    want = tokens(fp8_llm(enable_prefix_caching=False, block_size=4).generate(SHARED[3:], greedy(),
                                                                              use_tqdm=False))
    llm = fp8_llm(enable_prefix_caching=False, block_size=4)
    got = tokens(llm.generate(SHARED[3:], greedy(n=3), use_tqdm=False))
    assert got == [w * 3 for w in want]


def test_beam_search_scores_what_the_model_scores_from_scratch():
    """The beams fork each step (copy-on-write of the last e4m3 block); each beam's cumulative logprob is
    what a fresh prefill of its tokens gives (no block shared)."""
    llm = fp8_llm(block_size=4)
    prompts = SHARED[3:]
    outs = llm.beam_search(prompts, BeamSearchParams(3, max_tokens=8, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        prompt_ids = llm.get_tokenizer()(prompt)["input_ids"]
        assert len(out.sequences) == 3 and len({tuple(s.tokens) for s in out.sequences}) == 3
        for s in out.sequences:
            generated = s.tokens[len(prompt_ids):]
            assert s.cum_logprob == pytest.approx(scored_from_scratch(llm, prompt_ids, generated), abs=1e-4)


@pytest.mark.parametrize("arch", ["mistral-window", "qwen3"])
def test_sliding_window_and_qk_norm_models_chunked_and_whole(arch, tmp_path_factory):
    """Mistral's window (decoded past it) and Qwen3's q/k norms with FP8 weights and cache: chunked prefill
    and prefix hits give the tokens of whole prompts."""
    model = make_tiny_model(tmp_path_factory, arch)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (5, 23, 40)]
    whole = tokens(fp8_llm(model, block_size=4, enable_prefix_caching=False).generate(prompts, greedy(24),
                                                                                      use_tqdm=False))
    llm = fp8_llm(model, block_size=4, max_num_batched_tokens=8)
    for _ in range(2):  # the second round hits the prefix cache
        assert tokens(llm.generate(prompts, greedy(24), use_tqdm=False)) == whole
