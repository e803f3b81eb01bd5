"""Scheduler: admission, chunked prefill, preemption (recompute and swap), n > 1 forks, aborts,
stop conditions and prefix-cache hits, driven through schedule -> FakeRunner -> update_from_output."""

from __future__ import annotations

import random
import zlib

import pytest

from fastllm.core.scheduler_output import CachedRequestData, ModelRunnerOutput
from fastllm.engine.request import Request, RequestStatus
from tests.core.utils import (EOS, TOKEN, FakeRunner, add, make_request, make_scheduler, prompt_tokens,
                              run_to_completion, scheduled, step)


def new_blocks(out) -> dict[str, list[int]]:
    return {r.req_id: r.block_ids for r in out.scheduled_new_reqs}


def cached(out) -> dict[str, CachedRequestData]:
    return {r.req_id: r for r in out.scheduled_cached_reqs}


# admission


def test_fcfs_admission_under_max_num_seqs():
    sched = make_scheduler(num_blocks=64, budget=64, max_num_seqs=2)
    runner = FakeRunner(sched)
    a, b, c = (add(sched, r, 5, max_tokens=3) for r in "abc")
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 5, "b": 5}
    assert new_blocks(out) == {"a": [1, 2], "b": [3, 4]}
    assert [r.request_id for r in sched.waiting] == ["c"] and c.status == RequestStatus.WAITING
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1, "b": 1}
    assert cached(out) == {"a": CachedRequestData("a", 5, []), "b": CachedRequestData("b", 5, [])}
    out, updated = step(sched, runner)
    assert scheduled(out) == {"a": 1, "b": 1}
    assert updated == [a, b] and a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == b.output_token_ids == [TOKEN] * 3
    out, _ = step(sched, runner)
    assert scheduled(out) == {"c": 5}
    assert out.finished_req_ids == {"a", "b"}
    # Freed tail first after the never-used blocks: c takes 5 and 6.
    assert new_blocks(out) == {"c": [5, 6]}
    run_to_completion(sched, runner)


def test_fcfs_admission_under_the_token_budget_chunks_the_last_one():
    sched = make_scheduler(budget=10)
    runner = FakeRunner(sched)
    for r, n in (("a", 6), ("b", 6), ("c", 3)):
        add(sched, r, n, max_tokens=2)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 6, "b": 4}
    assert out.total_num_scheduled_tokens == 10
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1, "b": 2, "c": 3}
    run_to_completion(sched, runner)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits_in():
    sched = make_scheduler(budget=10, enable_chunked_prefill=False)
    runner = FakeRunner(sched)
    for r, n in (("a", 6), ("b", 6), ("c", 3)):
        add(sched, r, n, max_tokens=2)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 6}  # b does not fit; c (which would) waits behind it: FCFS
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1, "b": 6, "c": 3}
    run_to_completion(sched, runner)


# chunked prefill


def test_chunked_prefill_alone():
    sched = make_scheduler(budget=16)
    runner = FakeRunner(sched)
    add(sched, "d", 40, max_tokens=2)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"d": 16} and new_blocks(out) == {"d": [1, 2, 3, 4]}
    out, _ = step(sched, runner)
    assert scheduled(out) == {"d": 16} and cached(out)["d"] == CachedRequestData("d", 16, [5, 6, 7, 8])
    out, updated = step(sched, runner)
    assert scheduled(out) == {"d": 8} and cached(out)["d"] == CachedRequestData("d", 32, [9, 10])
    assert [r.request_id for r in updated] == ["d"]  # the first token comes with the last chunk
    out, _ = step(sched, runner)
    assert scheduled(out) == {"d": 1} and cached(out)["d"] == CachedRequestData("d", 40, [11])
    run_to_completion(sched, runner)


@pytest.mark.parametrize("budget, chunks", [(17, [16, 16, 8]), (16, [15, 15, 10])])
def test_chunked_prefill_keeps_decodes_flowing(budget, chunks):
    sched = make_scheduler(budget=budget)
    runner = FakeRunner(sched)
    add(sched, "a", 4, max_tokens=20)
    assert scheduled(step(sched, runner)[0]) == {"a": 4}
    add(sched, "d", 40, max_tokens=2)
    got = []
    for _ in range(3):
        out, updated = step(sched, runner)
        assert list(out.num_scheduled_tokens) == ["a", "d"]  # the decode comes before the chunk
        assert out.num_scheduled_tokens["a"] == 1
        got.append(out.num_scheduled_tokens["d"])
        assert {r.request_id for r in updated} == ({"a", "d"} if len(got) == 3 else {"a"})
    assert got == chunks
    assert scheduled(step(sched, runner)[0]) == {"a": 1, "d": 1}
    run_to_completion(sched, runner)


