"""The batched step's staged inputs: every position a step can write, start .. start + 2k, with its KV slot
(-1 past what the request holds), clamped position and length, as the host computes them; and where
stage() puts them (the verify rows' copies, the span arrays the draft's rows are gathered from)."""

from __future__ import annotations

import numpy as np
import torch

from fastllm.spec_decode.batched_step import ModelFns, SpecDecodeStep
from fastllm.worker.staging import StepInputStager

K, BLOCK, MAX_LEN, WIDTH = 3, 4, 40, 10


def make_step() -> SpecDecodeStep:
    unused = ModelFns(None, None, [])
    return SpecDecodeStep(unused, None, K, [1, 2, 4, 8], WIDTH, MAX_LEN, BLOCK, 16, torch.device("cpu"))


def requests(rng, num: int):
    held = rng.integers(1, WIDTH + 1, num)
    start = np.array([rng.integers(0, h * BLOCK) for h in held], dtype=np.int64)
    tables = np.zeros((num, int(held.max())), dtype=np.int32)
    for i, h in enumerate(held):
        tables[i, :h] = rng.permutation(100)[:h]
    return start, held * BLOCK, tables


def test_span_rows_are_each_positions_slot_position_and_length():
    step, rng = make_step(), np.random.default_rng(0)
    for num in (1, 3, 8):
        start, kv_limit, tables = requests(rng, num)
        slots, positions, lens = step.span_rows(start, kv_limit, tables)
        assert slots.shape == positions.shape == lens.shape == (step.max_bs, 2 * K + 1)
        assert lens.dtype == np.int32
        for b in range(step.max_bs):
            for i in range(2 * K + 1):
                p = (start[b] if b < num else 0) + i
                held = b < num and p < kv_limit[b]
                want = int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK if held else -1
                got = (slots[b, i], positions[b, i], lens[b, i])
                assert got == (want, min(p, MAX_LEN - 1), p + 1), (b, i)


def test_stage_puts_the_verify_rows_and_the_span_where_the_step_reads_them():
    step, rng = make_step(), np.random.default_rng(1)
    num = 3
    start, kv_limit, tables = requests(rng, num)
    padded = step.padded_size(num)
    tables = np.concatenate([tables, np.zeros((padded - num, tables.shape[1]), np.int32)])
    tokens = rng.integers(0, 16, (num, K + 1))
    prev_row = np.array([-1, 0, -1])
    step.stage(StepInputStager(torch.device("cpu")), tokens, start, np.full(num, K), kv_limit,
               np.zeros(num, np.int64), prev_row, None, tables)
    slots, positions, lens = (torch.from_numpy(a) for a in step.span_rows(start, kv_limit, tables))
    assert torch.equal(step.span_slots_positions, torch.stack([slots, positions]))
    assert torch.equal(step.span_lens, lens)
    assert torch.equal(step.verify_slots, slots[:, :K + 1])
    assert torch.equal(step.verify_positions, positions[:, :K + 1])
    assert torch.equal(step.verify_lens, lens[:, :K + 1])
    assert torch.equal(step.tokens[:num], torch.from_numpy(tokens)) and not step.tokens[num:].any()
    assert step.num_drafts[:num].tolist() == [K] * num and step.prev_row.tolist()[:num] == prev_row.tolist()
    assert torch.equal(step.block_tables[:padded, :tables.shape[1]], torch.from_numpy(tables))
