"""KVCacheManager: which blocks each request holds, prefix-cache hits, copy-on-write, swapping.

The scheduler calls this; it never sees a tensor. Physical work (copying a block for
copy-on-write, moving blocks to and from the CPU pool) is returned as (src, dst) block-id
pairs that travel in the SchedulerOutput to the model runner.

Sliding window (every layer of the model has one): the row at position p reads keys p - window < k <= p,
so a block that ends at or before num_computed_tokens - window is never read again. Each allocation gives
such blocks back to the pool (as any freed block: cached-free, still findable by its hash) and puts the
null block in their place, so the table keeps every position where it was; a request holds at most about
(window + its step's tokens) / block_size blocks, whatever its length. The freed blocks are always a
leading run of the table (num_freed). Prefix-cache hits behind the window are not taken at all. Blocks
are registered in the prefix cache before they are freed, and registration walks over freed positions
through the blocks lookup finds there, so the hash chain (each block registered under the one before it)
stays whole; if one of those has been evicted, the request registers nothing more (unchained).

Run-ahead beam searches (core/beam_run_ahead.py) hold their beams' tables as slots (slot_tables: a search's W
tables, one per running beam) and the blocks of steps launched before their picks are known (ahead_blocks:
one private block per slot and step, for the position it writes). Once a step's picks are known, regroup_slots
makes each new slot its parent's table up to that position's block, then the slot's ahead block (which the
device filled with a copy of the parent's partial block where the position is not a block's first). Slots
register nothing in the prefix cache.
"""

from __future__ import annotations

from collections import defaultdict

from fastllm.core.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock
from fastllm.engine.request import Request

