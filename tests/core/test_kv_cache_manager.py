"""KVCacheManager: block tables, prefix-cache hits, copy-on-write, swapping, the invariant check."""

from __future__ import annotations

import pytest

from fastllm.core.kv_cache_manager import KVCacheManager
from fastllm.engine.request import Request
from tests.core.utils import make_request, prompt_tokens

BS = 4


def req(request_id: str, prompt, hash_fn="default", **kw) -> Request:
    if hash_fn == "default":
        return make_request(request_id, prompt, block_size=BS, **kw)
    return make_request(request_id, prompt, block_size=BS, hash_fn=hash_fn, **kw)


def compute(kv: KVCacheManager, request: Request, n: int, sample: int | None = 7) -> None:
    """What one step does to a request: allocate, advance, and append a token once caught up."""
    assert kv.allocate_slots(request, n)
    request.num_computed_tokens += n
    if request.num_computed_tokens == request.num_tokens and sample is not None:
        request.append_token(sample)


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """Take the prefix-cache hits and compute the rest of the prompt in one go; returns the hit block ids."""
    hits, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, hits)
    kv.record_prefix_query(request, num_cached)
    request.num_computed_tokens = request.num_tokens
    request.append_token(7)
    return [b.block_id for b in hits]


def snapshot(kv: KVCacheManager):
    pool = kv.pool
    return (
        list(pool.free_queue),
        [b.ref_cnt for b in pool.blocks],
        {r: [b.block_id for b in blocks] for r, blocks in kv.req_blocks.items()},
        {h: b.block_id for h, b in pool.cached.items()},
        [(b.block_hash, b.generation) for b in pool.blocks],
        list(kv.pending_copies), set(kv.rewritten),
    )


# allocation


def test_allocate_slots_grows_across_block_boundaries():
    kv = KVCacheManager(10, BS)
    a = req("a", 5)
    compute(kv, a, 5)
    assert kv.block_ids("a") == [1, 2]
    assert kv.num_free_blocks == 7
    for expected in ([1, 2], [1, 2], [1, 2], [1, 2, 3]):  # positions 5, 6, 7, 8
        compute(kv, a, 1)
        assert kv.block_ids("a") == expected
    assert a.num_computed_tokens == 9
    assert kv.num_free_blocks == 6
    assert kv.usage == pytest.approx(3 / 9)
    kv.check_invariants()


def test_chunks_allocate_exactly_the_blocks_they_reach():
    kv = KVCacheManager(10, BS)
    a = req("a", 13)
    compute(kv, a, 4)
    assert kv.block_ids("a") == [1]
    compute(kv, a, 6)
    assert kv.block_ids("a") == [1, 2, 3]
    compute(kv, a, 3)
    assert kv.block_ids("a") == [1, 2, 3, 4]
    # Blocks are registered as soon as the step that fills them is scheduled; the partial one is not.
    assert [kv.pool.blocks[i].block_hash for i in (1, 2, 3)] == a.block_hashes[:3]
    assert kv.pool.blocks[4].block_hash is None
    assert {b.block_id for b in kv.pool.cached.values()} == {1, 2, 3}
    kv.check_invariants()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(5, BS)  # usable: 1..4
    a = req("a", 12)
    compute(kv, a, 12)
    assert kv.block_ids("a") == [1, 2, 3]
    b = req("b", 8)
    before = snapshot(kv)
    assert not kv.allocate_slots(b, 8)
    assert snapshot(kv) == before
    assert "b" not in kv.req_blocks
    # a grows into the last block; then a request that already holds blocks fails to grow.
    compute(kv, a, 1)  # position 12
    assert kv.block_ids("a") == [1, 2, 3, 4]
    c = req("c", 3)
    assert not kv.allocate_slots(c, 3)
    for _ in range(3):
        compute(kv, a, 1)  # positions 13..15 fit in block 4
    before = snapshot(kv)
    assert not kv.allocate_slots(a, 1)  # position 16 needs a fifth block
    assert snapshot(kv) == before
    kv.check_invariants()


def test_free_returns_blocks_tail_first():
    kv = KVCacheManager(8, BS)
    a, b = req("a", 9), req("b", 5)
    compute(kv, a, 9)
    compute(kv, b, 5)
    assert kv.block_ids("a") == [1, 2, 3] and kv.block_ids("b") == [4, 5]
    kv.free(a)
    assert list(kv.pool.free_queue) == [6, 7, 3, 2, 1]
    kv.free(b)
    assert list(kv.pool.free_queue) == [6, 7, 3, 2, 1, 5, 4]
    kv.assert_empty()
    kv.free(a)  # freeing an unknown (or already freed) request is a no-op
    kv.assert_empty()


