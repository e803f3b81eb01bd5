"""Beam search in the scheduler, driven by FakeRunner over a toy language model: the beams equal
transformers' own beam search loop on the same logprobs (its helper methods do the work), and the
beams share KV blocks, copy on write only where they part, and free them the moment they end."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastllm.core.beam_search import BeamSearch
from fastllm.engine.request import Request
from fastllm.sampling_params import BeamSearchParams
from tests.core.utils import TOKEN, FakeRunner, make_scheduler, prompt_tokens, step

VOCAB = 16
EOS = 2


def toy_logprobs(tokens: list[int], eos_bias: float = 1.0) -> torch.Tensor:
    """float32 next-token logprobs [VOCAB], a fixed function of the sequence (so every beam that holds
    the same tokens sees the same distribution)."""
    g = torch.Generator().manual_seed(zlib.crc32(bytes(str(tokens), "ascii")))
    logits = torch.randn(VOCAB, generator=g) * 2
    logits[EOS] += eos_bias
    return torch.log_softmax(logits, dim=-1)


def hf_beam_search(prompt, width, max_new, eos, length_penalty, early_stopping, eos_bias):
    """transformers' GenerationMixin._beam_search loop for one prompt, with toy_logprobs in place of the
    model; returns [(generated tokens, score)] best first."""
    from transformers.generation.utils import GenerationMixin as G

    cur_len = prompt_len = len(prompt)
    max_length = prompt_len + max_new
    keep = max(2, 1 + (eos is not None)) * width
    top_mask = torch.arange(keep) < width
    running = torch.full((1, width, max_length), eos if eos is not None else -1, dtype=torch.int64)
    running[:, :, :cur_len] = torch.tensor(prompt)
    sequences = running.clone()
    running_scores = torch.zeros(1, width)
    running_scores[:, 1:] = -1e9
    scores = torch.full((1, width), -1e9)
    finished = torch.zeros(1, width, dtype=torch.bool)
    may_improve = torch.ones(1, 1, dtype=torch.bool)
    running_idx = torch.full((1, width, max_length - cur_len), -1, dtype=torch.int32)
    beam_idx = running_idx.clone()
    while True:
        logprobs = torch.stack([toy_logprobs(running[0, b, :cur_len].tolist(), eos_bias) for b in range(width)])
        acc = (logprobs[None] + running_scores[:, :, None]).reshape(1, -1)
        top_lp, top_seq, top_idx = G._get_top_k_continuations(
            G, accumulated_log_probs=acc, running_sequences=running, running_beam_indices=running_idx,
            cur_len=cur_len, decoder_prompt_len=prompt_len, do_sample=False, beams_to_keep=keep, num_beams=width,
            batch_size=1)
        hits = torch.full((1, keep), cur_len + 1 >= max_length)
        if eos is not None:
            hits |= top_seq[:, :, cur_len] == eos
        running, running_scores, running_idx = G._get_running_beams_for_next_iteration(
            G, top_lp, top_seq, top_idx, hits, width)
        sequences, scores, beam_idx, finished = G._update_finished_beams(
            G, sequences, top_seq, scores, top_lp, beam_idx, top_idx, may_improve, finished, hits, top_mask, width,
            cur_len, prompt_len, length_penalty, early_stopping)
        cur_len += 1
        may_improve = G._check_early_stop_heuristic(may_improve, running_scores, scores, finished, cur_len,
                                                    max_length, prompt_len, early_stopping, length_penalty)
        if not G._beam_search_has_unfinished_sequences(may_improve, finished, hits, early_stopping):
            break
    lengths = (beam_idx[0] + 1).bool().sum(-1).tolist()
    return [(sequences[0, i, prompt_len:prompt_len + n].tolist(), scores[0, i].item()) for i, n in enumerate(lengths)]


def start(sched, request_id: str, prompt: list[int], params: BeamSearchParams, eos=EOS) -> BeamSearch:
    search = BeamSearch(request_id, prompt, params, eos, params.max_tokens)
    first = Request(search.next_beam_id(), prompt, params.sampling_params(), eos, params.max_tokens,
                    sched.block_size, sched.hash_fn)
    sched.add_beam_search(search, first)
    return search


def run(sched, runner, max_steps: int = 500) -> dict[str, BeamSearch]:
    done = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
        done.update((s.request_id, s) for s in sched.take_finished_beam_searches())
    assert not sched.beam_searches and not sched.has_unfinished_requests()
    assert not sched._beam_of and not sched._beam_sampled  # nothing kept of a beam once its search ends
    sched.kv.assert_empty()
    return done


def toy_runner(sched, eos_bias: float = 1.0) -> FakeRunner:
    """Samples each beam's argmax, as the sampler does for a beam's greedy row (the runner keeps it); plain
    requests sample the FakeRunner's fixed token."""
    def token(r):
        return int(toy_logprobs(r.all_token_ids, eos_bias).argmax()) if r.sampling_params.logprobs else TOKEN

    return FakeRunner(sched, token_fn=token,
                      logprobs_fn=lambda r: dict(enumerate(toy_logprobs(r.all_token_ids, eos_bias).tolist())))


