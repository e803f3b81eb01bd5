"""Per-step attention inputs, built once per step by the model runner and read only by the
attention layers, through a scoped forward context (no module-level state leaks between steps)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token's K/V (block * block_size + offset); -1 skips
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32: physical block ids per request
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step, per request
    query_start_loc: torch.Tensor  # [B + 1] int32: request i's query rows are [qsl[i], qsl[i+1])
    max_query_len: int  # host-side bound on the query lengths (1: a pure decode step)
    max_seq_len: int  # host-side bound on seq_lens

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


_current: AttentionMetadata | None = None
_active = False


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata | None):
    """Install the step's metadata for the duration of one forward. None means a profiling run
    without a KV cache. Nesting is a bug and is refused."""
    global _current, _active
    if _active:
        raise RuntimeError("forward_context does not nest")
    _current, _active = metadata, True
    try:
        yield
    finally:
        _current, _active = None, False


def get_attn_metadata() -> AttentionMetadata | None:
    if not _active:
        raise RuntimeError("attention ran outside forward_context")
    return _current
