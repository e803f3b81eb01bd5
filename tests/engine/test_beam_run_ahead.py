"""Run-ahead beam steps (core/beam_run_ahead.py, worker/beam_slots.py) against the synchronous path
(async_scheduling=False runs it) with beam_run_ahead=True on stories260K in float32: the same beams, token for token, with the same
scores, whether a search runs ahead throughout or drains back to requests and returns (a request beside it, a
pool too short, an abort, a failed step); the KV pool whole after every run."""

from __future__ import annotations

import logging

import pytest

from fastllm import BeamSearchParams, SamplingParams
from fastllm.worker.cache_engine import CacheEngine
from tests.conftest import PROMPTS, cached_llm, nth_step_fails

PERIOD = 426  # "." (as in test_beam_search.py): an EOS every sentence
THE = 261  # a token most sentences hold: an EOS-heavy search


def beams(llm, prompts, params, eos=PERIOD):
    """[(tokens, cum logprob, score, finish reason)] per prompt, and the run-ahead steps it took."""
    engine = llm.engine
    saved, engine.eos_token_id = engine.eos_token_id, eos
    before = engine.scheduler.num_run_ahead_steps
    try:
        outs = llm.beam_search(prompts, params)
    finally:
        engine.eos_token_id = saved
    engine.check_kv_pool_whole()
    assert all(o.error is None for o in outs)
    got = [[(s.tokens, s.cum_logprob, s.score, s.finish_reason) for s in o.sequences] for o in outs]
    return got, engine.scheduler.num_run_ahead_steps - before


def ahead_llm(**kw):
    # (no prefix cache unless asked: a prompt another test computed in another batch would be a hit on one path
    # and a miss on the other, which rounds differently)
    kw.setdefault("enable_prefix_caching", False)
    llm = cached_llm(beam_run_ahead=True, **kw)
    assert llm.engine.scheduler.beam_run_ahead_off is None
    return llm


def sync_llm(**kw):
    kw.setdefault("enable_prefix_caching", False)
    llm = cached_llm(async_scheduling=False, beam_run_ahead=True, **kw)
    assert llm.engine.scheduler.beam_run_ahead_off == "async_scheduling=False"
    return llm


def assert_run_ahead_equals_sync(prompts, params, eos=PERIOD, **kw):
    """Each prompt searched alone (a batch of its beams on both paths): equal to the bit."""
    for prompt in prompts:
        got, steps = beams(ahead_llm(**kw), [prompt], params, eos)
        want, _ = beams(sync_llm(**kw), [prompt], params, eos)
        assert got == want, prompt
        assert steps > 0 or params.max_tokens == 1


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_width_equals_the_synchronous_path(width):
    assert_run_ahead_equals_sync(PROMPTS[:2], BeamSearchParams(width, max_tokens=14))


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, True), (0.0, "never"), (2.0, "never"),
                                                            (-0.5, False), (0.5, True), (1.5, False)])
def test_length_penalties_and_early_stopping_equal_the_synchronous_path(length_penalty, early_stopping):
    params = BeamSearchParams(3, max_tokens=16, length_penalty=length_penalty, early_stopping=early_stopping)
    assert_run_ahead_equals_sync(PROMPTS[2:4], params)


@pytest.mark.parametrize("width", [2, 4])
def test_eos_heavy_searches_equal_the_synchronous_path(width):
    """An EOS in most sentences: finished hypotheses every few steps, searches ending early (one step launched
    past the end, its output dropped)."""
    params = BeamSearchParams(width, max_tokens=20, early_stopping=False)
    assert_run_ahead_equals_sync(PROMPTS[:3], params, eos=THE)
    got, _ = beams(ahead_llm(), PROMPTS[:1], params, eos=THE)
    assert any(reason == "stop" for *_, reason in got[0])


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 9])
def test_max_tokens_reached_equals_the_synchronous_path(max_tokens):
    params = BeamSearchParams(3, max_tokens=max_tokens, ignore_eos=True)
    assert_run_ahead_equals_sync(PROMPTS[:2], params)
    got, _ = beams(ahead_llm(), PROMPTS[:1], params)
    assert all(len(tokens) - len(got[0][0][0]) + max_tokens == max_tokens for tokens, *_ in got[0])