# prefix cache


def test_prefix_hits_are_full_blocks_and_never_the_last_prompt_token():
    kv = KVCacheManager(16, BS)
    p = prompt_tokens("shared", 10)
    a = req("a", p)
    assert admit(kv, a) == []
    assert kv.block_ids("a") == [1, 2, 3]  # blocks 1, 2 full and cached; 3 holds tokens 8, 9
    cases = {
        "longer": p[:8] + prompt_tokens("x", 5),  # both full blocks
        "same": list(p),  # 10 tokens: both full blocks (the last token is in block 3)
        "two_blocks_exactly": p[:8],  # the last token is in block 2: only block 1
        "mid_block": p[:6] + prompt_tokens("y", 3),  # diverges inside block 2
        "one_token": p[:1],
        "first_differs": [p[0] + 1] + p[1:],
    }
    expected = {"longer": [1, 2], "same": [1, 2], "two_blocks_exactly": [1], "mid_block": [1],
                "one_token": [], "first_differs": []}
    for name, tokens in cases.items():
        hits, num_cached = kv.get_computed_blocks(req(name, tokens))
        assert [b.block_id for b in hits] == expected[name], name
        assert num_cached == BS * len(expected[name])
    # Lookups take no references.
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    kv.check_invariants()


def test_prefix_hit_blocks_are_shared_and_new_blocks_follow():
    kv = KVCacheManager(16, BS)
    p = prompt_tokens("shared", 10)
    a = req("a", p)
    admit(kv, a)
    b = req("b", p[:8] + prompt_tokens("b", 5))
    assert admit(kv, b) == [1, 2]
    assert kv.block_ids("b") == [1, 2, 4, 5]
    assert [kv.pool.blocks[i].ref_cnt for i in range(1, 6)] == [2, 2, 1, 1, 1]
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    kv.assert_empty()
    # Everything b computed is cached too: a third request with b's prompt hits three blocks.
    c = req("c", b.prompt_token_ids)
    assert admit(kv, c) == [1, 2, 4]


def test_disabled_prefix_caching_never_hits_or_registers():
    kv = KVCacheManager(16, BS, enable_caching=False)
    p = prompt_tokens("shared", 10)
    admit(kv, req("a", p))
    assert kv.pool.cached == {}
    hits, n = kv.get_computed_blocks(req("b", p))
    assert (hits, n) == ([], 0)


def test_hits_on_cached_free_blocks_count_against_free_space():
    kv = KVCacheManager(6, BS)  # usable: 1..5
    p = prompt_tokens("shared", 9)
    a = req("a", p)
    admit(kv, a)
    assert kv.block_ids("a") == [1, 2, 3]
    kv.free(a)
    assert list(kv.pool.free_queue) == [4, 5, 3, 2, 1]  # 1 and 2 cached-free
    assert kv.num_free_blocks == 5

    # 24 tokens: 2 hits + 4 new blocks = 6 > 5, although the 4 new blocks alone would fit.
    too_long = req("too_long", p[:8] + prompt_tokens("t", 16))
    hits, num_cached = kv.get_computed_blocks(too_long)
    assert [b.block_id for b in hits] == [1, 2] and num_cached == 8
    before = snapshot(kv)
    assert not kv.allocate_slots(too_long, 16, hits)
    assert snapshot(kv) == before

    # 20 tokens: 2 hits + 3 new = 5 fits; the new blocks never evict the hits.
    fits = req("fits", p[:8] + prompt_tokens("f", 12))
    hits, num_cached = kv.get_computed_blocks(fits)
    assert kv.allocate_slots(fits, 12, hits)
    assert kv.block_ids("fits") == [1, 2, 4, 5, 3]
    assert kv.num_free_blocks == 0
    assert kv.pool.stats.evictions == 0  # block 3 had no hash
    kv.check_invariants()


