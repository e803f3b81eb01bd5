"""flat_positions against a per-token construction: decode batches (one token each, their own
path) and mixed ones (prefill chunks beside decodes)."""

from __future__ import annotations

import numpy as np
import pytest

from fastllm.worker.input_batch import flat_positions


def per_token(starts, counts, block_tables, block_size):
    query_start_loc, positions, slots = [0], [], []
    for row, (start, count) in enumerate(zip(starts, counts)):
        for pos in range(start, start + count):
            positions.append(pos)
            slots.append(int(block_tables[row, pos // block_size]) * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + count)
    return query_start_loc, positions, slots


@pytest.mark.parametrize("decode", [True, False])
def test_flat_positions_match_a_per_token_build(decode):
    rng = np.random.default_rng(int(decode))
    for _ in range(100):
        num_reqs, block_size = int(rng.integers(1, 12)), int(rng.choice([1, 4, 16]))
        counts = np.ones(num_reqs, np.int64) if decode else rng.integers(1, 9, num_reqs)
        starts = rng.integers(0, 40, num_reqs)
        width = -(-int((starts + counts).max()) // block_size)
        tables = rng.integers(1, 1000, (num_reqs, width)).astype(np.int32)
        qsl, positions, slots = flat_positions(starts, counts, tables, block_size)
        want = per_token(starts.tolist(), counts.tolist(), tables, block_size)
        assert qsl.dtype == np.int32 and positions.dtype == np.int64 and slots.dtype == np.int64
        assert (qsl.tolist(), positions.tolist(), slots.tolist()) == want