def assert_same_tokens(got, want):
    """Several searches in one batch: the same beams; scores to float32 GEMM batch variance (a search that ended
    by EOS ran one step more in the run-ahead batch, so the others' rows were summed in a batch of another size
    there, as they are beside other requests on either path)."""
    assert [[b[0] for b in o] for o in got] == [[b[0] for b in o] for o in want]
    assert [x for o in got for b in o for x in b[1:3]] == pytest.approx([x for o in want for b in o for x in b[1:3]],
                                                                        abs=1e-5)


@pytest.mark.parametrize("eos", [PERIOD, None])
def test_several_searches_at_once_equal_the_synchronous_path(eos):
    params = BeamSearchParams(4, max_tokens=16, ignore_eos=eos is None)
    got, steps = beams(ahead_llm(), PROMPTS[:4], params)
    want, _ = beams(sync_llm(), PROMPTS[:4], params)
    assert steps > 0
    if eos is None:
        assert got == want  # every search ends with the last step: the same batches on both paths
    else:
        assert_same_tokens(got, want)


def run_engine(engine):
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.check_kv_pool_whole()
    return done


@pytest.fixture
def period_eos(monkeypatch):
    """The searches added to the cached engine end at PERIOD (as beams() runs them)."""
    monkeypatch.setattr(ahead_llm().engine, "eos_token_id", PERIOD)


def generated(out):
    return [c.token_ids for c in out.outputs]


def test_searches_of_other_widths_arriving_mid_search_drain_and_return(period_eos):
    """A second search arrives while the first runs ahead: its prompt drains the first back to requests, both
    run synchronously until every beam is one token from its next step, then both run ahead; each gives what it
    gives alone."""
    params = [BeamSearchParams(3, max_tokens=18), BeamSearchParams(5, max_tokens=12, length_penalty=0.5)]
    alone = [beams(sync_llm(), [p], q)[0][0] for p, q in zip(PROMPTS[:2], params)]
    engine = ahead_llm().engine
    engine.add_beam_search("a", PROMPTS[0], params[0])
    for _ in range(5):
        engine.step()
    assert "a" in engine.scheduler.run_ahead
    engine.add_beam_search("b", PROMPTS[1], params[1])
    engine.step()
    assert not engine.scheduler.run_ahead or engine.scheduler.run_ahead["a"].draining
    before = engine.scheduler.num_run_ahead_steps
    done = run_engine(engine)
    assert engine.scheduler.num_run_ahead_steps > before  # they ran ahead again, together
    for name, want in zip("ab", alone):
        assert generated(done[name]) == [tokens[len(done[name].prompt_token_ids):] for tokens, *_ in want]


def test_a_plain_request_drains_the_search_and_both_give_what_they_give_alone(period_eos):
    params = BeamSearchParams(4, max_tokens=20)
    alone = beams(sync_llm(), PROMPTS[:1], params)[0][0]
    engine = ahead_llm().engine
    engine.add_beam_search("s", PROMPTS[0], params)
    for _ in range(4):
        engine.step()
    assert "s" in engine.scheduler.run_ahead
    engine.add_request("plain", PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    before = engine.scheduler.num_run_ahead_steps
    done = run_engine(engine)
    assert engine.scheduler.num_run_ahead_steps > before  # back to running ahead once the request ended
    assert generated(done["s"]) == [tokens[len(done["s"].prompt_token_ids):] for tokens, *_ in alone]
    want = ahead_llm().generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                 use_tqdm=False)[0]
    assert generated(done["plain"]) == generated(want)