# preemption


def preemption_setup(**kw):
    """6 usable blocks; a and b (7-token prompts, 10 new tokens) need 4 blocks each from step 7 on.
    c waits behind them (max_num_seqs=2)."""
    sched = make_scheduler(num_blocks=7, budget=64, max_num_seqs=2, **kw)
    runner = FakeRunner(sched)
    a, b = add(sched, "a", 7, max_tokens=10), add(sched, "b", 7, max_tokens=10)
    c = add(sched, "c", 3, max_tokens=1)
    out, _ = step(sched, runner)
    assert new_blocks(out) == {"a": [1, 2], "b": [3, 4]}
    for i in range(2, 7):  # positions 7..11; position 8 takes blocks 5 and 6
        out, _ = step(sched, runner)
        assert scheduled(out) == {"a": 1, "b": 1}
        assert cached(out) == {"a": CachedRequestData("a", 5 + i, [5] if i == 3 else []),
                               "b": CachedRequestData("b", 5 + i, [6] if i == 3 else [])}
    assert sched.kv.num_free_blocks == 0
    return sched, runner, a, b, c


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preemption_by_recompute(enable_prefix_caching):
    sched, runner, a, b, c = preemption_setup(enable_prefix_caching=enable_prefix_caching)
    # Step 7: a's position 12 needs a fifth block: b, the newest, is preempted; a gets b's last block.
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1}
    assert cached(out) == {"a": CachedRequestData("a", 12, [6])}
    assert out.blocks_to_swap_out == [] and out.finished_req_ids == set()
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # the front of the queue
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.kv.block_ids("a") == [1, 2, 5, 6] and "b" not in sched.kv.req_blocks
    assert list(sched.kv.pool.free_queue) == [4, 3]
    # b (13 tokens, 4 blocks) does not fit in 2; c waits behind it.
    for _ in range(3):
        out, _ = step(sched, runner)
        assert scheduled(out) == {"a": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 10
    # Step 11: b is resumed; the runner already knows it, so it gets cached data with the whole table.
    out, _ = step(sched, runner)
    assert out.scheduled_new_reqs[0].req_id == "c"
    assert out.finished_req_ids == {"a"}
    if enable_prefix_caching:  # its first two blocks were still cached; the third was evicted by a
        assert scheduled(out) == {"b": 5, "c": 3}
        assert cached(out) == {"b": CachedRequestData("b", 8, [], [3, 4, 6, 5])}
    else:
        assert scheduled(out) == {"b": 13, "c": 3}
        assert cached(out) == {"b": CachedRequestData("b", 0, [], [4, 3, 6, 5])}
    assert new_blocks(out) == {"c": [2]}
    assert b.num_output_tokens == 7  # resuming sampled its next token
    outs = run_to_completion(sched, runner)
    assert len(outs) == 3
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.num_output_tokens == 10 and b.num_tokens == a.num_tokens
    assert sched.num_preemptions == 1


def test_num_cached_tokens_is_set_at_first_admission():
    sched, runner, a, b, c = preemption_setup(enable_prefix_caching=True)
    for _ in range(5):
        step(sched, runner)  # b is preempted at step 7 and resumed at step 11 with 8 tokens cached
    assert b.num_preemptions == 1 and b.num_computed_tokens == 13
    assert b.num_cached_tokens == 0  # documented: prompt tokens found in the prefix cache at admission


def test_preemption_by_swap():
    sched, runner, a, b, c = preemption_setup(preemption_mode="swap", num_cpu_blocks=8,
                                              enable_prefix_caching=False)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1}
    assert out.blocks_to_swap_out == [(3, 0), (4, 1), (6, 2)]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 12
    assert list(sched.swapped) == [b] and [r.request_id for r in sched.waiting] == ["c"]
    assert sched.kv.block_ids("a") == [1, 2, 5, 6]
    assert sched.kv.cpu_pool.num_free_blocks == 5
    # Two GPU blocks are free, c needs one, but swapped requests come back first.
    for _ in range(3):
        out, _ = step(sched, runner)
        assert scheduled(out) == {"a": 1}
        assert out.blocks_to_swap_in == [] and out.scheduled_new_reqs == []
        assert c.status == RequestStatus.WAITING
    assert a.is_finished
    out, _ = step(sched, runner)
    assert out.blocks_to_swap_in == [(0, 4), (1, 3), (2, 6)]
    assert scheduled(out) == {"b": 1, "c": 3}
    assert cached(out) == {"b": CachedRequestData("b", 12, [], [4, 3, 6, 5])}
    assert new_blocks(out) == {"c": [2]}
    assert b.status == RequestStatus.RUNNING
    assert sched.kv.cpu_pool.num_free_blocks == 8
    run_to_completion(sched, runner)
    assert b.num_output_tokens == 10 and b.num_preemptions == 1


