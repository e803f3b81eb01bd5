"""Sliding-window KV: blocks wholly behind every layer's window go back to the pool while the request runs.

The row at position p reads keys p - window < k <= p, so once a request's next query is at
num_computed_tokens, a block ending at or before num_computed_tokens - window is never read again. Exact
block ids and ref counts for the manager; the fake runner's KV signatures (tests/core/utils.py) for whole
schedules, which now check every position a query can still read and nothing before it.
"""

from __future__ import annotations

import random

import pytest

from fastllm.core.block_pool import NULL_BLOCK_ID
from fastllm.core.kv_cache_manager import KVCacheManager
from fastllm.engine.request import RequestStatus
from tests.core.test_kv_cache_manager import BS, compute, req
from tests.core.utils import FakeRunner, add, make_scheduler, prompt_tokens, run_to_completion, step


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def held_bound(window: int, num_new: int, block_size: int) -> int:
    """The most blocks a request holds in a step of num_new tokens: the window - 1 keys before the first of
    them and the new tokens, L consecutive positions, span at most cdiv(L - 1, block_size) + 1 blocks."""
    return cdiv(window - 2 + num_new, block_size) + 1


def test_blocks_behind_the_window_go_back_to_the_pool():
    kv = KVCacheManager(12, BS, sliding_window=6)
    a = req("a", 10)
    compute(kv, a, 10)  # positions 0-9 in blocks 1, 2, 3; the next query (10) reads keys 5 .. 10
    assert kv.block_ids("a") == [1, 2, 3]
    compute(kv, a, 1)  # allocating for position 10: block 1 (keys 0-3) is behind the window
    assert kv.block_ids("a") == [NULL_BLOCK_ID, 2, 3]
    assert kv.num_held_blocks("a") == 2 and kv.num_freed["a"] == 1
    assert "a" in kv.take_rewritten(), "the runner must get the whole table again"
    assert kv.pool.blocks[1].ref_cnt == 0 and 1 in kv.pool.free_queue
    assert kv.pool.blocks[1].block_hash is not None, "a freed full block stays findable in the prefix cache"
    for _ in range(6):  # positions 11-16
        compute(kv, a, 1)
    assert kv.block_ids("a") == [NULL_BLOCK_ID, NULL_BLOCK_ID, 3, 4, 5]  # 16 reads keys 11 .. 16 (11 in block 3)
    kv.check_invariants()
    kv.free(a)
    kv.assert_empty()


def test_a_long_decode_holds_a_window_of_blocks():
    kv = KVCacheManager(20, BS, sliding_window=9)
    a = req("a", 5, max_tokens=200)
    compute(kv, a, 5)
    most = 0
    for _ in range(150):
        compute(kv, a, 1)
        most = max(most, kv.num_held_blocks("a"))
        kv.check_invariants()
    assert len(kv.block_ids("a")) == cdiv(156, BS)  # positions stay where they were
    assert most == held_bound(9, 1, BS) and kv.num_free_blocks >= 19 - most
    kv.free(a)
    kv.assert_empty()


def test_a_chunk_longer_than_the_window():
    # a 40-token prompt in one chunk needs all its blocks while it runs; the next step frees the early ones
    kv = KVCacheManager(20, BS, sliding_window=5)
    a = req("a", 40)
    compute(kv, a, 40)
    assert kv.num_held_blocks("a") == 10
    compute(kv, a, 1)  # the query at 40 reads keys 36 .. 40
    assert kv.block_ids("a")[:9] == [NULL_BLOCK_ID] * 9 and kv.num_held_blocks("a") == 2  # blocks 10, 11


def test_prefix_hits_behind_the_window_are_not_taken():
    kv = KVCacheManager(20, BS, sliding_window=6)
    tokens = prompt_tokens("shared", 20)
    a = req("a", tokens)
    compute(kv, a, 20)
    kv.free(a)  # all five blocks cached-free
    b = req("b", tokens + [5, 6, 7])
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 20 and [h.block_id for h in hits] == [1, 2, 3, 4, 5]
    assert kv.allocate_slots(b, 3, hits)
    # the query at 20 reads keys 15 .. 22: hits 0-2 (keys 0-11) are not taken, 3 (12-15) and 4 are
    assert kv.block_ids("b") == [NULL_BLOCK_ID] * 3 + [4, 5, 6]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 1]
    kv.check_invariants()
    b.num_computed_tokens = 23
    c = req("c", tokens + [9])  # the untaken hits are still hits for anyone whose window needs them
    hits, num_cached = kv.get_computed_blocks(c)
    assert num_cached == 20
    kv.free(b)
    kv.assert_empty()


def test_fork_shares_the_freed_positions_or_refuses():
    kv = KVCacheManager(30, BS, sliding_window=6)
    parent = req("p", 13)
    compute(kv, parent, 13)
    kv.take_copies()  # the step ends: its blocks hold their KV
    child = req("c", parent.prompt_token_ids, fork_of=parent)
    assert kv.fork(parent, child, 12)  # the child's next query (12) reads keys 7 .. 12: all still held
    assert kv.block_ids("c") == [1, 2, 3]
    kv.free(child)
    for _ in range(8):
        compute(kv, parent, 1)  # the parent moves on: blocks 1, 2 are freed behind its window
    kv.take_copies()
    assert kv.block_ids("p")[:2] == [NULL_BLOCK_ID] * 2
    late = req("l", parent.prompt_token_ids, fork_of=parent)
    assert not kv.fork(parent, late, 12), "block 2 (keys 4-7) is freed but the child reads keys 7 .. 12"
    assert "l" not in kv.req_blocks or not kv.req_blocks["l"]
    kv.req_blocks.pop("l", None)
    kv.check_invariants()
    early = req("e", parent.prompt_token_ids, fork_of=parent)
    assert kv.fork(parent, early, 8) is False  # needs keys 3 .. 8: block 1 is freed too
    kv.req_blocks.pop("e", None)
    kv.free(parent)
    kv.assert_empty()


