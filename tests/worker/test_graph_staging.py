"""A decode step staged for a CUDA graph: the inputs land in the graph runner's static buffers,
padded to the replay size, and say the same as the ordinary unpadded batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastllm.sampling_params import SamplingParams
from fastllm.worker.input_batch import CachedRequestState, build_step_inputs
from fastllm.worker.staging import StepInputStager

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BLOCK, MAX_BLOCKS = 4, 8


class StaticBuffers:
    """The part of CUDAGraphRunner that staging uses, without capturing anything."""

    def __init__(self, sizes, device):
        from fastllm.compile.cuda_graphs import STATIC_I64_ROWS

        self.sizes, self.max_bs, self.max_blocks_per_seq = sizes, sizes[-1], MAX_BLOCKS
        n = self.max_bs
        self.static_i64 = torch.full((STATIC_I64_ROWS * n,), 7, dtype=torch.int64, device=device)  # stale
        self.static_i32 = torch.full((n + n * MAX_BLOCKS,), 7, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)

    def padded_size(self, num):
        return next(s for s in self.sizes if s >= num)


def decoding_requests(rng, num):
    states = []
    for i in range(num):
        prompt = rng.integers(1, 100, int(rng.integers(1, 20))).tolist()
        output = rng.integers(1, 100, int(rng.integers(1, 5))).tolist()
        total = len(prompt) + len(output)
        blocks = rng.permutation(np.arange(1, 64))[:-(-total // BLOCK)].tolist()
        states.append(CachedRequestState(f"r{i}", prompt, output, SamplingParams(temperature=0), None, blocks,
                                         num_computed_tokens=total - 1))
    return states


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num", [1, 3, 8])
def test_staged_inputs_match_the_plain_batch(device, num):
    dev = torch.device(device)
    states = decoding_requests(np.random.default_rng(num), num)
    args = (states, [1] * num, BLOCK, 100, None)
    plain = build_step_inputs(*args, StepInputStager(dev))
    graph = StaticBuffers([1, 2, 4, 8], dev)
    staged = build_step_inputs(*args, StepInputStager(dev), graph=graph)
    assert staged.staged_for_graph and not plain.staged_for_graph
    assert staged.logits_indices is None and plain.logits_indices is None  # every row samples
    for name in ("input_ids", "positions"):
        torch.testing.assert_close(getattr(staged, name), getattr(plain, name), rtol=0, atol=0)
    a, b = staged.attn_metadata, plain.attn_metadata
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
    # the views are the static buffers themselves, and the padding rows up to the replay size are
    # harmless: no KV write (slot -1), one token of the null block
    n, padded = graph.max_bs, graph.padded_size(num)
    ids, positions, slots = graph.static_i64[:3 * n].view(3, n)
    assert staged.input_ids.data_ptr() == ids.data_ptr()
    assert (slots[num:padded] == -1).all() and (ids[num:padded] == 0).all()
    lens, tables = graph.static_i32[:n], graph.static_i32[n:].view(n, MAX_BLOCKS)
    assert (lens[num:padded] == 1).all() and (tables[num:padded] == 0).all()
    assert (tables[:num, a.block_tables.shape[1]:] == 0).all()