def test_swapped_requests_come_back_oldest_first():
    sched = make_scheduler(num_blocks=7, budget=64, max_num_seqs=3, preemption_mode="swap", num_cpu_blocks=16,
                           enable_prefix_caching=False)  # 6 usable
    runner = FakeRunner(sched)
    a, b, c = (add(sched, r, 7, max_tokens=m) for r, m in (("a", 8), ("b", 16), ("c", 16)))  # b, c: 6 blocks
    step(sched, runner)
    step(sched, runner)
    out, _ = step(sched, runner)  # position 8 for all three: c is swapped out, a and b grow
    assert scheduled(out) == {"a": 1, "b": 1}
    assert out.blocks_to_swap_out == [(5, 0), (6, 1)]
    for _ in range(3):
        out, _ = step(sched, runner)
        assert scheduled(out) == {"a": 1, "b": 1}
    out, _ = step(sched, runner)  # position 12: b is swapped out too, ahead of c
    assert scheduled(out) == {"a": 1}
    assert list(sched.swapped) == [b, c]
    while not a.is_finished:
        out, _ = step(sched, runner)
    out, _ = step(sched, runner)
    assert list(out.num_scheduled_tokens) == ["b"] and list(sched.swapped) == [c]
    run_to_completion(sched, runner)
    assert [r.num_output_tokens for r in (a, b, c)] == [8, 16, 16]


@pytest.mark.parametrize("num_cpu_blocks", [0, 2])
def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_too_small(num_cpu_blocks):
    sched, runner, a, b, c = preemption_setup(preemption_mode="swap", num_cpu_blocks=num_cpu_blocks,
                                              enable_prefix_caching=False)
    out, _ = step(sched, runner)
    assert out.blocks_to_swap_out == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.swapped) == [] and [r.request_id for r in sched.waiting] == ["b", "c"]
    run_to_completion(sched, runner)
    assert b.num_output_tokens == 10


def test_preemption_picks_the_newest():
    sched = make_scheduler(num_blocks=9, budget=64)  # 8 usable
    runner = FakeRunner(sched)
    a = add(sched, "a", 16, max_tokens=17)  # 4 blocks; grows by one block every 4 tokens
    b = add(sched, "b", 7, max_tokens=20)  # 2 blocks
    c = add(sched, "c", 7, max_tokens=20)  # 2 blocks
    out, _ = step(sched, runner)
    assert new_blocks(out) == {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8]}
    out, _ = step(sched, runner)  # a's position 16 needs a fifth block: c goes, not b
    assert scheduled(out) == {"a": 1, "b": 1}
    assert c.status == RequestStatus.PREEMPTED and b.status == RequestStatus.RUNNING
    assert sched.kv.block_ids("a") == [1, 2, 3, 4, 8]
    run_to_completion(sched, runner)
    assert [r.num_output_tokens for r in (a, b, c)] == [17, 20, 20]


