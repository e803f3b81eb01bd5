"""Per-step attention inputs, built once per step by the model runner and read only by the
attention layers, through a scoped forward context (no module-level state leaks between steps)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CascadeMetadata:
    """A cascade step's groups (planned in worker/cascade.py): requests whose block tables start with the same
    blocks attend to that shared prefix once per group, then each to its own suffix; the parts merge by LSE."""
    kv_start: torch.Tensor  # [B] int32: where each request's suffix starts (its group's prefix length; 0 alone)
    prefix_rows: torch.Tensor  # [G] int32: a member of each group (its block_tables row holds the shared blocks)
    prefix_lens: torch.Tensor  # [G] int32: tokens in each group's shared prefix
    rows: torch.Tensor  # [R] int32: the query rows of group 0's requests, then group 1's, ... (-1: padding)
    row_start: torch.Tensor  # [G + 1] int32: group g owns rows[row_start[g]:row_start[g + 1]]
    max_group_rows: int  # host-side bounds, for the launch grids: rows of a group,
    max_prefix_len: int  # tokens of a shared prefix,
    max_suffix_len: int  # and seq_len - kv_start of a request


@dataclass
class TokenRows:
    """Each query token of a step as a decode row of its own: a speculative step's few tokens per request
    attend through the decode kernel, with the length of the prefix each one sees (its position + 1).
    The prefill kernel's tiles cost more for so few query rows (README, "Kernel choices")."""
    block_tables: torch.Tensor  # [T, max_blocks_per_seq] int32: each token's request's block table row
    seq_lens: torch.Tensor  # [T] int32: each token's position + 1


@dataclass
class DecodeRows:
    """A prefill or mixed step's leading single-token requests (decodes), token i being request i < count:
    they attend through the decode kernel, which reads a long context at copy bandwidth, where the prefill
    kernel's query tiles would hold one token each; the prefill kernel takes the other requests."""
    count: int  # rows the decode kernel runs
    seq_lens: torch.Tensor  # [count] int32: each row's keys; 0: not a decode (a CUDA graph's fixed rows)
    # The requests after the decodes, which the prefill kernel runs over: their block tables, seq_lens and
    # query_start_loc (its entries count from the step's first token). None in a CUDA graph (count fixed,
    # rows past the step's decodes 0): the prefill kernel runs over every request, its tile map leaving the
    # decodes out, and the decode rows replace their rows of its output.
    rest_block_tables: torch.Tensor | None = None
    rest_seq_lens: torch.Tensor | None = None
    rest_query_start_loc: torch.Tensor | None = None

    @property
    def in_graph(self) -> bool:
        return self.rest_block_tables is None


def leading_decodes(query_lens: np.ndarray) -> int:
    """How many requests lead a step with one token each (DecodeRows; the scheduler puts its running
    requests, mostly decodes, first)."""
    several = np.flatnonzero(np.asarray(query_lens) != 1)
    return int(several[0]) if len(several) else len(query_lens)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token's K/V (block * block_size + offset); -1 skips
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32: physical block ids per request
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step, per request
    query_start_loc: torch.Tensor  # [B + 1] int32: request i's query rows are [qsl[i], qsl[i+1])
    max_query_len: int  # host-side bound on the query lengths (1: a pure decode step)
    max_seq_len: int  # host-side bound on seq_lens
    cascade: CascadeMetadata | None = None  # shared-prefix groups, when the step cascades
    # [N, 2] int32: the prefill kernel's programs (kernels/prefill_tiles.py), a grid fixed for a CUDA graph
    tile_map: torch.Tensor | None = None
    token_rows: TokenRows | None = None  # when set, the step's tokens attend as decode rows (after their KV writes)
    decode_rows: DecodeRows | None = None  # a prefill or mixed step's leading decodes

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class ForwardContext:
    metadata: AttentionMetadata | None  # None: a profiling run without a KV cache
    # The model's attention layers by layer number: the attention op finds its layer here, so a
    # compiled graph names layers 0..L-1 of whichever model runs it (and can be saved and reloaded).
    attention_layers: Sequence


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata | None, attention_layers: Sequence):
    """Install the step's metadata for the duration of one forward. Nesting is a bug and is refused."""
    global _current
    if _current is not None:
        raise RuntimeError("forward_context does not nest")
    _current = ForwardContext(metadata, attention_layers)
    try:
        yield
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside forward_context")
    return _current


def get_attn_metadata() -> AttentionMetadata | None:
    return get_forward_context().metadata
