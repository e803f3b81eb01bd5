"""LLM.beam_search against Hugging Face transformers' beam search on stories260K in float32: the same
beams in the same order with the same scores, for widths 1-4, ending by EOS or by length, with the
prefix cache on (and hit), async and sync scheduling; the KV pool is whole after every run."""

from __future__ import annotations

import pytest
import torch

from fastllm import BeamSearchParams, SamplingParams
from tests.conftest import PROMPTS, STORIES, _hf_cache, cached_llm, hf_logits, nth_step_fails

PERIOD = 426  # "." as the EOS token: stories260K's own EOS comes after a whole story, "." every sentence
MAX_TOKENS = 16


def hf_model():
    from transformers import AutoModelForCausalLM

    if STORIES not in _hf_cache:
        _hf_cache[STORIES] = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    return _hf_cache[STORIES]


def hf_beams(prompt_ids, width, eos, length_penalty=1.0, early_stopping=False, max_tokens=MAX_TOKENS):
    """transformers' beams, best first: [(generated tokens, score)]. num_beams=1 is its greedy search,
    scored here the way beam search scores (cum logprob / length ** length_penalty)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model().generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                                  num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                                  length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                                  pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    if width == 1:
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        logprobs = torch.log_softmax(hf_logits(STORIES, prompt_ids + tokens), dim=-1)
        cum = sum(logprobs[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(tokens))
        return [(tokens, cum / len(tokens) ** length_penalty)]
    lengths = (out.beam_indices + 1).bool().sum(-1).tolist()
    return [(seq[len(prompt_ids):len(prompt_ids) + n].tolist(), score)
            for seq, n, score in zip(out.sequences, lengths, out.sequences_scores.tolist())]


def run_beam_search(llm, prompts, params, eos):
    saved = llm.engine.eos_token_id
    llm.engine.eos_token_id = eos
    try:
        outs = llm.beam_search(prompts, params)
    finally:
        llm.engine.eos_token_id = saved
    llm.engine.check_kv_pool_whole()
    return outs


def assert_same_beams(outs, prompts_ids, width, eos, length_penalty=1.0, early_stopping=False):
    for out, prompt_ids in zip(outs, prompts_ids):
        want = hf_beams(prompt_ids, width, eos, length_penalty, early_stopping)
        got = out.sequences
        assert [s.tokens for s in got] == [prompt_ids + tokens for tokens, _ in want]
        assert [s.score for s in got] == pytest.approx([score for _, score in want], abs=1e-4)
        for s in got:
            n = len(s.tokens) - len(prompt_ids)
            assert s.score == pytest.approx(s.cum_logprob / n ** length_penalty)
            assert s.finish_reason == ("stop" if eos is not None and s.tokens[-1] == eos else "length")


def assert_equal_runs(a, b):
    """The same beams, in the same order, with scores equal up to float32 rounding (a prefix hit
    computes the prompt's KV along another path)."""
    assert [[s.tokens for s in o.sequences] for o in a] == [[s.tokens for s in o.sequences] for o in b]
    assert [s.score for o in a for s in o.sequences] == pytest.approx([s.score for o in b for s in o.sequences],
                                                                      abs=1e-5)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("eos", [PERIOD, None], ids=["eos", "no-eos"])
def test_beams_equal_transformers(width, eos):
    llm = cached_llm()
    prompts = PROMPTS[:3]
    params = BeamSearchParams(width, max_tokens=MAX_TOKENS, ignore_eos=eos is None)
    outs = run_beam_search(llm, prompts, params, PERIOD)
    prompts_ids = [llm.get_tokenizer()(p)["input_ids"] for p in prompts]
    assert_same_beams(outs, prompts_ids, width, eos)
    if eos is not None:
        assert any(s.finish_reason == "stop" for o in outs for s in o.sequences)
    tok = llm.get_tokenizer()
    assert outs[0].sequences[0].text == tok.decode(outs[0].sequences[0].tokens, skip_special_tokens=True)


@pytest.mark.parametrize("length_penalty, early_stopping", [(0.0, True), (2.0, "never"), (-0.5, False)])
def test_length_penalty_and_early_stopping_equal_transformers(length_penalty, early_stopping):
    llm = cached_llm()
    params = BeamSearchParams(3, max_tokens=MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping)
    outs = run_beam_search(llm, PROMPTS[3:5], params, PERIOD)
    prompts_ids = [llm.get_tokenizer()(p)["input_ids"] for p in PROMPTS[3:5]]
    assert_same_beams(outs, prompts_ids, 3, PERIOD, length_penalty, early_stopping)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prefix_cache_hits_and_scheduling_modes_give_the_same_beams(async_scheduling):
    """The second run's prompts hit the prefix cache (a shared 16-token prefix, and the repeat);
    without the cache and in sync mode the beams are the same."""
    prefix = "Once upon a time, there was a little girl named Lily. She"
    prompts = [prefix + " liked", prefix + " saw", prefix + " liked"]
    params = BeamSearchParams(4, max_tokens=12)
    runs = []
    for kwargs in (dict(enable_prefix_caching=True), dict(enable_prefix_caching=False)):
        llm = cached_llm(async_scheduling=async_scheduling, block_size=4, **kwargs)
        first = run_beam_search(llm, prompts, params, PERIOD)
        hits = llm.engine.scheduler.kv.pool.stats.hits
        second = run_beam_search(llm, prompts, params, PERIOD)
        if kwargs["enable_prefix_caching"]:
            assert llm.engine.scheduler.kv.pool.stats.hits > hits
        assert_equal_runs(first, second)
        runs.append(first)
    assert_equal_runs(runs[0], runs[1])


def test_beam_search_beside_plain_requests_and_preemption():
    """Beam searches share steps with plain requests in an engine too small for all of them
    (preemption); each gives what it gives alone."""
    params = BeamSearchParams(4, max_tokens=20)
    alone = run_beam_search(cached_llm(), PROMPTS[:2], params, PERIOD)
    llm = cached_llm(num_gpu_blocks=24, block_size=4, max_model_len=64)
    engine = llm.engine
    engine.eos_token_id, saved = PERIOD, engine.eos_token_id
    try:
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add_beam_search(f"b{i}", prompt, params)
        engine.add_request("plain", PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    finally:
        engine.eos_token_id = saved
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.scheduler.num_preemptions > 0
    for i, want in enumerate(alone):
        assert [c.token_ids for c in done[f"b{i}"].outputs] == [s.tokens[len(done[f"b{i}"].prompt_token_ids):]
                                                                for s in want.sequences]
    assert len(done["plain"].outputs[0].token_ids) == 30
    engine.check_kv_pool_whole()


def test_a_beam_search_alone_launches_a_step_every_engine_step():
    """With async scheduling every beam waits for the step in flight (its report picks the next tokens): the
    engine finishes that step first and launches the next in the same call, instead of an empty step."""
    llm = cached_llm()
    engine = llm.engine
    assert engine.config.scheduler.async_scheduling
    engine.add_beam_search("s", PROMPTS[0], BeamSearchParams(3, max_tokens=8, ignore_eos=True))
    calls, before = 0, engine.stats.num_steps
    while engine.has_unfinished_requests():
        engine.step()
        calls += 1
    assert engine.stats.num_steps - before == calls - 1 == 8  # the prompt, 7 more positions; the last call ends it
    engine.check_kv_pool_whole()


def test_a_beam_search_beside_a_plain_request_joins_every_step():
    """A plain request beside a beam search does not wait for the step in flight, but the beams do: the
    engine finishes that step before scheduling, so the search takes a step a position, not two."""
    llm = cached_llm()
    engine = llm.engine
    assert engine.config.scheduler.async_scheduling
    engine.add_request("plain", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.add_beam_search("s", PROMPTS[0], BeamSearchParams(3, max_tokens=8, ignore_eos=True))
    before, search_done_at = engine.stats.num_steps, None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if any(o.request_id == "s" for o in outputs):
            search_done_at = engine.stats.num_steps - before
    assert search_done_at is not None and search_done_at <= 8 + 1, search_done_at
    engine.check_kv_pool_whole()


def test_a_search_that_a_failed_step_ends_says_why():
    """A step of the search raises: LLM.beam_search returns that search without sequences and with the
    error (as generate's outputs carry theirs), the pool is whole, and the next search runs."""
    llm = cached_llm()
    with nth_step_fails(llm.engine.worker, 3):
        [failed] = llm.beam_search(PROMPTS[0], BeamSearchParams(2, max_tokens=6, ignore_eos=True))
    assert failed.sequences == [] and "planted step failure" in failed.error
    llm.engine.check_kv_pool_whole()
    [ok] = llm.beam_search(PROMPTS[0], BeamSearchParams(2, max_tokens=6, ignore_eos=True))
    assert ok.error is None and len(ok.sequences) == 2


def test_abort_and_bad_input():
    llm = cached_llm()
    engine = llm.engine
    engine.add_beam_search("x", PROMPTS[0], BeamSearchParams(3, max_tokens=30))
    for _ in range(4):
        engine.step()
    assert engine.get_num_unfinished_requests() == 1
    engine.abort_request("x")
    while engine.has_unfinished_requests():
        assert engine.step() == []
    engine.check_kv_pool_whole()
    with pytest.raises(ValueError, match="BeamSearchParams.beam_width"):
        BeamSearchParams(11, max_tokens=4)
    with pytest.raises(ValueError, match="BeamSearchParams.temperature"):
        BeamSearchParams(2, max_tokens=4, temperature=0.7)
    for penalty in (10.5, -1e30, 1e30, float("nan")):  # (2 ** 1e30 overflowed inside a step)
        with pytest.raises(ValueError, match="BeamSearchParams.length_penalty"):
            BeamSearchParams(2, max_tokens=4, length_penalty=penalty)
    for penalty in (10, -10):  # the ends of the range score without overflow
        [out] = llm.beam_search(PROMPTS[0], BeamSearchParams(2, max_tokens=6, length_penalty=penalty))
        assert out.error is None and len(out.sequences) == 2
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(2, max_tokens=600))
    with pytest.raises(ValueError, match="params must be BeamSearchParams"):
        llm.beam_search(PROMPTS[0], SamplingParams())
    with pytest.raises(ValueError, match=r"BeamSearchParams\.beam_width must be <= max_num_seqs \(2\)"):
        cached_llm(max_num_seqs=2).beam_search(PROMPTS[0], BeamSearchParams(3, max_tokens=4))
    assert not engine.has_unfinished_requests()


@pytest.mark.gpu
def test_beams_on_the_gpu_with_cuda_graphs_equal_eager_and_transformers():
    """On the GPU the beams' steps replay the decode graphs (logits) and sample their logprobs outside
    them: the same beams as the eager engine and as transformers (float32)."""
    from tests.conftest import release_cached_engines

    release_cached_engines()
    params = BeamSearchParams(4, max_tokens=MAX_TOKENS)
    runs = [run_beam_search(cached_llm(device="cuda", enforce_eager=eager), PROMPTS[:3], params, PERIOD)
            for eager in (True, False)]
    assert cached_llm(device="cuda", enforce_eager=False).engine.worker.runner.graphs is not None
    assert_equal_runs(runs[0], runs[1])
    prompts_ids = [cached_llm(device="cuda").get_tokenizer()(p)["input_ids"] for p in PROMPTS[:3]]
    assert_same_beams(runs[1], prompts_ids, 4, PERIOD)


def test_beam_search_with_a_draft_model_loaded():
    """Beams never draft (their logprobs are not what the rejection sampler models): an engine with a
    draft model gives the same beams."""
    from tests.conftest import DRAFT

    params = BeamSearchParams(3, max_tokens=10)
    plain = run_beam_search(cached_llm(), PROMPTS[:2], params, PERIOD)
    spec = run_beam_search(cached_llm(speculative_model=DRAFT, num_speculative_tokens=3), PROMPTS[:2], params, PERIOD)
    assert_equal_runs(plain, spec)


def test_a_callers_request_id_never_clashes_with_a_beams():
    """Beams are requests named after their search (x#beam1, ...): a caller's request of a beam's name
    is refused while that beam lives, and a name a beam has not taken yet is skipped by the search."""
    llm = cached_llm()
    engine = llm.engine
    params = BeamSearchParams(2, max_tokens=6)
    want = run_beam_search(llm, PROMPTS[:1], params, None)[0]
    engine.add_beam_search("x", PROMPTS[0], params)
    engine.step()
    live_beam = next(r for r in engine.scheduler.requests if r.startswith("x#"))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(live_beam, PROMPTS[1], SamplingParams(max_tokens=2))
    engine.add_request("x#beam9", PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [c.token_ids for c in done["x"].outputs] == [s.tokens[len(done["x"].prompt_token_ids):]
                                                        for s in want.sequences]
    assert len(done["x#beam9"].outputs[0].token_ids) == 12
    engine.check_kv_pool_whole()
