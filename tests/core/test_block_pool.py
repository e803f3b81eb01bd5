"""BlockPool: allocation, reference counts, LRU free order, the null block and the prefix-cache map."""

from __future__ import annotations

import pytest

from fastllm.core.block_hash import extend_block_hashes, hash_block_tokens
from fastllm.core.block_pool import NULL_BLOCK_ID, BlockPool


def free_order(pool: BlockPool) -> list[int]:
    """Block ids in eviction order (the next allocation takes the first)."""
    return list(pool.free_queue)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_initial_state_and_null_block():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.num_free_blocks == 4
    assert free_order(pool) == [1, 2, 3, 4]
    assert pool.blocks[NULL_BLOCK_ID].ref_cnt == 1
    assert NULL_BLOCK_ID not in pool.free_queue


def test_without_null_block_every_block_is_usable():
    pool = BlockPool(3, enable_caching=False, reserve_null_block=False)
    assert pool.num_usable_blocks == 3
    assert ids(pool.allocate(3)) == [0, 1, 2]


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_too_small_pool_is_rejected(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_allocate_takes_lru_and_sets_ref_cnt():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    assert ids(blocks) == [1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_order(pool) == [4, 5]
    assert ids(pool.allocate(0)) == []


def test_allocate_too_many_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="cannot allocate 2 blocks, 1 free"):
        pool.allocate(2)
    assert free_order(pool) == [3]


def test_null_block_is_never_handed_out():
    pool = BlockPool(8)
    everything = pool.allocate(7)
    assert NULL_BLOCK_ID not in ids(everything)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(reversed(everything))
    again = pool.allocate(7)
    assert sorted(ids(again)) == list(range(1, 8))


def test_free_tail_first_evicts_the_last_blocks_first():
    pool = BlockPool(8)
    a = pool.allocate(3)  # 1, 2, 3
    b = pool.allocate(2)  # 4, 5
    assert free_order(pool) == [6, 7]
    pool.free(reversed(a))
    assert free_order(pool) == [6, 7, 3, 2, 1]
    pool.free(reversed(b))
    assert free_order(pool) == [6, 7, 3, 2, 1, 5, 4]
    # The never-used blocks go first, then a's tail block, ..., b's first block last.
    assert ids(pool.allocate(7)) == [6, 7, 3, 2, 1, 5, 4]


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free_queue
    pool.free([block])
    assert block.ref_cnt == 0 and free_order(pool) == [2, 3, 1]


def test_touch_takes_a_free_block_out_of_the_free_list():
    pool = BlockPool(6)
    blocks = pool.allocate(3)  # 1, 2, 3
    pool.free(reversed(blocks))
    assert free_order(pool) == [4, 5, 3, 2, 1]
    pool.touch([pool.blocks[2]])
    assert pool.blocks[2].ref_cnt == 1
    assert free_order(pool) == [4, 5, 3, 1]
    # Freed again, it becomes the most recently used.
    pool.free([pool.blocks[2]])
    assert free_order(pool) == [4, 5, 3, 1, 2]


def test_double_free_asserts():
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="double free of block 1"):
        pool.free([block])
    assert free_order(pool) == [2, 3, 1]


# prefix cache

T0, T1, T2 = (1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)


def chain(*blocks) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, [t for block in blocks for t in block], 4, hash_block_tokens)
    return hashes


def test_register_and_lookup():
    pool = BlockPool(6)
    h0, h1 = chain(T0, T1)
    b0, b1 = pool.allocate(2)
    pool.register(b0, h0, T0, None)
    pool.register(b1, h1, T1, b0)
    assert pool.lookup(h0, T0, None) is b0
    assert pool.lookup(h1, T1, b0) is b1
    assert (b0.block_hash, b0.token_ids, b0.parent) == (h0, T0, None)
    assert b1.parent == b0.identity
    # Cached blocks stay findable after they are freed, until evicted.
    pool.free([b1, b0])
    assert pool.lookup(h0, T0, None) is b0 and pool.lookup(h1, T1, b0) is b1


def test_lookup_confirms_tokens_and_parent():
    pool = BlockPool(6)
    h0, h1 = chain(T0, T1)
    b0, b1, other = pool.allocate(3)
    pool.register(b0, h0, T0, None)
    pool.register(b1, h1, T1, b0)
    assert pool.lookup(h0, T1, None) is None  # tokens differ
    assert pool.lookup(h1, T1, None) is None  # parent differs
    assert pool.lookup(h1, T1, other) is None
    assert pool.lookup(h1[::-1], T1, b0) is None  # unknown hash


def test_register_keeps_the_first_of_two_equal_blocks():
    pool = BlockPool(6)
    [h0] = chain(T0)
    first, second = pool.allocate(2)
    pool.register(first, h0, T0, None)
    pool.register(second, h0, T0, None)
    assert pool.cached == {h0: first}
    assert second.block_hash is None and second.token_ids is None
    # Freeing (then evicting) the duplicate does not disturb the cached one.
    pool.free([second])
    assert ids(pool.allocate(4)) == [3, 4, 5, 2]
    assert pool.lookup(h0, T0, None) is first
    assert pool.stats.evictions == 0