def test_abort_mid_search_frees_every_slot():
    llm = ahead_llm()
    engine = llm.engine
    engine.add_beam_search("x", PROMPTS[0], BeamSearchParams(4, max_tokens=30))
    for _ in range(6):
        engine.step()
    assert "x" in engine.scheduler.run_ahead and engine.scheduler.kv.slot_tables
    engine.abort_request("x")
    while engine.has_unfinished_requests():
        assert engine.step() == []
    engine.check_kv_pool_whole()
    assert not engine.worker.runner.beam_slots.states  # the device state went with it
    assert_run_ahead_equals_sync(PROMPTS[:1], BeamSearchParams(4, max_tokens=10))  # and the next search is right


def test_a_failed_run_ahead_step_ends_its_search_with_the_error():
    llm = ahead_llm()
    with nth_step_fails(llm.engine.worker, 5) as steps:
        [failed] = llm.beam_search(PROMPTS[0], BeamSearchParams(3, max_tokens=12, ignore_eos=True))
    assert steps[-1].beam_slot_steps  # the failed step ran ahead
    assert failed.sequences == [] and "planted step failure" in failed.error
    llm.engine.check_kv_pool_whole()
    assert_run_ahead_equals_sync(PROMPTS[:1], BeamSearchParams(3, max_tokens=12, ignore_eos=True))