CASES = [(w, lp, es, bias) for w in (1, 2, 3, 4) for lp, es in ((1.0, False), (0.0, True), (2.0, "never"),
                                                                 (-1.0, False), (0.5, True), (1.5, False))
         for bias in (-1.0, 1.5)]


@pytest.mark.parametrize("width, length_penalty, early_stopping, eos_bias", CASES)
def test_beams_equal_transformers_loop(width, length_penalty, early_stopping, eos_bias):
    sched = make_scheduler(num_blocks=128, block_size=4)
    runner = toy_runner(sched, eos_bias)
    prompts = {f"p{i}": prompt_tokens(f"p{i}", 3 + 2 * i) for i in range(3)}
    prompts = {k: [t % VOCAB for t in v] for k, v in prompts.items()}
    params = BeamSearchParams(width, max_tokens=9, length_penalty=length_penalty, early_stopping=early_stopping)
    for request_id, prompt in prompts.items():
        start(sched, request_id, prompt, params)
    done = run(sched, runner)
    for request_id, prompt in prompts.items():
        want = hf_beam_search(prompt, width, 9, EOS, length_penalty, early_stopping, eos_bias)
        got = done[request_id].finished
        assert [f.token_ids for f in got] == [tokens for tokens, _ in want], request_id
        assert [f.score for f in got] == pytest.approx([score for _, score in want], rel=1e-5)
        for f in got:
            assert f.finish_reason == ("stop" if f.token_ids[-1] == EOS else "length")
            assert f.score == pytest.approx(f.cum_logprob / len(f.token_ids) ** length_penalty)


@pytest.mark.parametrize("width", [1, 3])
def test_ignore_eos_equals_transformers_without_an_eos(width):
    sched = make_scheduler(num_blocks=128, block_size=4)
    params = BeamSearchParams(width, max_tokens=7, ignore_eos=True)
    start(sched, "a", [5, 6, 7], params)
    got = run(sched, toy_runner(sched, eos_bias=3.0))["a"].finished
    want = hf_beam_search([5, 6, 7], width, 7, None, 1.0, False, 3.0)
    assert [f.token_ids for f in got] == [t for t, _ in want] and all(len(f.token_ids) == 7 for f in got)
    assert any(EOS in f.token_ids for f in got)  # EOS was generated, and did not end the beam


def test_beams_share_blocks_and_copy_only_where_they_part():
    """Width 4 over a 21-token prompt (5 full blocks of 4 and one partial): the beams hold the prompt's
    full blocks once; a step copies a shared partial block only for the extra forks of a parent (at
    most width - 1), and a pruned parent's blocks are not held past its step."""
    sched = make_scheduler(num_blocks=64, block_size=4)
    runner = toy_runner(sched, eos_bias=-5.0)  # no EOS: every beam runs to max_tokens
    start(sched, "a", [t % VOCAB for t in prompt_tokens("a", 21)], BeamSearchParams(4, max_tokens=10))
    copies = 0
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        assert len(out.blocks_to_copy) <= 3
        copies += len(out.blocks_to_copy)
        beams = sched.running
        assert set(sched.requests) == {r.request_id for r in beams}  # no parent outlives its step
        if not beams:
            continue
        tables = [sched.kv.block_ids(r.request_id) for r in beams]
        assert all(t[:5] == tables[0][:5] for t in tables)
        held = {b for t in tables for b in t}
        assert len(held) <= 5 + sum(len(t) - 5 for t in tables)
        assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks - len(held)  # nothing else held
    assert copies > 0
    sched.kv.assert_empty()


def test_a_beam_going_on_with_its_argmax_stays_the_same_request():
    """The best candidate of a step is its beam's argmax (no EOS here), which the runner has already appended:
    that beam goes on in place, a plain decode step (its blocks and its runner state kept), every step."""
    sched = make_scheduler(num_blocks=64, block_size=4)
    runner = toy_runner(sched, eos_bias=-5.0)
    search = start(sched, "a", [t % VOCAB for t in prompt_tokens("a", 9)], BeamSearchParams(3, max_tokens=8))
    out, _ = step(sched, runner)  # the prompt, then the first position's forks
    num_steps = 0
    while not search.done:
        before = set(out.num_scheduled_tokens)
        best = search.beams[0]
        assert best.request_id in before  # it went on in place
        out, _ = step(sched, runner)
        assert best.request_id in {c.req_id for c in out.scheduled_cached_reqs}
        assert len(out.scheduled_new_reqs) < 3
        num_steps += 1
    assert num_steps == 7
    sched.kv.assert_empty()