def test_a_request_can_preempt_itself():
    """When the newest running request is the one that needs a block, it preempts itself."""
    sched = make_scheduler(num_blocks=5, budget=64)  # 4 usable
    runner = FakeRunner(sched)
    a = add(sched, "a", 7, max_tokens=4)  # 2 blocks
    b = add(sched, "b", 8, max_tokens=4)  # 2 blocks, a third at position 8
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 7, "b": 8}
    out, _ = step(sched, runner)  # a: position 7 (no new block); b: position 8, no block left
    assert scheduled(out) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and list(sched.waiting) == [b]
    assert list(sched.kv.pool.free_queue) == [4, 3]
    run_to_completion(sched, runner)
    assert a.num_output_tokens == b.num_output_tokens == 4


# n > 1


@pytest.mark.parametrize("prompt_len, copies, child_tables", [
    (10, [(3, 5), (3, 6)], {"c1": [1, 2, 5], "c2": [1, 2, 6]}),  # 9 % 4 != 0: the last prompt block is copied
    (9, [], {"c1": [1, 2, 5], "c2": [1, 2, 6]}),  # 9 - 1 = 8: the last prompt token starts a new block
])
def test_n_siblings_fork_after_the_parent_prompt(prompt_len, copies, child_tables):
    sched = make_scheduler(num_blocks=32, budget=4)
    runner = FakeRunner(sched)
    tokens = prompt_tokens("shared", prompt_len)
    p = add(sched, "p", tokens, max_tokens=3)
    c1 = add(sched, "c1", tokens, max_tokens=3, fork_of=p)
    c2 = add(sched, "c2", tokens, max_tokens=3, fork_of=p)
    x = add(sched, "x", 2, max_tokens=1)
    # The prompt is computed in chunks of 4; the siblings wait (x, behind them, does not).
    chunks = []
    while p.num_computed_tokens < prompt_len:
        out, _ = step(sched, runner)
        chunks.append(scheduled(out))
        assert c1.status == c2.status == RequestStatus.WAITING
    if prompt_len == 10:
        assert chunks == [{"p": 4}, {"p": 4}, {"p": 2, "x": 2}]
    else:
        assert chunks == [{"p": 4}, {"p": 4}, {"p": 1, "x": 2}]
    assert sched.kv.block_ids("p") == [1, 2, 3]
    assert x.is_finished and list(sched.waiting) == [c1, c2]
    out, _ = step(sched, runner)
    assert scheduled(out) == {"p": 1, "c1": 1, "c2": 1}  # each sibling computes the last prompt token
    assert out.blocks_to_copy == copies
    assert new_blocks(out) == child_tables
    assert {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs} == {"c1": prompt_len - 1,
                                                                                 "c2": prompt_len - 1}
    assert all(r.output_token_ids == [] for r in out.scheduled_new_reqs)
    assert c1.num_cached_tokens == c2.num_cached_tokens == prompt_len - 1
    pool = sched.kv.pool
    assert [pool.blocks[i].ref_cnt for i in (1, 2)] == [3, 3]
    assert [pool.blocks[i].ref_cnt for i in (3, 4, 5, 6)] == [1, 0, 1, 1]  # x had block 4
    assert c1.num_output_tokens == c2.num_output_tokens == 1
    run_to_completion(sched, runner)
    assert [r.num_output_tokens for r in (p, c1, c2, x)] == [3, 3, 3, 1]


def test_waiting_siblings_keep_their_place_in_the_queue():
    sched = make_scheduler(num_blocks=32, budget=4)
    runner = FakeRunner(sched)
    tokens = prompt_tokens("shared", 10)
    p = add(sched, "p", tokens, max_tokens=3)
    c1 = add(sched, "c1", tokens, max_tokens=3, fork_of=p)
    c2 = add(sched, "c2", tokens, max_tokens=3, fork_of=p)
    add(sched, "x", 2, max_tokens=1)
    y = add(sched, "y", 4, max_tokens=1)
    assert [scheduled(step(sched, runner)[0]) for _ in range(3)] == [{"p": 4}, {"p": 4}, {"p": 2, "x": 2}]
    assert list(sched.waiting) == [c1, c2, y]
    out, _ = step(sched, runner)
    assert scheduled(out) == {"p": 1, "c1": 1, "c2": 1, "y": 1}
    run_to_completion(sched, runner)