def test_hits_on_owned_blocks_do_not_count_against_free_space():
    kv = KVCacheManager(6, BS)  # usable: 1..5
    p = prompt_tokens("shared", 9)
    admit(kv, req("a", p))  # holds 1, 2, 3; free: 4, 5
    b = req("b", p[:8] + prompt_tokens("b", 8))  # 16 tokens: 2 hits (owned) + 2 new
    assert admit(kv, b) == [1, 2]
    assert kv.block_ids("b") == [1, 2, 4, 5]
    assert kv.num_free_blocks == 0
    kv.check_invariants()


def test_prefix_cache_stats():
    kv = KVCacheManager(16, BS)
    p = prompt_tokens("shared", 10)
    admit(kv, req("a", p))  # 10 queried, 0 hit
    admit(kv, req("b", p[:8] + [1, 2, 3]))  # 11 queried, 8 hit
    kv.get_computed_blocks(req("c", [5] * 3))  # a lookup without admission is not counted
    stats = kv.pool.stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 21, 8)
    assert stats.hit_rate == pytest.approx(8 / 21)


@pytest.mark.parametrize("hash_fn, same_hits", [
    (lambda parent, tokens, extra: b"x", 1),  # every block collides: only the first block is ever cached
    (lambda parent, tokens, extra: bytes(str(list(tokens)), "ascii"), 3),  # ignores the parent
], ids=["constant", "tokens_only"])
def test_weak_hash_never_gives_a_wrong_hit(hash_fn, same_hits):
    kv = KVCacheManager(32, BS)
    t0, t1, t2 = prompt_tokens("t0", 4), prompt_tokens("t1", 4), prompt_tokens("t2", 4)
    a = req("a", t0 + t1 + t2 + [1], hash_fn=hash_fn)
    admit(kv, a)
    cases = {
        "same": (t0 + t1 + t2 + [9], same_hits),
        "swapped_blocks": (t1 + t0 + [9], 0),
        "repeat_first": (t0 + t0 + t1 + [9], 1),
        "other_parent": (t2 + t1 + t2 + [9], 0),
        "prefix_then_other": (t0 + t2 + t1 + [9], 1),
    }
    for name, (tokens, num_hits) in cases.items():
        hits, num_cached = kv.get_computed_blocks(req(name, tokens, hash_fn=hash_fn))
        assert [b.block_id for b in hits] == kv.block_ids("a")[:num_hits], name
        assert num_cached == num_hits * BS
        for i, block in enumerate(hits):
            assert list(block.token_ids) == tokens[i * BS:(i + 1) * BS], name


def test_constant_hash_keeps_only_the_first_block():
    kv = KVCacheManager(32, BS)
    weak = lambda parent, tokens, extra: b"x"  # noqa: E731
    a = req("a", prompt_tokens("a", 13), hash_fn=weak)
    admit(kv, a)
    assert kv.pool.cached == {b"x": kv.req_blocks["a"][0]}
    hits, _ = kv.get_computed_blocks(req("b", a.prompt_token_ids, hash_fn=weak))
    assert [b.block_id for b in hits] == [1]


# fork and copy-on-write


def test_fork_then_copy_on_write_of_the_partial_block():
    kv = KVCacheManager(10, BS)
    parent = req("p", 6)
    compute(kv, parent, 6)
    assert kv.block_ids("p") == [1, 2]
    assert kv.take_copies() == []  # the parent's step is over: its blocks hold their KV
    child = req("c", parent.prompt_token_ids)
    assert kv.fork(parent, child, 5)  # the prompt minus its last token
    assert kv.block_ids("c") == [1, 2]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2)] == [2, 2]
    child.num_computed_tokens = 5
    assert kv.allocate_slots(child, 1)  # writes position 5, inside the shared block 2
    assert kv.block_ids("c") == [1, 3]
    assert kv.take_copies() == [(2, 3)]
    assert kv.take_copies() == []
    assert kv.take_rewritten() == {"c"}
    assert kv.take_rewritten() == set()
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 1, 1]
    kv.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(10, BS)
    parent = req("p", 5)  # (5 - 1) % 4 == 0: the last prompt token starts block 2
    compute(kv, parent, 5)
    assert kv.block_ids("p") == [1, 2]
    assert kv.take_copies() == []
    child = req("c", parent.prompt_token_ids)
    assert kv.fork(parent, child, 4)
    assert kv.block_ids("c") == [1]
    child.num_computed_tokens = 4
    assert kv.allocate_slots(child, 1)
    assert kv.block_ids("c") == [1, 3]
    assert kv.take_copies() == [] and kv.take_rewritten() == set()
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 1, 1]
    kv.check_invariants()


