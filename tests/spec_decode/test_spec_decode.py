"""Speculative decoding end to end on stories260K with llama2xs-279K as the draft: greedy output is
the target's own, token for token, through chunked prefill, prefix caching, preemption (recompute
and swap), n > 1, stop strings and a batch mixing requests that speculate with ones that cannot
(seeds, penalties, logprobs); sampled output follows the target's distribution; every KV block
comes back."""

from __future__ import annotations

import pytest
import torch

from fastllm import SamplingParams
from tests.conftest import DRAFT, PROMPTS, STORIES, cached_llm, hf_logits, tokenize


def spec_llm(k: int = 4, **kwargs):
    """adaptive=False: every decode step speculates, on a GPU too, where the policy would find that the tiny
    pair does not pay and stop proposing (these tests check what speculation computes; test_spec_paths
    tests the policy)."""
    return cached_llm(speculative_config={"model": DRAFT, "num_speculative_tokens": k, "adaptive": False}, **kwargs)


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
REPEATING = "Once upon a time there was a cat. The cat sat on a mat. The cat sat on a"  # (n-gram lookups hit)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_is_the_targets(k):
    reference = cached_llm().generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = spec_llm(k)
    stats = llm.engine.scheduler.spec_stats
    before = stats.num_accepted_tokens
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference)
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in reference]
    assert stats.num_accepted_tokens > before  # the draft's tokens were used, not only the target's
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)


@pytest.mark.parametrize("engine", [
    dict(max_num_batched_tokens=16),  # chunked prefill; drafts trimmed to the budget
    dict(num_gpu_blocks=24, block_size=8, max_model_len=128),  # preemption by recompute
    dict(num_gpu_blocks=20, block_size=8, max_model_len=128, preemption_mode="swap", num_cpu_blocks=128),
    dict(enable_prefix_caching=False),
])
def test_greedy_output_is_the_targets_under_scheduling_pressure(engine):
    prompts = [p + " and then" for p in PROMPTS]
    reference = cached_llm().generate(prompts, GREEDY, use_tqdm=False)
    llm = spec_llm(3, **engine)
    preemptions = llm.engine.scheduler.num_preemptions
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == token_ids(reference)
    if "num_gpu_blocks" in engine:
        assert llm.engine.scheduler.num_preemptions > preemptions