def test_sibling_of_an_aborted_parent_computes_its_own_prompt():
    sched = make_scheduler(num_blocks=32, budget=4)
    runner = FakeRunner(sched)
    tokens = prompt_tokens("shared", 10)
    p = add(sched, "p", tokens, max_tokens=3)
    c = add(sched, "c", tokens, max_tokens=3, fork_of=p)
    step(sched, runner)
    sched.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"p"}
    # p's first (full, cached) block is a prefix hit for c.
    assert scheduled(out) == {"c": 4} and c.num_cached_tokens == 4
    run_to_completion(sched, runner)
    assert c.num_output_tokens == 3


def test_preempted_sibling_forks_again_with_its_outputs():
    """A sibling preempted by recompute has output tokens: it forks again from the running parent,
    sharing the prompt blocks, and recomputes its last prompt token and its outputs."""
    sched = make_scheduler(num_blocks=9, budget=64, enable_prefix_caching=False)  # 8 usable
    runner = FakeRunner(sched)
    tokens = prompt_tokens("shared", 6)
    p = add(sched, "p", tokens, max_tokens=12)
    hog = add(sched, "hog", 16, max_tokens=4)
    c = add(sched, "c", tokens, max_tokens=12, fork_of=p)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"p": 6, "hog": 16}
    out, _ = step(sched, runner)
    assert scheduled(out) == {"p": 1, "hog": 1, "c": 1}
    assert out.blocks_to_copy == [(2, 8)] and new_blocks(out) == {"c": [1, 8]}
    step(sched, runner)
    out, _ = step(sched, runner)  # p's position 8 needs a block: c, the newest, is preempted
    assert c.status == RequestStatus.PREEMPTED and c.num_output_tokens == 2
    assert sched.kv.block_ids("p") == [1, 2, 8]
    assert hog.status == RequestStatus.FINISHED_LENGTH
    out, _ = step(sched, runner)
    assert scheduled(out) == {"p": 1, "c": 3}
    # Forked again: computed = prompt - 1, and it recomputes that token plus its outputs.
    assert cached(out)["c"].num_computed_tokens == 5
    assert out.num_scheduled_tokens["c"] == c.num_tokens - 1 - 5
    assert cached(out)["c"].block_ids == [1, 7]
    assert out.blocks_to_copy == [(2, 7)]
    run_to_completion(sched, runner)
    assert [r.num_output_tokens for r in (p, c, hog)] == [12, 12, 4]


# aborts


def test_abort_from_waiting_running_and_swapped_frees_everything():
    sched, runner, a, b, c = preemption_setup(preemption_mode="swap", num_cpu_blocks=8)
    step(sched, runner)
    assert [r.status.name for r in (a, b, c)] == ["RUNNING", "SWAPPED", "WAITING"]
    sched.finish_requests(["a", "b", "c", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in (a, b, c))
    assert not sched.running and not sched.waiting and not sched.swapped and not sched.requests
    assert not sched.has_unfinished_requests()
    sched.kv.assert_empty()
    assert sched.kv.cpu_pool.num_free_blocks == 8
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == {"a", "b"}  # the runner never saw c
    assert sched.schedule().finished_req_ids == set()
    # Finishing again is a no-op.
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert a.status == RequestStatus.FINISHED_ABORTED


def test_abort_of_a_preempted_request():
    sched, runner, a, b, c = preemption_setup()
    step(sched, runner)
    assert b.status == RequestStatus.PREEMPTED
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert sched.schedule().finished_req_ids == {"b"}


def test_output_of_a_request_aborted_mid_step_is_dropped():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    a = add(sched, "a", 5)
    out = sched.schedule()
    runner_output = runner.execute(out)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, runner_output) == []
    assert a.num_output_tokens == 0 and a.status == RequestStatus.FINISHED_ABORTED
    sched.kv.assert_empty()


# stop conditions


def scripted(tokens: dict[str, list[int]]):
    """token_fn that emits each request's script in order."""
    return lambda request: tokens[request.request_id][request.num_output_tokens]


def finish(max_model_len=1024, script=(), **kw):
    sched = make_scheduler(max_model_len=max_model_len)
    runner = FakeRunner(sched, scripted({"r": list(script)}) if script else None)
    r = add(sched, "r", kw.pop("prompt", 5), **kw)
    run_to_completion(sched, runner)
    return r


def test_stop_on_eos():
    r = finish(script=[5, EOS, 6], max_tokens=10)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5, EOS]
    assert r.stop_reason is None and r.status.finish_reason == "stop"


