"""Content hashes of full KV blocks, chained through the parent block's hash.

hash(block i) = sha256(hash(block i-1) || extra || token ids of block i), so equal hashes mean
equal prefixes, not just equal blocks. sha256 makes collisions infeasible; on top of that the
block pool confirms every hit against the block's token ids and its parent (see BlockPool), so
even a deliberately weak hash function can only cost hits, never correctness.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes
HashFn = Callable[[BlockHash | None, Sequence[int], bytes], BlockHash]

NONE_HASH = b"fastllm-root"


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent if parent is not None else NONE_HASH)
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, hash_fn: HashFn, extra: bytes = b""
) -> None:
    """Append the hashes of the blocks of token_ids that became full since the last call."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i > 0 else None
        hashes.append(hash_fn(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