def test_fork_after_the_window_passed_its_first_blocks():
    kv = KVCacheManager(30, BS, sliding_window=3)
    parent = req("p", 13)
    compute(kv, parent, 13)  # the next query (13) reads keys 11 .. 13
    compute(kv, parent, 1)
    kv.take_copies()
    assert kv.block_ids("p")[:2] == [NULL_BLOCK_ID] * 2
    child = req("c", parent.prompt_token_ids, fork_of=parent)
    assert kv.fork(parent, child, 12)  # the child's query 12 reads keys 10 .. 12: block 3, then its own
    assert kv.block_ids("c") == [NULL_BLOCK_ID, NULL_BLOCK_ID, 3] and kv.num_freed["c"] == 2
    child.num_computed_tokens = 12
    assert kv.allocate_slots(child, 1)
    assert kv.block_ids("c")[:3] == [NULL_BLOCK_ID, NULL_BLOCK_ID, 3] and kv.pool.blocks[3].ref_cnt == 2
    kv.check_invariants()
    for r in (child, parent):
        kv.free(r)
    kv.assert_empty()


def test_swap_keeps_the_freed_positions():
    kv = KVCacheManager(20, BS, num_cpu_blocks=10, sliding_window=5)
    a = req("a", 18)
    compute(kv, a, 18)
    compute(kv, a, 1)  # the query at 18 reads keys 14 .. 18: blocks 1-3 freed
    assert kv.num_held_blocks("a") == 2
    assert kv.can_swap_out(a)
    pairs = kv.swap_out(a)
    assert [g for g, _ in pairs] == [4, 5] and len(kv.swapped_blocks["a"]) == 2
    kv.check_invariants()
    assert kv.can_swap_in(a, 1)
    back = kv.swap_in(a)
    assert len(back) == 2 and kv.block_ids("a")[:3] == [NULL_BLOCK_ID] * 3
    kv.check_invariants()
    compute(kv, a, 1)  # registration resumes past the freed positions (the chain goes through the cache)
    kv.check_invariants()
    kv.free(a)
    kv.assert_empty()


def test_invariants_catch_a_block_behind_the_null_run():
    kv = KVCacheManager(12, BS, sliding_window=6)
    a = req("a", 10)
    compute(kv, a, 10)
    compute(kv, a, 1)
    kv.req_blocks["a"][1], kv.req_blocks["a"][0] = kv.null_block, kv.req_blocks["a"][1]
    with pytest.raises(AssertionError, match="freed position holds a block"):
        kv.check_invariants()


# whole schedules over the fake runner


def test_engine_schedule_keeps_each_request_within_its_window():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=16, sliding_window=10)
    runner = FakeRunner(sched)
    for i, n in enumerate((3, 30, 45)):
        add(sched, f"r{i}", n, max_tokens=40)
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        for req_id, n in out.num_scheduled_tokens.items():
            assert sched.kv.num_held_blocks(req_id) <= held_bound(10, n, 4), (req_id, n)
    sched.kv.assert_empty()


def test_fake_runner_catches_a_block_freed_too_early(monkeypatch):
    sched = make_scheduler(num_blocks=64, block_size=4, budget=16, sliding_window=10)
    runner = FakeRunner(sched)
    add(sched, "a", 20, max_tokens=12)
    real = sched.kv._first_needed_block
    monkeypatch.setattr(sched.kv, "_first_needed_block", lambda n: real(n) + 1)  # one block too many
    with pytest.raises(AssertionError, match="null block"):
        run_to_completion(sched, runner)


@pytest.mark.parametrize("window", [1, 3, 6, 13])
@pytest.mark.parametrize("mode, num_cpu_blocks", [("recompute", 0), ("swap", 10)])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_soak_with_a_window(window, mode, num_cpu_blocks, caching, seed):
    # shared prefixes (hits, some behind the window), siblings (forks), aborts, preemption by recompute and
    # swap; the fake runner checks every position each query reads, and each step's holdings stay bounded
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=9, block_size=4, budget=12, max_num_seqs=5, preemption_mode=mode,
                           enable_prefix_caching=caching, num_cpu_blocks=num_cpu_blocks, max_model_len=64,
                           sliding_window=window)
    runner = FakeRunner(sched, lambda r: 10 + (r.num_tokens * 7 + len(r.request_id)) % 40)
    prefixes = [prompt_tokens(f"prefix{i}", 16) for i in range(2)]
    live = []
    for i in range(3000):
        if i < 120 and rng.random() < 0.3:
            tokens = rng.choice(prefixes)[:rng.randint(0, 16)] + prompt_tokens(f"r{i}", rng.randint(1, 20))
            first = None
            for j in range(rng.choice([1, 1, 2, 3])):
                r = add(sched, f"r{i}.{j}", tokens, max_tokens=rng.randint(1, 30), fork_of=first)
                first = first or r
                live.append(r)
        if i < 120 and live and rng.random() < 0.03:
            victim = rng.choice([r for r in live if not r.is_finished] or live)
            sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
        if i >= 120 and not sched.has_unfinished_requests():
            break
        out, _ = step(sched, runner)
        for req_id, n in out.num_scheduled_tokens.items():
            assert sched.kv.num_held_blocks(req_id) <= held_bound(window, n, 4), (req_id, n)
    else:
        raise AssertionError("the soak did not drain")
    sched.kv.assert_empty()
    if window >= 6:  # (narrower windows hold too few blocks to run out)
        assert sched.num_preemptions > 0