def test_ignore_eos():
    r = finish(script=[EOS] * 3, max_tokens=3, ignore_eos=True)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [EOS] * 3


def test_no_eos_token_id_never_stops_on_eos():
    sched = make_scheduler()
    runner = FakeRunner(sched, lambda request: EOS)
    r = make_request("r", 5, 3, eos_token_id=None)
    sched.add_request(r)
    run_to_completion(sched, runner)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3


def test_stop_token_ids_set_the_stop_reason():
    r = finish(script=[5, 9, 6], max_tokens=10, stop_token_ids=[9, 11])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5, 9] and r.stop_reason == 9


def test_min_tokens_suppresses_eos_and_stop_tokens():
    r = finish(script=[EOS, 9, EOS, 5], max_tokens=10, min_tokens=3, stop_token_ids=[9])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [EOS, 9, EOS]
    assert r.stop_reason is None


def test_min_tokens_does_not_outlast_max_tokens():
    r = finish(script=[EOS] * 4, max_tokens=4, min_tokens=4)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.num_output_tokens == 4


def test_max_tokens_finishes_with_length():
    r = finish(max_tokens=6)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 6
    assert r.status.finish_reason == "length"


def test_max_model_len_finishes_with_length():
    r = finish(max_model_len=10, prompt=8, max_tokens=100)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 10 and r.num_output_tokens == 2


def test_update_ignores_no_tokens_and_unknown_and_refuses_a_second_apply():
    sched = make_scheduler(budget=4)
    a = add(sched, "a", 6)
    out = sched.schedule()
    assert scheduled(out) == {"a": 4}
    assert sched.update_from_output(out, ModelRunnerOutput(["a", "zzz"], [[], [5]])) == []
    assert a.num_output_tokens == 0
    with pytest.raises(ValueError, match="already applied"):
        sched.update_from_output(out, ModelRunnerOutput(["a"], [[]]))


# prefix caching at admission


def test_prefix_cache_hit_at_admission():
    sched = make_scheduler(num_blocks=16, budget=64)
    runner = FakeRunner(sched)
    tokens = prompt_tokens("shared", 12)
    a = add(sched, "a", tokens, max_tokens=1)
    run_to_completion(sched, runner)
    assert a.num_cached_tokens == 0
    assert list(sched.kv.pool.free_queue)[-3:] == [3, 2, 1]
    b = add(sched, "b", tokens + [5, 6, 7], max_tokens=2)  # all three blocks hit
    c = add(sched, "c", tokens, max_tokens=2)  # the block with its last token is recomputed
    out, _ = step(sched, runner)
    assert scheduled(out) == {"b": 3, "c": 4}
    assert new_blocks(out) == {"b": [1, 2, 3, 4], "c": [1, 2, 5]}
    assert {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs} == {"b": 12, "c": 8}
    assert (b.num_cached_tokens, c.num_cached_tokens) == (12, 8)
    stats = sched.kv.pool.stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 12 + 15 + 12, 12 + 8)
    run_to_completion(sched, runner)


def test_prefix_cache_disabled_computes_everything():
    sched = make_scheduler(num_blocks=16, budget=64, enable_prefix_caching=False)
    runner = FakeRunner(sched)
    tokens = prompt_tokens("shared", 12)
    add(sched, "a", tokens, max_tokens=1)
    run_to_completion(sched, runner)
    b = add(sched, "b", tokens + [5], max_tokens=1)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"b": 13} and b.num_cached_tokens == 0


def test_same_step_hit_on_blocks_being_computed():
    """b is admitted in the step that computes a's prompt and hits a's blocks right away: the
    runner writes every new KV before any attention reads it, so the hit is safe."""
    sched = make_scheduler(num_blocks=16, budget=64)
    runner = FakeRunner(sched)
    tokens = prompt_tokens("shared", 9)
    add(sched, "a", tokens, max_tokens=2)
    add(sched, "b", tokens[:8] + [5], max_tokens=2)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 9, "b": 1}
    assert new_blocks(out) == {"a": [1, 2, 3], "b": [1, 2, 4]}
    run_to_completion(sched, runner)