def test_prefix_cache_hits_keep_the_drafts_kv():
    """A second run of the same prompts reads both models' KV from the cache: same output, and the
    draft is as often right as on the first run (its cached KV is its own, not garbage)."""
    llm = spec_llm(4)
    stats = llm.engine.scheduler.spec_stats
    prompts = [PROMPTS[7] * 3]  # a long prompt: several full blocks to hit
    first_rate = []
    for _ in range(2):
        drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        out = llm.generate(prompts, GREEDY, use_tqdm=False)
        first_rate.append((stats.num_accepted_tokens - accepted) / (stats.num_draft_tokens - drafts))
    assert llm.engine.scheduler.kv.pool.stats.hits > 0
    assert first_rate[1] == first_rate[0]
    assert token_ids(out) == token_ids(cached_llm().generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_requests_with_logprobs_speculate_and_report_the_targets_logprobs(method):
    """Each new token's logprobs entry, accepted drafts' and bonus tokens' alike, is the target's at that
    position: greedy requests report what the plain engine reports; a seeded sampled one's token logprobs
    are the target's own over its text (teacher-forced through prompt_logprobs)."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False,
            **({"model": DRAFT} if method == "draft_model" else {})}
    llm = cached_llm(speculative_config=spec)
    stats = llm.engine.scheduler.spec_stats
    accepted = stats.num_accepted_tokens
    greedy = SamplingParams(temperature=0, logprobs=3, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=7, logprobs=2, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS[:3] + [REPEATING]
    outputs = llm.generate(prompts + PROMPTS[:1], [greedy] * len(prompts) + [sampled], use_tqdm=False)
    assert stats.num_accepted_tokens - accepted > 20  # every request asks for logprobs: they speculated
    reference = cached_llm().generate(prompts, greedy, use_tqdm=False)
    assert token_ids(outputs[:len(prompts)]) == token_ids(reference)
    for got, want in zip(outputs, reference):
        got_lp, want_lp = got.outputs[0].logprobs, want.outputs[0].logprobs
        assert len(got_lp) == len(got.outputs[0].token_ids) == len(want_lp)
        assert [sorted(s) for s in got_lp] == [sorted(s) for s in want_lp]
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank
                   for a, b in zip(got_lp, want_lp) for t in a)
    out = outputs[-1].outputs[0]
    forced = cached_llm().generate({"prompt_token_ids": outputs[-1].prompt_token_ids + list(out.token_ids)},
                                   SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    target = forced.prompt_logprobs[len(outputs[-1].prompt_token_ids):]
    assert len(out.logprobs) == len(out.token_ids) == len(target)
    assert all(abs(entry[t].logprob - want[t].logprob) < 1e-4
               for entry, want, t in zip(out.logprobs, target, out.token_ids))
    llm.engine.check_kv_pool_whole()


def test_n_samples_and_a_mixed_batch_match_the_target_alone():
    """Greedy n=2 siblings (forked KV, copy-on-write), requests that speculate with penalties and a
    min_tokens mask (each verify row sees the drafts before it as output), one with logprobs and plain
    ones: each output is what the plain engine gives."""
    period = tokenize(["."])[0][-1]
    params = [
        SamplingParams(temperature=0, n=2, max_tokens=40),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=40),
        SamplingParams(temperature=0, frequency_penalty=0.8, presence_penalty=-0.5, max_tokens=40),
        SamplingParams(temperature=0, logprobs=3, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=40, stop=[" the"]),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, min_tokens=30, max_tokens=40, stop_token_ids=[period]),
    ]
    prompts = PROMPTS[:len(params)]
    reference = cached_llm().generate(prompts, params, use_tqdm=False)
    llm = spec_llm(4)
    stats = llm.engine.scheduler.spec_stats
    drafts = stats.num_drafts
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference)
    assert stats.num_drafts - drafts > 40  # the penalized and min_tokens requests speculated too
    for got, want in zip(outputs, reference):
        for a, b in zip(got.outputs, want.outputs):
            assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason, b.stop_reason)
    got_lp, want_lp = outputs[3].outputs[0].logprobs, reference[3].outputs[0].logprobs
    assert [sorted(s) for s in got_lp] == [sorted(s) for s in want_lp]
    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for a, b in zip(got_lp, want_lp) for t in a)
    assert outputs[4].outputs[0].finish_reason == "stop"  # the stop string ended it among accepted drafts
    assert period in reference[6].outputs[0].token_ids[:30] or True  # (whether min_tokens held one back)
    assert period not in outputs[6].outputs[0].token_ids[:30]


def test_seeded_sampling_speculates_and_repeats_itself():
    """A seeded request speculates (its draws come from its own generator, so its tokens differ from
    the plain engine's but are the same on every run)."""
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40)
    llm = spec_llm(4)
    stats = llm.engine.scheduler.spec_stats
    drafts = stats.num_drafts
    first = token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False))
    assert stats.num_drafts - drafts >= 10
    assert token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False)) == first


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    period = tokenize(["."])[0][-1]  # stories end sentences often; EOS itself is rare within 200 tokens
    plain = SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[period])
    reference = cached_llm().generate(PROMPTS, plain, use_tqdm=False)
    assert sum(o.outputs[0].finish_reason == "stop" for o in reference) >= 6
    outputs = spec_llm(5).generate(PROMPTS, plain, use_tqdm=False)
    assert token_ids(outputs) == token_ids(reference)
    assert [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outputs] == \
        [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in reference]


def test_sampled_tokens_follow_the_target():
    """The third token of 'Once upon a time' + 2 tokens comes from verifying one draft token
    (max_tokens=3 leaves room for exactly one). Its distribution, among samples whose first two
    tokens are the most common pair, is the target's softmax(logits / T) over the top-k."""
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3)
    prompt = tokenize([PROMPTS[0]])[0]
    llm = spec_llm(4)
    stats = llm.engine.scheduler.spec_stats
    drafts = stats.num_drafts
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 600, params, use_tqdm=False)
    assert stats.num_drafts - drafts >= 600  # each sample's third token was a verification
    assert_third_token_follows_target(outputs, prompt, params)