def test_a_fork_registers_only_the_blocks_it_fills(monkeypatch):
    """A beam is forked every step: the child goes on from the parent's registered blocks (it shares
    them, tokens and all) instead of registering its whole table again, and its chain stays findable."""
    kv = KVCacheManager(10, BS)
    parent = req("p", 9)
    compute(kv, parent, 9)  # blocks 1, 2 full and registered; block 3 holds position 8
    kv.take_copies()
    child = parent.copy_as("c")
    child.append_token(5)
    assert kv.fork(parent, child, parent.num_computed_tokens)
    kv.free(parent)
    registered = []
    real = kv.pool.register
    monkeypatch.setattr(kv.pool, "register", lambda block, *a: registered.append(block.block_id) or real(block, *a))
    for _ in range(2):  # positions 9 and 10; 11 fills block 3
        compute(kv, child, 1, sample=6)
    assert registered == []
    compute(kv, child, 1, sample=6)
    assert registered == [3]
    hits, num_cached = kv.get_computed_blocks(req("q", child.all_token_ids[:12] + [1]))
    assert [b.block_id for b in hits] == [1, 2, 3] and num_cached == 12
    kv.check_invariants()


def test_a_fork_short_of_the_parents_registered_blocks_registers_its_own():
    """A sample forked at its prompt's last token (n > 1) may share fewer blocks than its parent
    registered: it registers from its first block (the shared ones are found as they are)."""
    kv = KVCacheManager(10, BS)
    parent = req("p", 9)
    compute(kv, parent, 9)
    kv.take_copies()
    child = req("c", parent.prompt_token_ids[:8] + [99])
    assert kv.fork(parent, child, 4)  # block 1 only; the parent registered blocks 1 and 2
    child.num_computed_tokens = 4
    assert kv.allocate_slots(child, 5)
    child.num_computed_tokens = 9
    hits, _ = kv.get_computed_blocks(req("q", child.all_token_ids + [1]))
    assert [b.block_id for b in hits] == [1, 2]  # equal content to the parent's block 2: found, not duplicated
    kv.check_invariants()


def test_no_fork_onto_a_block_the_same_step_fills():
    """A block registered by the step being scheduled gets its KV only in that step's forward,
    after the step's copy-on-write copies: a child sharing it would copy an empty block."""
    kv = KVCacheManager(10, BS)
    parent = req("p", 6)
    compute(kv, parent, 6)  # fills block 1 in this very step
    child = req("c", parent.prompt_token_ids)
    assert not kv.fork(parent, child, 5)
    assert kv.block_ids("c") == [] and [kv.pool.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]
    assert kv.take_copies() == []  # the step is scheduled; next step the blocks hold their KV
    assert kv.fork(parent, child, 5)
    assert kv.block_ids("c") == [1, 2]
    kv.check_invariants()


def test_copy_on_write_counts_against_free_space():
    kv = KVCacheManager(4, BS)  # usable: 1..3
    parent = req("p", 6)
    compute(kv, parent, 6)
    other = req("o", 3)
    compute(kv, other, 3)  # takes the last block
    assert kv.take_copies() == []
    child = req("c", parent.prompt_token_ids)
    assert kv.fork(parent, child, 5)
    child.num_computed_tokens = 5
    before = snapshot(kv)
    assert not kv.allocate_slots(child, 1)
    assert snapshot(kv) == before
    kv.free(other)
    assert kv.allocate_slots(child, 1)
    assert kv.take_copies() == [(2, 3)]
    kv.check_invariants()


# swapping


def test_swap_out_and_in():
    kv = KVCacheManager(5, BS, num_cpu_blocks=4)  # GPU usable 1..4, CPU 0..3
    a = req("a", 10)
    compute(kv, a, 10)
    assert kv.block_ids("a") == [1, 2, 3]
    assert kv.can_swap_out(a)
    assert kv.swap_out(a) == [(1, 0), (2, 1), (3, 2)]
    assert "a" not in kv.req_blocks
    assert [b.block_id for b in kv.swapped_blocks["a"]] == [0, 1, 2]
    assert kv.cpu_pool.num_free_blocks == 1
    assert list(kv.pool.free_queue) == [4, 3, 2, 1]
    kv.check_invariants()

    b = req("b", 5)
    compute(kv, b, 5)
    assert kv.block_ids("b") == [4, 3]
    assert not kv.can_swap_out(b)  # 2 blocks, 1 CPU block free
    assert not kv.can_swap_in(a, 1)  # 3 blocks needed, 2 free
    kv.free(b)
    assert kv.can_swap_in(a, 1)
    assert kv.swap_in(a) == [(0, 2), (1, 1), (2, 3)]
    assert kv.block_ids("a") == [2, 1, 3]
    assert "a" not in kv.swapped_blocks
    assert kv.cpu_pool.num_free_blocks == 4
    kv.check_invariants()
    compute(kv, a, 1)  # position 10, in the third block
    assert kv.block_ids("a") == [2, 1, 3]
    kv.free(a)
    kv.assert_empty()