def test_a_failed_step_leaves_no_prefix_cache_hits_on_the_blocks_it_filled():
    """A step that raised may not have written the KV of the blocks its schedule registered (a launch failure
    writes none): a later request with the same prompt computes them instead of hitting them. Blocks that
    earlier steps filled stay hits."""
    sched = make_scheduler(num_blocks=16)
    runner = FakeRunner(sched)
    tokens = prompt_tokens("shared", 13)
    add(sched, "a", tokens, max_tokens=4)
    failed, _ = sched.fail_step(sched.schedule())  # a's prompt (blocks 1-3 full) never ran
    assert [r.request_id for r in failed] == ["a"] and failed[0].status == RequestStatus.FINISHED_ERROR
    b = add(sched, "b", tokens, max_tokens=4)
    step(sched, runner)  # the fake runner reads every position b attends to
    assert b.num_cached_tokens == 0
    for _ in range(2):
        step(sched, runner)
    assert b.num_tokens == 16
    sched.fail_step(sched.schedule())  # it would have computed position 15, which fills block 4
    c = add(sched, "c", tokens + b.output_token_ids + [5], max_tokens=2)
    run_to_completion(sched, runner)
    assert c.num_cached_tokens == 12, "the prompt's blocks were filled by a step that ran"


# soak


def soak_token(request_id: str, num_tokens: int) -> int:
    """Deterministic and varied: sometimes EOS, sometimes 9 (a stop token for some requests)."""
    h = zlib.crc32(f"{request_id}:{num_tokens}".encode())
    return EOS if h % 17 == 0 else 9 if h % 23 == 0 else 10 + h % 50


WEAK_HASHES = {
    "sha256": None,
    "constant": lambda parent, tokens, extra: b"x",
    "tokens_only": lambda parent, tokens, extra: bytes(str(list(tokens)), "ascii"),
}


@pytest.mark.parametrize("mode, num_cpu_blocks", [("recompute", 0), ("swap", 12), ("swap", 3)])
@pytest.mark.parametrize("caching, hash_name", [(True, "sha256"), (False, "sha256"), (True, "tokens_only"),
                                                (True, "constant")])
@pytest.mark.parametrize("seed", [0, 1])
def test_soak(mode, num_cpu_blocks, caching, hash_name, seed):
    rng = random.Random(seed)
    kw = {} if WEAK_HASHES[hash_name] is None else {"hash_fn": WEAK_HASHES[hash_name]}
    sched = make_scheduler(num_blocks=17, block_size=4, budget=16, max_num_seqs=6, preemption_mode=mode,
                           enable_prefix_caching=caching, num_cpu_blocks=num_cpu_blocks, max_model_len=48,
                           **kw)
    runner = FakeRunner(sched, lambda r: soak_token(r.request_id, r.num_tokens))
    prefixes = [prompt_tokens(f"prefix{i}", 12) for i in range(3)]
    words = [prompt_tokens(f"word{i}", 4) for i in range(3)]
    added: dict[str, Request] = {}
    finished: dict[str, RequestStatus] = {}
    swap_outs = 0

    def new_request(i):
        n = rng.randint(1, 30)
        if rng.random() < 0.3:  # the same blocks in other orders: parents differ, blocks repeat
            tokens = [t for _ in range(8) for t in rng.choice(words)][:n]
        else:
            tokens = (rng.choice(prefixes)[:rng.randint(0, 12)] + prompt_tokens(f"r{i}", n))[:30]
        params = dict(max_tokens=rng.randint(1, 20))
        if rng.random() < 0.3:
            params["stop_token_ids"] = [9]
        if rng.random() < 0.2:
            params["ignore_eos"] = True
        if rng.random() < 0.2:
            params["min_tokens"] = rng.randint(0, params["max_tokens"])
        siblings = rng.choice([1, 1, 1, 2, 3])
        first = None
        for j in range(siblings):
            r = add(sched, f"r{i}.{j}", tokens, fork_of=first, **params)
            first = first or r
            added[r.request_id] = r

    def record(request):
        assert request.request_id not in finished, f"{request.request_id} finished twice"
        assert request.is_finished
        finished[request.request_id] = request.status

    for i in range(1000):
        if i < 200:
            if rng.random() < 0.35:
                new_request(i)
            live = [r for r in added.values() if not r.is_finished]
            if live and rng.random() < 0.04:
                victim = rng.choice(live)
                sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
                record(victim)
        elif not sched.has_unfinished_requests():
            break
        out, updated = step(sched, runner)
        swap_outs += bool(out.blocks_to_swap_out)
        if out.is_empty and sched.has_unfinished_requests():
            assert out.blocks_to_swap_out or out.finished_req_ids, "no progress"
        for r in updated:
            if r.is_finished:
                record(r)
        # No request is lost: each live one is in exactly one queue, in the matching state.
        queues = [r.request_id for r in [*sched.waiting, *sched.running, *sched.swapped]]
        live = sorted(r.request_id for r in added.values() if not r.is_finished)
        assert sorted(queues) == live == sorted(sched.requests)
        assert all(r.status == RequestStatus.RUNNING for r in sched.running)
        assert all(r.status == RequestStatus.SWAPPED for r in sched.swapped)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in sched.waiting)
        assert len(sched.running) <= 6
    else:
        raise AssertionError("the soak did not drain")

    sched.kv.assert_empty()
    assert sorted(finished) == sorted(added)
    for r in added.values():
        assert finished[r.request_id] == r.status
        params = r.sampling_params
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens or r.num_tokens == 48
        elif r.status == RequestStatus.FINISHED_STOPPED:
            last = r.output_token_ids[-1]
            assert (last == EOS and not params.ignore_eos) or last in params.stop_token_ids
            assert r.num_output_tokens >= params.min_tokens
        assert r.num_output_tokens <= r.max_tokens
        # Tokens depend only on the request and position: preemption never changes them.
        assert r.output_token_ids == [soak_token(r.request_id, r.num_prompt_tokens + k)
                                      for k in range(r.num_output_tokens)]
    assert sched.num_preemptions > 0
    if mode == "swap" and num_cpu_blocks >= 12:
        assert swap_outs > 0