def test_a_run_ahead_step_whose_update_fails_ends_its_search_with_the_error(monkeypatch):
    # The host's side of the step raises (applying the candidates), not the forward: the search ends with the
    # error, and the engine has nothing left running (it once kept the search and stopped with "no progress").
    from fastllm.core.beam_run_ahead import RunAheadSearch

    llm, apply, calls = ahead_llm(), RunAheadSearch.apply, []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted update failure")
        return apply(self, *args)

    monkeypatch.setattr(RunAheadSearch, "apply", failing)
    [failed] = llm.beam_search(PROMPTS[0], BeamSearchParams(3, max_tokens=12, ignore_eos=True))
    assert failed.sequences == [] and "planted update failure" in failed.error
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_kv_pool_whole()
    assert not llm.engine.worker.runner.beam_slots.states
    monkeypatch.setattr(RunAheadSearch, "apply", apply)
    assert_run_ahead_equals_sync(PROMPTS[:1], BeamSearchParams(3, max_tokens=12, ignore_eos=True))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_short_pool_preempts_synchronously_and_gives_the_roomy_beams(mode, caplog):
    """A pool that holds the beams only with preemption: the searches fall back to the synchronous path (logged
    once), preempt, and give what a roomy pool gives."""
    params = BeamSearchParams(4, max_tokens=20)
    want, _ = beams(sync_llm(), PROMPTS[:2], params)
    kw = dict(num_gpu_blocks=24, block_size=4, max_model_len=64, preemption_mode=mode)
    if mode == "swap":
        kw["num_cpu_blocks"] = 64
    llm = ahead_llm(**kw)
    with caplog.at_level(logging.INFO, logger="fastllm.core.scheduler"):
        got, _ = beams(llm, PROMPTS[:2], params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert "pool" in llm.engine.scheduler._said  # the fallback that ran, logged
    assert_same_tokens(got, want)


@pytest.mark.parametrize("prompt_len", [17, 25, 26])
def test_a_prompt_chunked_to_its_last_token_equals_the_synchronous_path(prompt_len):
    """Chunks of 8 leave 17 and 25 tokens' prompts one token from their first step with a single beam (no fork
    yet), where every search had forked before: the slots' count must grow to the width after that step (it
    failed its step with an IndexError and leaked a block)."""
    prompt = {"prompt_token_ids": [1] + [(37 * i) % 500 + 2 for i in range(prompt_len - 1)]}
    params = BeamSearchParams(3, max_tokens=7)
    assert_run_ahead_equals_sync([prompt], params, max_num_batched_tokens=8)


def test_prefix_cache_hits_give_the_same_beams():
    """The prompts' blocks are cached by a first run and hit by the second, on both paths alike: equal to the bit
    (the beams' own blocks are not registered while they run ahead); a hit against a miss computes the prompt
    along another path, equal to float32 rounding."""
    prefix = "Once upon a time, there was a little girl named Lily. She"
    prompts = [prefix + " liked", prefix + " saw"]
    params = BeamSearchParams(4, max_tokens=12)
    runs = []
    for llm in (ahead_llm(block_size=4, enable_prefix_caching=True), sync_llm(block_size=4, enable_prefix_caching=True)):
        first, _ = beams(llm, prompts, params)
        hits = llm.engine.scheduler.kv.pool.stats.hits
        second, _ = beams(llm, prompts, params)
        assert llm.engine.scheduler.kv.pool.stats.hits > hits
        assert_same_tokens(first, second)
        runs.append(second)
    assert runs[0] == runs[1]


def test_a_lost_partial_block_copy_is_caught(monkeypatch):
    """The checks above can fail: without the copy of each parent's partial block into its slot's, a slot attends
    to a block of zeros where its parent's last tokens were."""
    want, _ = beams(sync_llm(block_size=4), PROMPTS[:1], BeamSearchParams(3, max_tokens=10, ignore_eos=True))
    monkeypatch.setattr(CacheEngine, "copy_indexed", lambda self, src, dst: None)
    got, _ = beams(ahead_llm(block_size=4), PROMPTS[:1], BeamSearchParams(3, max_tokens=10, ignore_eos=True))
    assert got != want


def test_slots_count_as_running_requests():
    """The stats (`/metrics`' running gauge) count a run-ahead search's beams, which are slots, not requests."""
    engine = ahead_llm().engine
    engine.add_beam_search("s", PROMPTS[0], BeamSearchParams(3, max_tokens=12, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append((engine.scheduler.num_slots, engine.stats.num_running))
    assert any(slots == 3 for slots, _ in seen) and all(running >= slots for slots, running in seen)
    assert max(running for _, running in seen) == 3
    engine.check_kv_pool_whole()


def test_on_by_default_and_off_by_its_argument():
    assert cached_llm(enable_prefix_caching=False).engine.scheduler.beam_run_ahead_off is None
    llm = cached_llm(enable_prefix_caching=False, beam_run_ahead=False)
    assert llm.engine.scheduler.beam_run_ahead_off == "beam_run_ahead=False"
    got, steps = beams(llm, PROMPTS[:1], BeamSearchParams(2, max_tokens=4))
    assert steps == 0 and got == beams(sync_llm(), PROMPTS[:1], BeamSearchParams(2, max_tokens=4))[0]


def test_the_synchronous_path_is_logged_once_with_its_reason(caplog):
    with caplog.at_level(logging.INFO, logger="fastllm.core.scheduler"):
        for _ in range(2):
            beams(sync_llm(), PROMPTS[:1], BeamSearchParams(2, max_tokens=4))
    said = [r.getMessage() for r in caplog.records if "beam search: synchronous steps" in r.getMessage()]
    assert said == ["beam search: synchronous steps (async_scheduling=False) (logged once)"] or \
        not said  # (logged by an earlier test of this session's engine)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, kv_cache_dtype", [("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "fp8")])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_run_ahead_on_the_gpu_equals_the_synchronous_path(dtype, kv_cache_dtype, enforce_eager):
    """On CUDA the run-ahead steps replay the decode graphs (or run eagerly), their picks made on the device: the
    beams and scores of the synchronous path, to the bit, for widths 1-8 and with EOS."""
    from tests.conftest import release_cached_engines

    release_cached_engines()
    kw = dict(device="cuda", dtype=dtype, kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager, block_size=4)
    assert (ahead_llm(**kw).engine.worker.runner.graphs is None) == enforce_eager
    for width in (1, 2, 4, 8):
        params = BeamSearchParams(width, max_tokens=24, length_penalty=0.5 if width == 2 else 1.0)
        for eos in (PERIOD, THE):
            assert_run_ahead_equals_sync(PROMPTS[:2], params, eos=eos, **kw)
    params = BeamSearchParams(4, max_tokens=16, ignore_eos=True)
    got, steps = beams(ahead_llm(**kw), PROMPTS[:4], params)
    assert steps > 0 and got == beams(sync_llm(**kw), PROMPTS[:4], params)[0]