def assert_third_token_follows_target(outputs, prompt: list[int], params: SamplingParams) -> None:
    """Among samples whose first two tokens are the most common pair, the third is distributed as
    the target's softmax(logits / T) over its top-k. ~200+ draws over 6 tokens: the TV distance of a
    correct sampler stays under 0.1 (far more than its noise); a sampler that kept the draft's tokens
    is > 0.15 away."""
    pairs = {}
    for o in outputs:
        pairs.setdefault(tuple(o.outputs[0].token_ids[:2]), []).append(o.outputs[0].token_ids[2])
    pair, thirds = max(pairs.items(), key=lambda kv: len(kv[1]))
    assert len(thirds) >= 200
    logits = hf_logits(STORIES, prompt + list(pair))[-1] / params.temperature
    kth = logits.topk(params.top_k).values[-1]
    p = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    counts = torch.bincount(torch.tensor(thirds), minlength=p.numel()).float()
    tv = 0.5 * float((counts / counts.sum() - p).abs().sum())
    assert counts[p == 0].sum() == 0
    assert tv < 0.1, (tv, len(thirds))


def test_async_engine_streams_several_tokens_a_step_and_aborts_cleanly():
    import asyncio

    from fastllm.engine.async_llm_engine import AsyncLLMEngine
    from fastllm.sampling_params import RequestOutputKind

    offline = cached_llm().generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    from fastllm.engine.llm_engine import LLMEngine

    # the core on a thread of this process, so that the pool can be checked afterwards
    engine = AsyncLLMEngine(LLMEngine.from_kwargs(None, device="cpu", dtype="float32", num_gpu_blocks=128,
                                                  speculative_model=DRAFT, num_speculative_tokens=4))
    delta = GREEDY.clone(output_kind=RequestOutputKind.DELTA)

    async def main():
        async def collect(prompt, request_id):
            return [out async for out in engine.generate(prompt, delta, request_id)]

        long = engine.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), "gone")
        await anext(long)
        await long.aclose()  # aborted mid-generation: its target and draft slots go back
        return await asyncio.gather(*(collect(p, f"r{i}") for i, p in enumerate(PROMPTS[:3])))

    try:
        streams = asyncio.run(main())
    finally:
        engine.shutdown()
    for outs, want in zip(streams, offline):
        assert [t for o in outs for t in o.outputs[0].token_ids] == want.outputs[0].token_ids
        assert "".join(o.outputs[0].text for o in outs) == want.outputs[0].text
    assert any(len(o.outputs[0].token_ids) > 1 for outs in streams for o in outs)  # drafts came through
    engine.engine.check_kv_pool_whole()


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_gpu_greedy_output_is_the_cpu_targets(eager):
    """On the GPU the verify steps run the chunked-prefill kernel (compiled target) and the draft the
    decode kernels: still the target's greedy tokens."""
    prompts = PROMPTS * 2
    params = SamplingParams(temperature=0, max_tokens=64)
    want = token_ids(cached_llm(device="cpu", dtype="float32").generate(prompts, params, use_tqdm=False))
    llm = spec_llm(4, device="cuda", dtype="float32", enforce_eager=eager, num_gpu_blocks=2048)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.engine.scheduler.spec_stats.acceptance_rate > 0.3


def test_metrics_count_drafts_and_accepted_tokens():
    pytest.importorskip("prometheus_client")
    from fastllm.metrics import ServingMetrics

    llm = spec_llm(4)
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    stats = llm.engine.scheduler.spec_stats
    lines = ServingMetrics(llm.engine).render().decode().splitlines()
    assert f"fastllm_spec_decode_num_draft_tokens_total {float(stats.num_draft_tokens)}" in lines
    assert f"fastllm_spec_decode_num_accepted_tokens_total {float(stats.num_accepted_tokens)}" in lines
    assert f"fastllm_spec_decode_num_drafts_total {float(stats.num_drafts)}" in lines
    assert f"fastllm_spec_decode_acceptance_rate {stats.acceptance_rate}" in lines
    assert f"fastllm_spec_decode_mean_accepted_length {stats.mean_acceptance_length}" in lines
    assert stats.num_accepted_tokens > 0
