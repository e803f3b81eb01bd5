"""BlockPool: KV blocks, their reference counts, an LRU free list and the prefix-cache map.

A block is in exactly one of three states:
  owned        ref_cnt > 0; not in the free list
  cached-free  ref_cnt == 0, has a hash; in the free list and still findable by its hash
  free         ref_cnt == 0, no hash; in the free list
Allocation pops the least recently freed block and drops its hash (lazy eviction), so cached
blocks survive until the space is really needed. Block 0 is the null block: never allocated,
it is what padding rows of a batch point at.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fastllm.core.block_hash import BlockHash

NULL_BLOCK_ID = 0


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Prefix-cache identity, set while the block is registered in the hash map.
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    parent: tuple[int, int] | None = None  # (block_id, generation) of the block before it
    # Bumped on every allocation and registration, so a stale (block_id, generation) never matches.
    generation: int = 0

    @property
    def identity(self) -> tuple[int, int]:
        return (self.block_id, self.generation)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.reserve_null_block = reserve_null_block
        first = NULL_BLOCK_ID + 1 if reserve_null_block else 0
        if reserve_null_block:
            self.blocks[NULL_BLOCK_ID].ref_cnt = 1  # pinned forever
        # block_id -> block, oldest first: popitem(last=False) is the LRU block.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[first:])
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (1 if self.reserve_null_block else 0)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            block.generation += 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; pass a request's blocks tail first, so that its last blocks
        (the least likely to be shared) are evicted first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    # prefix cache

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int], parent: KVCacheBlock | None) -> KVCacheBlock | None:
        """The cached block holding token_ids right after `parent`, or None.

        A hit must match the tokens and the exact parent block, not just the hash: a hash
        collision costs a miss, never a wrong answer.
        """
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        if block.parent != (parent.identity if parent is not None else None):
            return None
        return block

    def register(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int],
                 parent: KVCacheBlock | None) -> KVCacheBlock:
        """Make a newly filled block findable, and return the block that lookup will find for
        this content: `block` itself, or an equal block cached earlier (which is kept)."""
        if not self.enable_caching or block.block_hash is not None:
            return block
        existing = self.lookup(block_hash, token_ids, parent)
        if existing is not None:
            return existing
        if block_hash in self.cached:  # a different block under the same hash: a collision
            return block
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent = parent.identity if parent is not None else None
        block.generation += 1
        self.cached[block_hash] = block
        return block

    def uncache(self, block: KVCacheBlock) -> None:
        """Make the block unfindable: its KV is not (or may not be) what its hash says."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = block.token_ids = block.parent = None
        self.stats.evictions += 1

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self._evict(block)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found
    requests: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
