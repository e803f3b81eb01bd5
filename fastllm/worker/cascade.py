"""Cascade attention's plan for a step: which requests share leading KV blocks, and whether reading each
shared prefix once per group pays.

Requests whose block tables start with the same block ids (prefix caching, or the siblings of an n > 1
request, gave them the same blocks) form a group. Its prefix is the members' longest common run of leading
blocks among those computed before the step, so every query row of the step comes after it: decode rows,
prompt chunks and verify rows alike. The attention layer then attends each group's rows to that prefix in one
pass (the prefix K/V read once per group instead of once per request), each request to its own suffix, and
merges the two by log-sum-exp (layers/attention.py).

Cost model: a request's plain decode reads its whole context once a layer, so a group of n requests over a
P-token prefix saves about (n - 1) x P tokens of K/V reads a layer, against two more launches a layer (the
rotary write apart from attention, the prefix kernel; a mixed step's merge a third). A group cascades when
it has MIN_GROUP_SIZE requests on a prefix of MIN_PREFIX_TOKENS, and a step when its groups save
MIN_SAVED_TOKENS; at most MAX_GROUPS groups a step, those that save the most. These are estimates to be
tuned with `fastllm bench prefix`, which times the same workload with cascade on and off. A decode request
that shares nothing but has MIN_PREFIX_TOKENS of its own takes a group of its own where one is left (its
context read by the prefix kernel's split programs, not by one suffix program), and the step runs plain
when one is not. cascade_attention=True cascades every group (any size, any shared block), False never.

CUDA graphs: the plan is O(B) integers (no block table of its own: a group's prefix is its first member's
table row), so a decode step's plan fits bounded static buffers (CascadeGraphInputs: MAX_GROUPS groups, a
row per request, -1 padding) and a second graph per batch size, captured at that size's first cascade step,
replays any plan; other steps keep their graphs. Mixed steps run compiled, as they do without cascade.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from fastllm.core.block_pool import NULL_BLOCK_ID
from fastllm.worker.attn_metadata import CascadeMetadata

logger = logging.getLogger(__name__)

MIN_GROUP_SIZE = 8
MIN_PREFIX_TOKENS = 256
MIN_SAVED_TOKENS = 16384  # e.g. 9 requests on 2,048 shared tokens, or 64 on 256
# A step's groups. A graph's prefix kernel has a program column per group; an empty one's programs return at
# once, ~1 us a layer for 15 of them (README, "Kernel choices"), so there is room for many groups of one.
MAX_GROUPS = 16


@dataclass
class CascadePlan:
    """The groups of one step, host-side (input_batch.py sends them with the step's inputs)."""
    kv_start: np.ndarray  # [B] int32: each request's suffix start (its group's prefix length, 0 alone)
    prefix_rows: np.ndarray  # [G] int32: each group's first member (its table row holds the prefix)
    prefix_lens: np.ndarray  # [G] int32
    rows: np.ndarray  # [R] int32: the flat query rows of group 0's requests, then group 1's, ...
    row_start: np.ndarray  # [G + 1] int32
    max_group_rows: int
    max_prefix_len: int
    max_suffix_len: int

    def arrays(self) -> list[np.ndarray]:
        return [self.kv_start, self.prefix_rows, self.prefix_lens, self.rows, self.row_start]


class CascadePlanner:
    def __init__(self, mode: bool | None, block_size: int, layer_windows: tuple[int | None, ...] = ()):
        self.mode = mode  # None: where the cost model says it pays; True: every group; False: never
        self.block_size = block_size
        self.layer_windows = layer_windows
        self._logged: set[str] = set()
        self.num_planned = 0  # steps that cascaded (benchmarks read it)
        if mode is False:
            logger.info("cascade attention: off (cascade_attention=False); shared prefixes are read per request")

    def plan(self, states, num_scheduled: list[int]) -> CascadePlan | None:
        """The step's groups when cascading pays (or is forced), else None. states: the runner's
        CachedRequestState of each scheduled request, before the step (num_computed_tokens, block_table)."""
        if self.mode is False or len(states) < (2 if self.mode else MIN_GROUP_SIZE):
            return None
        bs = self.block_size
        # This runs every step, and most steps share nothing: one pass in plain Python finds the candidates
        # (a request with a whole block computed, whose first block is no window's freed one).
        by_first: dict[int, list[int]] = {}
        for i, s in enumerate(states):
            if s.num_computed_tokens >= bs and s.block_ids[0] != NULL_BLOCK_ID:
                by_first.setdefault(s.block_ids[0], []).append(i)
        if len(by_first) == sum(map(len, by_first.values())):
            return None  # no first block is shared
        groups = []  # (members, shared blocks)
        for members in by_first.values():
            if len(members) < 2:
                continue
            cap = min(states[i].num_computed_tokens for i in members) // bs  # blocks computed before the step
            lead = states[members[0]].block_table[:cap]
            same = np.stack([states[i].block_table[:cap] for i in members[1:]]) == lead
            shared = int(np.logical_and.accumulate(same.all(axis=0)).sum())
            groups.append((members, shared))
        if self.mode is None:
            paying = [(m, n) for m, n in groups if len(m) >= MIN_GROUP_SIZE and n * bs >= MIN_PREFIX_TOKENS]
            saved = sum((len(m) - 1) * n * bs for m, n in paying)
            if saved < MIN_SAVED_TOKENS:
                self._say_once("small", "cascade attention: some requests share leading blocks, too few or too "
                               "short to pay (a group needs %d requests on %d tokens, a step %d tokens read fewer): "
                               "plain attention ran", MIN_GROUP_SIZE, MIN_PREFIX_TOKENS, MIN_SAVED_TOKENS)
                return None
            groups = paying
        groups = sorted(groups, key=lambda g: -(len(g[0]) - 1) * g[1])[:MAX_GROUPS]  # the largest savings
        alone, left = self._groups_of_one(states, num_scheduled, groups)
        if left and self.mode is None:
            self._say_once("alone", "cascade attention: more decode requests with long contexts of their own "
                           "than the %d groups a step has room for: plain attention ran", MAX_GROUPS)
            return None
        groups += alone
        ends = np.asarray([s.num_computed_tokens for s in states]) + np.asarray(num_scheduled)
        if self.layer_windows and all(w is not None and w < ends.max() for w in self.layer_windows):
            self._say_once("window", "cascade attention: not for steps that reach past every layer's sliding "
                           "window (each layer reads only its window): plain attention ran")
            return None
        return self._build(states, num_scheduled, groups, ends)

    def _groups_of_one(self, states, num_scheduled, groups) -> tuple[list, list[int]]:
        """Decode requests outside the groups with at least MIN_PREFIX_TOKENS computed, longest first: as many
        as MAX_GROUPS leaves room for become groups of one (their computed blocks read by the prefix kernel,
        split over the SMs); the rest are returned by index. A decode step's suffix launch is sized for the
        groups' short suffixes (one program a request and KV head), so a long context left in it outlasts the
        rest of the step's attention (README, "Cascade attention")."""
        grouped = {i for members, _ in groups for i in members}
        long = sorted((i for i, s in enumerate(states) if i not in grouped and num_scheduled[i] == 1
                       and s.num_computed_tokens >= MIN_PREFIX_TOKENS and s.block_ids[0] != NULL_BLOCK_ID),
                      key=lambda i: -states[i].num_computed_tokens)
        room = MAX_GROUPS - len(groups)
        return [([i], states[i].num_computed_tokens // self.block_size) for i in long[:room]], long[room:]

    def _build(self, states, num_scheduled, groups, ends) -> CascadePlan:
        bs = self.block_size
        first_row = np.concatenate([[0], np.cumsum(num_scheduled)])
        kv_start = np.zeros(len(states), dtype=np.int32)
        prefix_rows = np.asarray([members[0] for members, _ in groups], dtype=np.int32)
        rows, row_start = [], [0]
        for members, n in groups:
            kv_start[members] = n * bs
            rows += [np.arange(first_row[i], first_row[i + 1]) for i in members]
            row_start.append(row_start[-1] + sum(num_scheduled[i] for i in members))
        prefix_lens = np.asarray([n * bs for _, n in groups], dtype=np.int32)
        self.num_planned += 1
        self._say_once("on", "cascade attention: on (first step: %d requests in %d groups on up to %d shared "
                       "tokens); decode steps replay a cascade CUDA graph of their size, mixed steps run compiled",
                       sum(len(m) for m, _ in groups), len(groups), int(prefix_lens.max()))
        return CascadePlan(kv_start, prefix_rows, prefix_lens, np.concatenate(rows).astype(np.int32),
                           np.asarray(row_start, dtype=np.int32), int(np.diff(row_start).max()),
                           int(prefix_lens.max()), int((ends - kv_start).max()))

    def _say_once(self, key: str, message: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.info(message, *args)


class CascadeGraphInputs:
    """A CUDA graph's cascade inputs: a step's plan padded to bounded shapes in one static int32 buffer
    [kv_start (max_bs) | prefix_rows (MAX_GROUPS) | prefix_lens (MAX_GROUPS) | rows (max_bs) | row_start
    (MAX_GROUPS + 1)], so one graph per batch size replays any plan that fits. Padding: rows -1, empty groups."""

    def __init__(self, max_bs: int, max_seq_len: int, device: torch.device):
        self.sizes = [max_bs, MAX_GROUPS, MAX_GROUPS, max_bs, MAX_GROUPS + 1]
        self.buffer = torch.zeros(sum(self.sizes), dtype=torch.int32, device=device)
        self.kv_start, self.prefix_rows, self.prefix_lens, self.rows, self.row_start = self.buffer.split(self.sizes)
        self.max_seq_len = max_seq_len  # the graphs' bound on a prefix and a suffix

    def metadata(self, bs: int) -> CascadeMetadata:
        """The views a graph of bs rows is captured with (host bounds: the whole batch, max_seq_len)."""
        return CascadeMetadata(self.kv_start[:bs], self.prefix_rows, self.prefix_lens, self.rows[:bs],
                               self.row_start, bs, self.max_seq_len, self.max_seq_len)

    def pack(self, plan: CascadePlan) -> np.ndarray:
        """The plan as the buffer's contents (what the step's staging copies into it)."""
        groups, num_rows = len(plan.prefix_lens), len(plan.rows)
        assert groups <= MAX_GROUPS and num_rows <= self.sizes[3], (groups, num_rows)
        parts = [np.zeros(n, dtype=np.int32) for n in self.sizes]
        parts[0][:len(plan.kv_start)] = plan.kv_start
        parts[1][:groups], parts[2][:groups] = plan.prefix_rows, plan.prefix_lens
        parts[3][:] = -1
        parts[3][:num_rows] = plan.rows
        parts[4][:] = num_rows
        parts[4][:groups + 1] = plan.row_start
        return np.concatenate(parts)