def test_finished_and_pruned_beams_free_their_blocks_at_once():
    sched = make_scheduler(num_blocks=64, block_size=4)
    runner = toy_runner(sched, eos_bias=2.0)
    search = start(sched, "a", [3, 4, 5, 6, 7, 8, 9], BeamSearchParams(3, max_tokens=12))
    while sched.has_unfinished_requests():
        step(sched, runner)
        live = set(sched.kv.req_blocks)
        assert live == {b.request_id for b in search.beams} or search.done
        assert set(sched.requests) == live
    assert search.done and len(search.finished) == 3
    sched.kv.assert_empty()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_does_not_change_the_beams(mode):
    """A pool too small for every beam: beams are preempted (and recomputed or swapped) mid-search, and
    the result equals the roomy run's."""
    params = BeamSearchParams(4, max_tokens=12, length_penalty=0.5)
    results = []
    for num_blocks in (128, 14):
        sched = make_scheduler(num_blocks=num_blocks, block_size=4, preemption_mode=mode,
                               num_cpu_blocks=64 if mode == "swap" else 0)
        for i in range(3):
            start(sched, f"r{i}", [t % VOCAB for t in prompt_tokens(f"r{i}", 9)], params)
        done = run(sched, toy_runner(sched, eos_bias=0.0))
        results.append({k: [(f.token_ids, f.score) for f in s.finished] for k, s in done.items()})
        if num_blocks == 14:
            assert sched.num_preemptions > 0
    assert results[0] == results[1]


def test_abort_frees_every_beam():
    sched = make_scheduler(num_blocks=64, block_size=4)
    runner = toy_runner(sched)
    start(sched, "a", [1, 3, 5, 7, 9], BeamSearchParams(4, max_tokens=20))
    for _ in range(4):
        step(sched, runner)
    assert len(sched.running) == 4
    sched.finish_beam_search("a")
    assert not sched.requests and not sched.beam_searches
    step(sched, runner)  # the runner is told to drop them
    sched.kv.assert_empty()
    assert not sched.take_finished_beam_searches()


def test_beams_and_plain_requests_share_steps():
    """Plain requests keep decoding beside a beam search; both give what they give alone."""
    from tests.core.utils import add

    alone = make_scheduler(num_blocks=128, block_size=4)
    start(alone, "b", [2, 4, 6, 8], BeamSearchParams(3, max_tokens=8))
    want = run(alone, toy_runner(alone))["b"].finished
    sched = make_scheduler(num_blocks=128, block_size=4, budget=6)
    plain = add(sched, "plain", 10, max_tokens=15)
    start(sched, "b", [2, 4, 6, 8], BeamSearchParams(3, max_tokens=8))
    got = run(sched, toy_runner(sched))["b"].finished
    assert got == want
    assert plain.is_finished and len(plain.output_token_ids) == 15


def test_a_lost_copy_on_write_is_caught():
    """The checks above can fail: with the step's copy-on-write copies dropped, a fork attends to KV its
    parent's other forks overwrote, and the fake runner reports it."""
    sched = make_scheduler(num_blocks=64, block_size=4)
    take_copies = sched.kv.take_copies
    sched.kv.take_copies = lambda: take_copies() and []
    start(sched, "a", [t % VOCAB for t in prompt_tokens("a", 9)], BeamSearchParams(4, max_tokens=6))
    with pytest.raises(AssertionError, match="wrong KV at position"):
        run(sched, toy_runner(sched, eos_bias=-5.0))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("searches, prompt_len, num_blocks, budget, caching", [
    (1, 3, 7, 64, True), (2, 8, 10, 64, True), (2, 8, 16, 64, True), (1, 8, 8, 4, False)])
def test_beams_that_reported_do_not_starve_their_search(mode, searches, prompt_len, num_blocks, budget,
                                                        caching):
    """A pool that holds one beam but not all of them at once: a beam that has reported waits for the rest of
    its search while holding its blocks, and the rest may be preempted for want of those very blocks (or, in
    chunks, preempt themselves). The search must still end (an empty step with requests pending stops the
    engine, an endless one hangs it), with the roomy run's beams."""
    params = BeamSearchParams(4 if budget > 4 else 3, max_tokens=8)
    prompts = {f"s{i}": [t % VOCAB for t in prompt_tokens(f"s{i}", prompt_len)] for i in range(searches)}
    results = []
    for blocks in (128, num_blocks):
        sched = make_scheduler(num_blocks=blocks, block_size=4, budget=budget, preemption_mode=mode,
                               num_cpu_blocks=32 if mode == "swap" else 0, enable_prefix_caching=caching)
        for request_id, prompt in prompts.items():
            start(sched, request_id, prompt, params)
        runner = toy_runner(sched, eos_bias=-5.0)
        done = {}
        for _ in range(300):
            if not sched.has_unfinished_requests():
                break
            out, _ = step(sched, runner)
            assert not out.is_empty, "nothing scheduled while beams wait: the search can never end"
            done.update((s.request_id, s) for s in sched.take_finished_beam_searches())
        else:
            raise AssertionError("the search did not end")
        sched.kv.assert_empty()
        results.append({k: [(f.token_ids, f.score) for f in s.finished] for k, s in done.items()})
    assert sched.num_preemptions > 0
    assert results[0] == results[1] and len(results[0]) == searches