def test_blocks_filled_after_swap_in_stay_findable():
    kv = KVCacheManager(10, BS, num_cpu_blocks=8)
    a = req("a", 9)
    compute(kv, a, 9)
    assert kv.block_ids("a") == [1, 2, 3]
    kv.swap_out(a)
    kv.swap_in(a)
    assert kv.block_ids("a") == [4, 5, 6]  # 1 and 2 stay cached-free with a's first two hashes
    for _ in range(3):
        compute(kv, a, 1)  # positions 9..11 fill block 6
    kv.check_invariants()
    hits, _ = kv.get_computed_blocks(req("c", a.all_token_ids[:12] + [1]))
    assert [b.block_id for b in hits] == [1, 2, 6]  # today: [1, 2]


def test_can_swap_in_counts_the_blocks_the_next_step_needs():
    kv = KVCacheManager(5, BS, num_cpu_blocks=4)  # GPU usable 1..4
    a = req("a", 8)
    compute(kv, a, 8)  # 2 blocks; token 8 needs a third
    kv.swap_out(a)
    hog = req("hog", 6)
    compute(kv, hog, 6)  # 2 of the 4 blocks
    assert not kv.can_swap_in(a, 1)  # its 2 blocks would fit, the block for token 8 would not
    kv.free(hog)
    assert kv.can_swap_in(a, 1)


def test_free_of_a_swapped_request_returns_its_cpu_blocks():
    kv = KVCacheManager(5, BS, num_cpu_blocks=2)
    a = req("a", 6)
    compute(kv, a, 6)
    kv.swap_out(a)
    assert kv.cpu_pool.num_free_blocks == 0
    kv.free(a)
    assert kv.cpu_pool.num_free_blocks == 2
    kv.assert_empty()


def test_no_cpu_pool_means_no_swapping():
    kv = KVCacheManager(5, BS)
    a = req("a", 3)
    compute(kv, a, 3)
    assert kv.cpu_pool is None and not kv.can_swap_out(a)


# invariants


def test_check_invariants_catches_a_corrupted_ref_count():
    kv = KVCacheManager(8, BS)
    a = req("a", 6)
    compute(kv, a, 6)
    kv.check_invariants()
    kv.req_blocks["a"][1].ref_cnt += 1
    with pytest.raises(AssertionError, match="block 2: ref_cnt 2 but 1 holders"):
        kv.check_invariants()


def test_check_invariants_catches_a_lost_free_block():
    kv = KVCacheManager(8, BS)
    del kv.pool.free_queue[5]
    with pytest.raises(AssertionError, match="block 5: ref_cnt 0, in free list False"):
        kv.check_invariants()


def test_check_invariants_catches_a_handed_out_null_block():
    kv = KVCacheManager(8, BS)
    kv.req_blocks["a"].append(kv.pool.blocks[0])
    with pytest.raises(AssertionError, match="null block"):
        kv.check_invariants()


def test_check_invariants_catches_a_leaked_cpu_block():
    kv = KVCacheManager(8, BS, num_cpu_blocks=4)
    kv.cpu_pool.allocate(1)
    with pytest.raises(AssertionError, match="CPU blocks leaked"):
        kv.check_invariants()


def test_check_invariants_catches_a_stale_hash_map_entry():
    kv = KVCacheManager(8, BS)
    a = req("a", 6)
    compute(kv, a, 6)
    kv.pool.blocks[1].block_hash = b"other"
    with pytest.raises(AssertionError, match="hash map entry points at block 1"):
        kv.check_invariants()