# the oracle can fail


def test_fake_runner_catches_a_missed_copy_on_write():
    sched = make_scheduler(num_blocks=32, budget=64)
    runner = FakeRunner(sched)
    tokens = prompt_tokens("shared", 10)
    p = add(sched, "p", tokens, max_tokens=3)
    add(sched, "c", tokens, max_tokens=3, fork_of=p)
    step(sched, runner)
    out = sched.schedule()
    assert out.blocks_to_copy == [(3, 4)]
    out.blocks_to_copy = []
    with pytest.raises(AssertionError, match=r"c: wrong KV at position 8 \(block 4\)"):
        runner.execute(out)


def test_fake_runner_catches_a_missed_swap_in_and_a_wrong_diff():
    sched, runner, a, b, c = preemption_setup(preemption_mode="swap", num_cpu_blocks=8,
                                              enable_prefix_caching=False)
    while not a.is_finished:
        step(sched, runner)
    out = sched.schedule()
    assert out.blocks_to_swap_in == [(0, 4), (1, 3), (2, 6)]
    out.blocks_to_swap_in = out.blocks_to_swap_in[1:]
    with pytest.raises(AssertionError, match="b: wrong KV at position 0"):
        FakeRunner.execute(runner, out)

    sched = make_scheduler(budget=16)
    runner = FakeRunner(sched)
    add(sched, "d", 40, max_tokens=2)
    step(sched, runner)
    out = sched.schedule()
    out.scheduled_cached_reqs[0].new_block_ids.pop()
    with pytest.raises(AssertionError, match=r"d: runner table \[1, 2, 3, 4, 5, 6, 7\] != scheduler's"):
        runner.execute(out)


# code hygiene


def test_no_side_effects_inside_asserts():
    """python -O strips asserts: an assert in fastllm/core may only call pure functions."""
    import ast
    import pathlib

    import fastllm.core

    pure = {"len", "sum", "sorted", "list", "tuple", "set", "all", "any", "isinstance", "min", "max", "bool",
            "get", "block_ids", "items", "values", "keys"}
    bad = []
    for path in sorted(pathlib.Path(fastllm.core.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert):
                for call in (n for n in ast.walk(node.test) if isinstance(n, ast.Call)):
                    func = call.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "?")
                    if name not in pure:
                        bad.append(f"{path.name}:{node.lineno} calls {name}()")
    assert bad == []
