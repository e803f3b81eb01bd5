"""The cascade planner: groups of requests whose block tables start alike, their shared prefix (whole blocks
computed before the step), the rows and suffix starts the kernels get, and the cost model's decision."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import fastllm.worker.cascade as cascade
from fastllm.sampling_params import SamplingParams
from fastllm.worker.cascade import CascadePlanner
from fastllm.worker.input_batch import CachedRequestState

BS = 4


def state(name: str, block_ids: list[int], num_computed: int) -> CachedRequestState:
    """A request about to compute the token after its num_computed ones (the last of its prompt)."""
    return CachedRequestState(name, [1] * (num_computed + 1), [], SamplingParams(temperature=0), None, block_ids,
                              num_computed)


def test_groups_prefixes_rows_and_suffix_starts():
    states = [
        state("a", [5, 6, 7, 8], 14),  # shares 5, 6, 7 with b and c
        state("x", [20, 21], 6),  # alone
        state("b", [5, 6, 7, 9, 10], 19),
        state("c", [5, 6, 7, 11], 13),
        state("d", [30, 31, 32], 9),  # shares 30 with e: one block
        state("e", [30, 33], 5),
        state("f", [5, 40], 3),  # shares block 5 but has no whole block computed before the step
    ]
    num_scheduled = [1, 1, 1, 3, 1, 2, 1]
    plan = CascadePlanner(True, BS).plan(states, num_scheduled)
    assert plan is not None
    assert plan.prefix_lens.tolist() == [12, 4]
    assert plan.prefix_rows.tolist() == [0, 4]  # a's table row holds its group's prefix, d's the other
    assert plan.kv_start.tolist() == [12, 0, 12, 12, 4, 4, 0]
    # flat query rows: a 0, x 1, b 2, c 3-5, d 6, e 7-8, f 9
    assert plan.rows.tolist() == [0, 2, 3, 4, 5, 6, 7, 8] and plan.row_start.tolist() == [0, 5, 8]
    assert plan.max_group_rows == 5 and plan.max_prefix_len == 12
    assert plan.max_suffix_len == max(15 - 12, 7, 20 - 12, 16 - 12, 10 - 4, 7 - 4, 4)


def test_prefix_stops_at_the_first_difference_and_at_the_computed_blocks():
    states = [state("a", [5, 6, 7, 8], 16), state("b", [5, 6, 9, 8], 16), state("c", [5, 6, 7, 8], 9)]
    plan = CascadePlanner(True, BS).plan(states, [1, 1, 1])
    assert plan.prefix_lens.tolist() == [8]  # blocks 5, 6: b differs at its third
    states = [state("a", [5, 6, 7, 8], 16), state("b", [5, 6, 7, 8], 9)]
    assert CascadePlanner(True, BS).plan(states, [1, 1]).prefix_lens.tolist() == [8]  # b has computed 2 blocks


def test_nothing_shared_or_freed_blocks_plan_nothing():
    assert CascadePlanner(True, BS).plan([state("a", [5, 6], 8), state("b", [7, 8], 8)], [1, 1]) is None
    # the null block at the head of windowed tables is not a shared block
    assert CascadePlanner(True, BS).plan([state("a", [0, 6], 8), state("b", [0, 8], 8)], [1, 1]) is None
    assert CascadePlanner(False, BS).plan([state("a", [5, 6], 8), state("b", [5, 6], 8)], [1, 1]) is None


def test_cost_model(caplog):
    blocks = list(range(1, 1 + 2048 // BS))
    big = [state(f"r{i}", blocks + [5000 + i], 2048 + 3) for i in range(cascade.MIN_GROUP_SIZE + 1)]
    assert (len(big) - 1) * 2048 >= cascade.MIN_SAVED_TOKENS
    planner = CascadePlanner(None, BS)
    with caplog.at_level(logging.INFO, logger="fastllm.worker.cascade"):
        plan = planner.plan(big, [1] * len(big))
        assert plan is not None and plan.prefix_lens.tolist() == [2048]
        assert planner.plan(big[:cascade.MIN_GROUP_SIZE - 1], [1] * (cascade.MIN_GROUP_SIZE - 1)) is None
        short = [state(f"s{i}", [7, 8000 + i], 6) for i in range(20)]
        assert planner.plan(short, [1] * 20) is None  # 4 shared tokens: too short
        assert planner.plan(big, [1] * len(big)) is not None
    assert CascadePlanner(True, BS).plan(short, [1] * 20) is not None  # forced
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cascade attention: on" in m for m in messages) == 1
    assert sum("too few or too short" in m for m in messages) == 1, messages  # once, not per step


def test_decode_requests_with_long_contexts_of_their_own_take_groups_of_one(caplog):
    # Left in the suffix launch (one program a request and KV head), a long context outlasts the rest of the
    # step's attention; as a group of one the prefix kernel's split programs read it.
    n = cascade.MIN_PREFIX_TOKENS

    def alone(name: str, num_computed: int, first_block: int) -> CachedRequestState:
        return state(name, list(range(first_block, first_block + num_computed // BS + 1)), num_computed)

    blocks = list(range(1, 1 + 2048 // BS))
    group = [state(f"r{i}", blocks + [5000 + i], 2048 + 3) for i in range(cascade.MIN_GROUP_SIZE + 1)]
    extra = [alone("long", 4 * n + 2, 10000), alone("short", n - 1, 20000), alone("just", n, 30000),
             alone("chunk", 4 * n, 40000)]
    num_scheduled = [1] * len(group) + [1, 1, 1, 5]  # "chunk" computes a prompt chunk: not a decode row
    g = len(group)
    for mode in (None, True):
        plan = CascadePlanner(mode, BS).plan(group + extra, num_scheduled)
        assert plan.prefix_lens.tolist() == [2048, 4 * n, n]  # whole blocks computed, longest first
        assert plan.prefix_rows.tolist() == [0, g, g + 2]
        assert plan.kv_start.tolist() == [2048] * g + [4 * n, 0, n, 0]
        assert plan.rows.tolist() == list(range(g)) + [g, g + 2]
        assert plan.row_start.tolist() == [0, g, g + 1, g + 2]
    # more of them than the step has groups for: plain attention, unless forced (the rest stay in the suffix)
    many = [alone(f"long{i}", n + i, 10000 * (i + 1)) for i in range(cascade.MAX_GROUPS)]
    planner = CascadePlanner(None, BS)
    with caplog.at_level(logging.INFO, logger="fastllm.worker.cascade"):
        assert planner.plan(group + many, [1] * (g + len(many))) is None
        assert planner.plan(group + many, [1] * (g + len(many))) is None
    assert sum("long contexts of their own" in r.getMessage() for r in caplog.records) == 1
    plan = CascadePlanner(True, BS).plan(group + many, [1] * (g + len(many)))
    assert len(plan.prefix_lens) == cascade.MAX_GROUPS and plan.kv_start[g] == 0  # the shortest is left alone
    assert planner.plan(group + many[:cascade.MAX_GROUPS - 1], [1] * (g + cascade.MAX_GROUPS - 1)) is not None


def test_windows_that_bite_on_every_layer_plan_nothing():
    states = [state("a", [5, 6, 7], 12), state("b", [5, 6, 8], 12)]
    assert CascadePlanner(True, BS, (8, 8)).plan(states, [1, 1]) is None  # every layer reads only 8 keys
    assert CascadePlanner(True, BS, (8, None)).plan(states, [1, 1]) is not None  # a full layer cascades
    assert CascadePlanner(True, BS, (64, 64)).plan(states, [1, 1]) is not None  # the window does not bite


@pytest.mark.parametrize("bad", ["yes", 1, 0])
def test_config_rejects_other_values(bad):
    from fastllm.config import CacheConfig

    with pytest.raises(ValueError, match="cascade_attention"):
        CacheConfig(cascade_attention=bad)


def test_plan_arrays_are_int32():
    plan = CascadePlanner(True, BS).plan([state("a", [5, 6], 8), state("b", [5, 6], 8)], [1, 1])
    assert all(a.dtype == np.int32 for a in plan.arrays())


def test_graph_inputs_hold_a_padded_plan():
    # a decode step's plan through the graph runner's staging (no-replay mode: the same buffers and code
    # around the forward, without capture) gives the forward the plain path's plan, padded
    import torch

    from fastllm.worker.attn_metadata import get_attn_metadata
    from fastllm.worker.input_batch import build_step_inputs
    from fastllm.worker.staging import StepInputStager
    from tests.worker.test_graph_staging import graph_runner

    dev = torch.device("cpu")
    runner, seen = graph_runner(dev)
    runner.enable_cascade()
    forward = runner.forward

    def recording(input_ids, positions):
        seen["cascade"] = get_attn_metadata().cascade
        return forward(input_ids, positions)

    runner.forward = recording
    states = [state("a", [5, 6, 7], 10), state("b", [9], 3), state("c", [5, 6, 8], 9)]
    plan = CascadePlanner(True, BS).plan(states, [1, 1, 1])
    staged = build_step_inputs(states, [1, 1, 1], BS, 50, None, StepInputStager(dev), graph=runner, cascade=plan)
    assert staged.cascade_in_graph and not staged.sampled_in_graph
    runner.replay_staged(3, staged.logits_indices, cascade=True)
    got = seen["cascade"]
    bs = runner.padded_size(3)
    assert got.kv_start.tolist() == [8, 0, 8] + [0] * (bs - 3)
    assert got.rows.tolist() == [0, 2] + [-1] * (bs - 2)
    assert got.prefix_rows.tolist()[:1] == [0] and got.prefix_lens.tolist() == [8] + [0] * (cascade.MAX_GROUPS - 1)
    assert got.row_start.tolist() == [0, 2] + [2] * (cascade.MAX_GROUPS - 1)  # empty groups after the first
    assert got.max_group_rows == bs
    runner.replay_staged(3, staged.logits_indices)  # a plain step after it: no cascade metadata
    assert seen["cascade"] is None