def test_register_is_a_no_op_for_registered_blocks_and_without_caching():
    pool = BlockPool(6)
    h0, h1 = chain(T0, T1)
    [b] = pool.allocate(1)
    pool.register(b, h0, T0, None)
    generation = b.generation
    pool.register(b, h1, T1, None)
    assert b.block_hash == h0 and b.generation == generation and pool.cached == {h0: b}

    no_cache = BlockPool(6, enable_caching=False)
    [b] = no_cache.allocate(1)
    no_cache.register(b, h0, T0, None)
    assert no_cache.cached == {} and b.block_hash is None


def test_eviction_on_allocation_drops_the_hash():
    pool = BlockPool(4)  # usable: 1, 2, 3
    [h0] = chain(T0)
    [b] = pool.allocate(1)
    pool.register(b, h0, T0, None)
    pool.free([b])
    assert free_order(pool) == [2, 3, 1]
    pool.allocate(2)  # 2, 3: the cached block survives
    assert pool.lookup(h0, T0, None) is b and pool.stats.evictions == 0
    [again] = pool.allocate(1)
    assert again is b
    assert b.block_hash is None and b.token_ids is None and b.parent is None
    assert pool.cached == {}
    assert pool.lookup(h0, T0, None) is None
    assert pool.stats.evictions == 1


def test_lru_evicts_least_recently_freed_cached_block_first():
    pool = BlockPool(4)
    h0, h1 = chain(T0), chain(T1)
    b1, b2 = pool.allocate(2)
    pool.register(b1, h0[0], T0, None)
    pool.register(b2, h1[0], T1, None)
    pool.free([b2])
    pool.free([b1])
    assert free_order(pool) == [3, 2, 1]
    pool.allocate(2)  # 3, then 2: T1's block is evicted, T0's survives
    assert pool.lookup(h1[0], T1, None) is None
    assert pool.lookup(h0[0], T0, None) is b1


def test_colliding_hash_never_gives_a_wrong_hit():
    """With every block hashing to b"x", only tokens + exact parent identity can decide a hit."""
    pool = BlockPool(8)

    def weak(parent, tokens, extra):
        return b"x"

    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(T0 + T1), 4, weak)
    assert hashes == [b"x", b"x"]
    b0, b1 = pool.allocate(2)
    pool.register(b0, hashes[0], T0, None)
    pool.register(b1, hashes[1], T1, b0)  # the map already has b"x": b1 is not cached
    assert pool.cached == {b"x": b0}
    assert pool.lookup(b"x", T0, None) is b0
    assert pool.lookup(b"x", T1, None) is None  # another block's tokens
    assert pool.lookup(b"x", T1, b0) is None  # b0's tokens are T0, not T1
    assert pool.lookup(b"x", T0, b0) is None  # right tokens, wrong place in the chain (b0 has no parent)
    assert pool.lookup(b"x", T2, b0) is None


def test_parent_only_hash_collision_misses():
    """Hash ignores the parent: the same block after two different prefixes collides."""
    pool = BlockPool(8)

    def tokens_only(parent, tokens, extra):
        return bytes(tokens)

    a = pool.allocate(2)
    b = pool.allocate(1)
    pool.register(a[0], tokens_only(None, T0, b""), T0, None)
    pool.register(a[1], tokens_only(None, T1, b""), T1, a[0])  # T0 T1
    pool.register(b[0], tokens_only(None, T2, b""), T2, None)  # T2 ...
    # T2 T1: the second block's hash and tokens match a[1], its parent does not.
    assert pool.lookup(bytes(T2), T2, None) is b[0]
    assert pool.lookup(bytes(T1), T1, b[0]) is None
    assert pool.lookup(bytes(T1), T1, a[0]) is a[1]


def test_generation_bump_makes_stale_parents_miss():
    pool = BlockPool(3)  # usable: 1, 2
    h0, h1 = chain(T0, T1)
    parent, child = pool.allocate(2)
    pool.register(parent, h0, T0, None)
    pool.register(child, h1, T1, parent)
    old_identity = parent.identity
    assert child.parent == old_identity
    # Free the parent first so that it is evicted first, and the child stays cached.
    pool.free([parent])
    pool.free([child])
    [reused] = pool.allocate(1)
    assert reused is parent and parent.identity != old_identity
    assert pool.cached[h1] is child  # still in the map, but unreachable through the new parent
    assert pool.lookup(h1, T1, parent) is None
    # Even when the parent is re-registered with the very same tokens.
    pool.register(parent, h0, T0, None)
    assert pool.lookup(h0, T0, None) is parent
    assert pool.lookup(h1, T1, parent) is None
    assert pool.cached[h1] is child


def test_identity_changes_on_allocate_and_register():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    g = b.generation
    pool.register(b, chain(T0)[0], T0, None)
    assert b.generation == g + 1
    pool.free([b])
    pool.allocate(2)
    assert b.generation == g + 2


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(6)
    h0, h1 = chain(T0, T1)
    b0, b1 = pool.allocate(2)
    pool.register(b0, h0, T0, None)
    pool.register(b1, h1, T1, b0)
    pool.free([b1])
    pool.reset_prefix_cache()
    assert pool.cached == {}
    assert b0.block_hash is None and b1.block_hash is None
    assert pool.lookup(h0, T0, None) is None
    assert b0.ref_cnt == 1 and free_order(pool) == [3, 4, 5, 2]
    assert pool.stats.evictions == 2