MIN_SWAP_BLOCKS = 2  # the smallest CPU swap pool kept (preemption_mode='swap' refuses a smaller one)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True, num_cpu_blocks: int = 0,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window  # every layer's (the widest), or None: see the module docstring
        self.pool = BlockPool(num_gpu_blocks, enable_caching)
        self.null_block = self.pool.blocks[NULL_BLOCK_ID]  # what the table holds where a block was freed
        self.cpu_pool = BlockPool(num_cpu_blocks, False, reserve_null_block=False) \
            if num_cpu_blocks >= MIN_SWAP_BLOCKS else None
        self.req_blocks: dict[str, list[KVCacheBlock]] = defaultdict(list)
        self.swapped_blocks: dict[str, list[KVCacheBlock]] = {}  # request id -> CPU blocks
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for this step
        self.rewritten: set[str] = set()  # requests whose block table changed in place this step
        self.num_registered: dict[str, int] = defaultdict(int)  # leading blocks already offered to the cache
        self.chain_tail: dict[str, KVCacheBlock] = {}  # the cached block lookup finds at the last of those
        self.num_freed: dict[str, int] = defaultdict(int)  # leading blocks given back behind the window
        self.unchained: set[str] = set()  # requests whose hash chain broke at a freed, evicted block
        # Blocks registered by the step being scheduled: that step's forward writes their KV. A
        # prefix hit on one is safe (each layer writes K/V before attending), but a copy-on-write
        # copy runs before the forward, so a fork must not share one (see fork).
        self.filled_this_step: set[int] = set()
        self.slot_tables: dict[str, list[list[KVCacheBlock]]] = {}  # run-ahead search id -> its slots' tables
        self.ahead_blocks: dict[str, list[list[KVCacheBlock]]] = {}  # search id -> per launched step, a block a slot

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_usable_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # prefix cache

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of the request's full blocks already in the cache, and its length in
        tokens. At least the last prompt token is always left to compute: its logits are needed."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            block = self.pool.lookup(block_hash, tokens, hits[-1] if hits else None)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup (only admissions that happen, so a request waiting at the
        head of the queue is not counted again every step)."""
        if self.enable_caching:
            stats = self.pool.stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens

    # allocation

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for num_new_tokens more tokens after request.num_computed_tokens (plus any
        prefix-cache hits in computed_blocks, which a new request takes first), and for up to
        num_lookahead_tokens slots after them that a draft model writes (never past the request's
        max_total_tokens). Returns False, changing nothing, when the free blocks do not suffice."""
        if not computed_blocks:
            self._free_behind_window(request)
            blocks = self.req_blocks.get(request.request_id)
            end = request.num_computed_tokens + num_new_tokens
            last = (self._slots_end(request, end, num_lookahead_tokens) - 1) // self.block_size
            if num_new_tokens > 0 and blocks and last < len(blocks) and request.num_computed_tokens // self.block_size == last \
                    and blocks[last].ref_cnt == 1:
                # The common decode step: it writes into one block it already holds alone.
                self._cache_full_blocks(request, blocks, end)
                return True
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks[request.request_id]
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        held = len(blocks) + len(computed_blocks)
        end = num_computed + num_new_tokens
        slots_end = self._slots_end(request, end, num_lookahead_tokens)
        # Blocks we already hold that this step writes into and others share: copy on write.
        cow = [i for i in range(num_computed // self.block_size, min(held, cdiv(slots_end, self.block_size)))
               if i < len(blocks) and blocks[i].ref_cnt > 1]
        num_needed = max(0, cdiv(slots_end, self.block_size) - held) + len(cow)
        behind = min(len(computed_blocks), self._first_needed_block(num_computed))  # hits not to take
        num_evictable_hits = sum(1 for b in computed_blocks[behind:] if b.ref_cnt == 0)
        if num_needed + num_evictable_hits > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False

        if computed_blocks:  # (registered already: the chain continues after the last hit)
            self.num_registered[request.request_id] = len(blocks) + len(computed_blocks)
            self.chain_tail[request.request_id] = computed_blocks[-1]
            self.num_freed[request.request_id] += behind
        self.pool.touch(computed_blocks[behind:])
        blocks.extend([self.null_block] * behind + computed_blocks[behind:])
        for i in cow:
            [copy] = self.pool.allocate(1)
            self.pending_copies.append((blocks[i].block_id, copy.block_id))
            self.rewritten.add(request.request_id)
            self.pool.free([blocks[i]])
            blocks[i] = copy
        blocks.extend(self.pool.allocate(max(0, cdiv(slots_end, self.block_size) - len(blocks))))
        self._cache_full_blocks(request, blocks, end)
        return True

    def _first_needed_block(self, num_computed: int) -> int:
        """The first block a request at num_computed_tokens may still read (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _free_behind_window(self, request: Request) -> None:
        """Give back the request's blocks that its next query (at num_computed_tokens) and every later one
        see no key of; the null block takes their place in the table, which the runner then gets whole."""
        req_id = request.request_id
        blocks = self.req_blocks.get(req_id)
        if self.sliding_window is None or not blocks:
            return
        first, freed = self._first_needed_block(request.num_computed_tokens), self.num_freed[req_id]
        if first <= freed:
            return
        # (registered first, so that the chain runs on past them: after a swap-in or a fork it may lag)
        self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        gone = blocks[freed:first]
        blocks[freed:first] = [self.null_block] * len(gone)
        self.pool.free(reversed(gone))
        self.num_freed[req_id] = first
        self.rewritten.add(req_id)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds in the pool (its table's entries less the freed ones)."""
        return len(self.req_blocks.get(request_id, ())) - self.num_freed.get(request_id, 0)

    @staticmethod
    def _slots_end(request: Request, end: int, num_lookahead_tokens: int) -> int:
        """The end of the slots a step needs: its tokens' and the lookahead's, which stops at the
        request's last token."""
        return max(end, min(end + num_lookahead_tokens, request.max_total_tokens))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register the blocks that are full once num_tokens are computed."""
        if not self.enable_caching:
            return
        start = self.num_registered[request.request_id]
        if num_tokens < (start + 1) * self.block_size:
            return  # no block became full (most decode steps)
        num_full = min(num_tokens, request.num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        # Each block is registered under the block that lookup finds before it (which may be an
        # equal block cached earlier, not the request's own copy), so the chain stays reachable.
        parent = self.chain_tail.get(request.request_id)
        for i in range(start, num_full):
            if request.request_id in self.unchained:
                break
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            if blocks[i] is self.null_block:
                # Freed behind the window (a fork's or a swapped-in table): the chain goes on from the block
                # lookup finds here; once that is evicted, nothing after it can be found: stop registering.
                parent = self.pool.lookup(request.block_hashes[i], tokens, parent)
                if parent is None:
                    self.unchained.add(request.request_id)
                continue
            new = blocks[i].block_hash is None
            parent = self.pool.register(blocks[i], request.block_hashes[i], tokens, parent)
            if new and blocks[i].block_hash is not None:
                self.filled_this_step.add(blocks[i].block_id)
        if num_full > start:
            self.num_registered[request.request_id] = num_full
            self.chain_tail[request.request_id] = parent

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_registered.pop(request.request_id, None)
        self.chain_tail.pop(request.request_id, None)
        freed = self.num_freed.pop(request.request_id, 0)
        self.unchained.discard(request.request_id)
        self.pool.free(reversed(blocks[freed:]))
        cpu_blocks = self.swapped_blocks.pop(request.request_id, None)
        if cpu_blocks:
            self.cpu_pool.free(cpu_blocks)

    def fork(self, parent: Request, child: Request, num_tokens: int) -> bool:
        """Let child share the parent's blocks holding its first num_tokens tokens. False (and
        nothing shared) while one of them is being filled by this step: the child's first write
        copies the block it writes into, and that copy would run before the block holds its KV. False
        too when the parent has already freed a block the child still reads (its window is further on)."""
        shared = self.req_blocks[parent.request_id][:cdiv(num_tokens, self.block_size)]
        if self.filled_this_step and any(b.block_id in self.filled_this_step for b in shared):
            return False
        freed = min(self.num_freed.get(parent.request_id, 0), len(shared))
        if freed > self._first_needed_block(num_tokens):
            return False
        self.pool.touch(shared[freed:])
        self.req_blocks[child.request_id] = list(shared)
        if freed:
            self.num_freed[child.request_id] = freed
        registered = self.num_registered.get(parent.request_id, 0)
        if registered and registered <= num_tokens // self.block_size:
            # The parent's registered blocks are all shared, tokens and all: the child's registration goes on
            # after them instead of walking its whole table again (a beam is forked every step).
            self.num_registered[child.request_id] = registered
            self.chain_tail[child.request_id] = self.chain_tail[parent.request_id]
            if parent.request_id in self.unchained:
                self.unchained.add(child.request_id)
        return True

    # run-ahead beam slots

    def allocate_ahead(self, search_id: str, num_slots: int) -> list[int] | None:
        """One block for each of a run-ahead step's slots, held by the search until regroup_slots puts them in
        its tables (or free_slots); None, changing nothing, when the pool is short."""
        if num_slots > self.pool.num_free_blocks:
            return None
        blocks = self.pool.allocate(num_slots)
        self.ahead_blocks.setdefault(search_id, []).append(blocks)
        return [b.block_id for b in blocks]

    def adopt_slots(self, search_id: str, request_ids: list[str]) -> None:
        """The requests' tables become the search's slots (the requests hold nothing after)."""
        assert search_id not in self.slot_tables, f"{search_id} holds slots already"
        self.slot_tables[search_id] = [self.req_blocks.pop(r) for r in request_ids]
        for r in request_ids:
            self.num_registered.pop(r, None)
            self.chain_tail.pop(r, None)
            self.unchained.discard(r)
            freed = self.num_freed.pop(r, 0)  # (not inside the assert: python -O drops it)
            assert not freed, "slots of a request with freed blocks (a sliding window)"

    def regroup_slots(self, search_id: str, parents: list[int], num_shared: int) -> None:
        """The next step's slots: slot j is parent[j]'s first num_shared blocks, then the oldest ahead block of
        slot j. The old tables' blocks no slot keeps go back to the pool."""
        old, ahead = self.slot_tables[search_id], self.ahead_blocks[search_id][0]
        assert len(ahead) == len(parents), "a step's ahead blocks are one per slot"  # (held: free_slots)
        self.ahead_blocks[search_id].pop(0)
        new = []
        for parent, block in zip(parents, ahead):
            shared = old[parent][:num_shared]
            assert len(shared) == num_shared, f"slot {parent} holds {len(old[parent])} blocks, {num_shared} shared"
            self.pool.touch(shared)
            new.append(shared + [block])
        for table in old:
            self.pool.free(reversed(table))
        self.slot_tables[search_id] = new
        if not self.ahead_blocks[search_id]:
            del self.ahead_blocks[search_id]

    def slots_to_requests(self, search_id: str, parents: list[int], request_ids: list[str]) -> None:
        """Back to requests: request j shares all of slot parent[j]'s blocks (copy-on-write at its next write)."""
        assert search_id not in self.ahead_blocks, "slots with steps in flight"
        old = self.slot_tables.pop(search_id)
        for parent, request_id in zip(parents, request_ids):
            self.pool.touch(old[parent])
            self.req_blocks[request_id] = list(old[parent])
        for table in old:
            self.pool.free(reversed(table))

    def free_slots(self, search_id: str) -> None:
        """A run-ahead search ended: its tables and ahead blocks go back (steps in flight write only ahead blocks
        and read these, before any later step's writes, in the device's order)."""
        for table in self.slot_tables.pop(search_id, []):
            self.pool.free(reversed(table))
        for blocks in self.ahead_blocks.pop(search_id, []):
            self.pool.free(blocks)

    # swapping

    def can_swap_out(self, request: Request) -> bool:
        return self.cpu_pool is not None and self.num_held_blocks(request.request_id) <= self.cpu_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the CPU pool; returns (gpu, cpu) pairs to copy. The freed ones
        (behind the window) stay freed: num_freed is kept for swap_in."""
        gpu_blocks = self.req_blocks.pop(request.request_id)[self.num_freed.get(request.request_id, 0):]
        self.num_registered.pop(request.request_id, None)
        self.chain_tail.pop(request.request_id, None)
        self.unchained.discard(request.request_id)
        cpu_blocks = self.cpu_pool.allocate(len(gpu_blocks))
        self.swapped_blocks[request.request_id] = cpu_blocks
        self.pool.free(reversed(gpu_blocks))
        return [(g.block_id, c.block_id) for g, c in zip(gpu_blocks, cpu_blocks)]

    def can_swap_in(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        end = self._slots_end(request, request.num_computed_tokens + num_new_tokens, num_lookahead_tokens)
        freed = self.num_freed.get(request.request_id, 0)
        need = max(len(self.swapped_blocks[request.request_id]), cdiv(end, self.block_size) - freed)
        return need <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request's blocks back; returns (cpu, gpu) pairs to copy."""
        cpu_blocks = self.swapped_blocks.pop(request.request_id)
        gpu_blocks = self.pool.allocate(len(cpu_blocks))
        self.req_blocks[request.request_id] = [self.null_block] * self.num_freed.get(request.request_id, 0) + gpu_blocks
        self.cpu_pool.free(cpu_blocks)
        return [(c.block_id, g.block_id) for c, g in zip(cpu_blocks, gpu_blocks)]

    def take_rewritten(self) -> set[str]:
        rewritten, self.rewritten = self.rewritten, set()
        return rewritten

    def filled_identities(self) -> list[tuple[int, int]]:
        """The identities of the blocks the step being scheduled registered (its forward writes their KV)."""
        return [self.pool.blocks[i].identity for i in self.filled_this_step]

    def uncache(self, identities: list[tuple[int, int]]) -> None:
        """Take the blocks of a step that failed out of the prefix cache (it may not have written their KV),
        unless they were allocated or registered again since."""
        for block_id, generation in identities:
            block = self.pool.blocks[block_id]
            if block.generation == generation:
                self.pool.uncache(block)

    def take_copies(self) -> list[tuple[int, int]]:
        """The step's copy-on-write pairs; called once per step, when its schedule is complete."""
        copies, self.pending_copies = self.pending_copies, []
        self.filled_this_step.clear()
        return copies

    # invariants

    def check_invariants(self) -> None:
        """Every block is free or owned, and reference counts equal the number of holders; the null block
        stands only where a window freed a leading run of a table.
        Raises AssertionError describing the first violation."""
        holders: dict[int, int] = defaultdict(int)
        for req_id, blocks in self.req_blocks.items():
            freed = self.num_freed.get(req_id, 0)
            assert freed == 0 or self.sliding_window is not None, f"{req_id}: blocks freed without a window"
            assert all(b is self.null_block for b in blocks[:freed]), f"{req_id}: a freed position holds a block"
            for b in blocks[freed:]:
                assert b is not self.null_block, f"{req_id}: the null block past the freed run"
                holders[b.block_id] += 1
        for tables in (*self.slot_tables.values(), *self.ahead_blocks.values()):
            for b in (b for t in tables for b in t):
                assert b is not self.null_block, "a slot holds the null block"
                holders[b.block_id] += 1
        for block in self.pool.blocks:
            if block.block_id == NULL_BLOCK_ID and self.pool.reserve_null_block:
                assert block.ref_cnt == 1 and holders[NULL_BLOCK_ID] == 0, "null block was handed out"
                continue
            in_free = block.block_id in self.pool.free_queue
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders")
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free list {in_free}"
            if block.block_hash is not None:
                assert block.token_ids is not None and len(block.token_ids) == self.block_size
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash, f"hash map entry points at block {block.block_id} with another hash"
        if self.cpu_pool is not None:
            cpu_held = sum(len(b) for b in self.swapped_blocks.values())
            assert cpu_held + self.cpu_pool.num_free_blocks == self.cpu_pool.num_blocks, "CPU blocks leaked"

    def assert_empty(self) -> None:
        """No request holds a block: the pool is whole again (cached-free blocks count as free)."""
        self.check_invariants()
        assert not self.req_blocks and not self.swapped_blocks, (
            f"blocks still held by {sorted(self.req_blocks) + sorted(self.swapped_blocks)}")
        assert not self.slot_tables and not self.ahead_blocks, (
            f"beam slots still held by {sorted(self.slot_tables) + sorted(self.ahead_blocks)}")
        assert not any(self.num_freed.values()), f"freed-block counts left for {sorted(self.num_freed)}"
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks, (
            f"{self.pool.num_usable_blocks - self.pool.num_free_blocks} blocks leaked")