def test_assert_empty_catches_a_leak():
    kv = KVCacheManager(8, BS)
    a = req("a", 6)
    compute(kv, a, 6)
    with pytest.raises(AssertionError, match=r"blocks still held by \['a'\]"):
        kv.assert_empty()
    kv.free(a)
    kv.assert_empty()
    kv.pool.allocate(1)  # taken from the pool and never given to a request
    with pytest.raises(AssertionError):
        kv.assert_empty()


# run-ahead beam slots (core/beam_run_ahead.py)

def slot_ids(kv: KVCacheManager, search_id: str) -> list[list[int]]:
    return [[b.block_id for b in t] for t in kv.slot_tables[search_id]]


def test_beam_slots_share_full_blocks_hold_their_own_last_and_give_back_the_rest():
    """Two beams at position 6 (blocks of 4: one full block, one partial) become slots; a step at position 6
    gives each new slot its parent's full block and its own ahead block, and the step after (position 7, the
    same block) each slot's parent's full block again and a new ahead block; the old ones go back."""
    kv = KVCacheManager(num_gpu_blocks=16, block_size=BS, enable_caching=False)
    a = req("a", 6, hash_fn=None)
    admit(kv, a)  # 6 tokens computed, 7 held
    b = a.copy_as("b")
    assert kv.fork(a, b, a.num_computed_tokens)
    shared = kv.block_ids("a")
    kv.adopt_slots("s", ["a", "b"])
    assert not kv.req_blocks and slot_ids(kv, "s") == [shared, shared]
    ahead = kv.allocate_ahead("s", 2)
    kv.regroup_slots("s", [0, 1], 6 // BS)  # the entry step: each slot is its own parent
    assert slot_ids(kv, "s") == [[shared[0], ahead[0]], [shared[0], ahead[1]]]
    kv.check_invariants()
    ahead2 = kv.allocate_ahead("s", 2)
    kv.check_invariants()
    kv.regroup_slots("s", [1, 1], 7 // BS)  # both next slots continue slot 1
    assert slot_ids(kv, "s") == [[shared[0], ahead2[0]], [shared[0], ahead2[1]]]
    assert kv.pool.blocks[shared[0]].ref_cnt == 2 and kv.pool.blocks[ahead[0]].ref_cnt == 0
    assert kv.pool.blocks[shared[1]].ref_cnt == 0  # the entry's shared partial block, copied by the device
    kv.check_invariants()
    ahead3 = kv.allocate_ahead("s", 2)  # position 8: a new block, each next slot sharing its parent's full one
    kv.regroup_slots("s", [0, 0], 8 // BS)
    assert slot_ids(kv, "s") == [[shared[0], ahead2[0], ahead3[0]], [shared[0], ahead2[0], ahead3[1]]]
    kv.slots_to_requests("s", [1, 0], ["c", "d"])
    assert kv.block_ids("c") == [shared[0], ahead2[0], ahead3[1]]
    assert kv.block_ids("d") == [shared[0], ahead2[0], ahead3[0]]
    assert kv.pool.blocks[ahead2[0]].ref_cnt == 2
    kv.check_invariants()
    for r in ("c", "d"):
        kv.free(req(r, 1, hash_fn=None))
    kv.assert_empty()


def one_slot_search(num_gpu_blocks: int) -> KVCacheManager:
    """A manager whose search "s" holds one slot: request "a"'s 5 tokens' blocks."""
    kv = KVCacheManager(num_gpu_blocks=num_gpu_blocks, block_size=BS, enable_caching=False)
    admit(kv, req("a", 5, hash_fn=None))
    kv.adopt_slots("s", ["a"])
    return kv


def test_free_slots_returns_ahead_blocks_and_a_short_pool_allocates_nothing():
    kv = one_slot_search(num_gpu_blocks=6)
    assert kv.allocate_ahead("s", 2) is not None and kv.allocate_ahead("s", 2) is None  # 5 usable, 4 held
    assert kv.num_free_blocks == 1
    with pytest.raises(AssertionError, match="beam slots still held"):
        kv.assert_empty()
    kv.free_slots("s")
    kv.assert_empty()


def test_the_invariant_check_sees_a_slot_block_freed_twice():
    kv = one_slot_search(num_gpu_blocks=8)
    kv.allocate_ahead("s", 1)
    kv.pool.free([kv.slot_tables["s"][0][0]])  # a planted bug: a slot's block dropped behind its back
    with pytest.raises(AssertionError, match="ref_cnt 0 but 1 holders"):
        kv.check_invariants()
