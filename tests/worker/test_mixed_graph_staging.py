"""A prefill or mixed step staged for a mixed-step CUDA graph (compile/mixed_graphs.py): its inputs land in
its token bucket's static buffers, padded, and the graph's forward sees the same batch as the ordinary
unpadded path (tokens still on the device included), plus padding that no request owns. The runners run in
their no-replay mode (the same buffers and code around the forward, without capture), so this runs on the
CPU too."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastllm.compile.cuda_graphs import CUDAGraphRunner
from fastllm.compile.mixed_graphs import MixedGraphRunner, token_buckets
from fastllm.kernels.prefill_tiles import build_tile_map
from fastllm.sampling_params import SamplingParams
from fastllm.worker.async_output import AsyncRunnerOutput
from fastllm.worker.attn_metadata import get_attn_metadata, leading_decodes
from fastllm.worker.input_batch import CachedRequestState, build_step_inputs
from fastllm.worker.staging import StepInputStager

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BLOCK, MAX_BLOCKS, VOCAB, MAX_SEQS = 4, 16, 50, 6
LAYERS = [SimpleNamespace(num_heads=8, num_kv_heads=2)]  # GQA 4: 16 query tokens a tile


def runners(device, buckets=(16, 32, 64)):
    seen = {}

    def forward(input_ids, positions):
        md = get_attn_metadata()
        seen.update(ids=input_ids.clone(), positions=positions.clone(), slots=md.slot_mapping.clone(),
                    seq_lens=md.seq_lens.clone(), qsl=md.query_start_loc.clone(),
                    tables=md.block_tables.clone(), tile_map=md.tile_map.clone(),
                    max_query_len=md.max_query_len, decode_rows=md.decode_rows.seq_lens.clone())
        return input_ids.float().unsqueeze(1) * 10  # each row's "hidden state": its input token, scaled

    decode = CUDAGraphRunner(forward, None, LAYERS, [1, 2, 4, 8], MAX_BLOCKS, MAX_BLOCKS * BLOCK, VOCAB,
                             torch.float32, device)
    mixed = MixedGraphRunner(forward, LAYERS, list(buckets), MAX_SEQS, MAX_BLOCKS, MAX_BLOCKS * BLOCK, decode,
                             device)
    mixed.replay = False
    return mixed, seen


def mixed_requests(rng, chunks: list[int], pending: int):
    """A decoding request per 0 in chunks (the first `pending` with their newest token still on the
    device), a prompt prefilling that many tokens (over a cached prefix of a few tokens) per other entry."""
    states = []
    for i, chunk in enumerate(chunks):
        prompt = rng.integers(1, VOCAB, int(rng.integers(chunk + 1, chunk + 9))).tolist()
        output = rng.integers(1, VOCAB, int(rng.integers(1, 4))).tolist() if chunk == 0 else []
        in_flight = chunk == 0 and i < pending
        total = len(prompt) + len(output) + in_flight
        blocks = rng.permutation(np.arange(1, 64))[:-(-total // BLOCK)].tolist()
        computed = total - 1 if chunk == 0 else len(prompt) - chunk
        state = CachedRequestState(f"r{i}", prompt, output, SamplingParams(temperature=0), None, blocks,
                                   computed)
        state.num_pending = int(in_flight)
        states.append(state)
    return states


def previous_step(rng, states, device):
    """The in-flight output of the step before: it sampled the pending requests' newest tokens (and others'
    that are gone), in a shuffled order."""
    pending = [s for s in states if s.num_pending]
    others = [CachedRequestState(f"gone{j}", [1], [], SamplingParams(), None, [1], 0) for j in range(2)]
    prev = [(pending + others)[j] for j in rng.permutation(len(pending) + 2)]
    sampled = torch.tensor(rng.integers(1, VOCAB, len(prev)), device=device)
    return AsyncRunnerOutput([s.req_id for s in prev], prev, sampled)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunks,pending",
                         [([9], 0), ([0, 0, 7, 0], 2), ([0, 5, 0, 20, 0, 1], 3), ([30, 0], 1)],
                         ids=["prefill", "mixed", "many", "two-buckets-up"])
def test_mixed_graph_sees_the_plain_batch(device, chunks, pending):
    dev = torch.device(device)
    rng = np.random.default_rng(sum(chunks) + pending)
    states = mixed_requests(rng, chunks, pending)
    in_flight = previous_step(rng, states, dev) if pending else None
    counts = [c or 1 for c in chunks]
    args = (states, counts, BLOCK, VOCAB, None)
    plain = build_step_inputs(*args, StepInputStager(dev), in_flight)
    mixed, seen = runners(dev)
    num_tokens, num_reqs = sum(counts), len(states)
    assert mixed.fits(num_tokens, in_flight.sampled if in_flight else None, None)
    staged = build_step_inputs(*args, StepInputStager(dev), in_flight, mixed_graph=mixed)
    assert staged.staged_for_mixed_graph and staged.attn_metadata is None and staged.input_ids is None
    assert [s.req_id for s in staged.sample_states] == [s.req_id for s in plain.sample_states]
    if plain.logits_indices is None:
        assert staged.logits_indices is None
    else:
        assert staged.logits_indices.tolist() == plain.logits_indices.tolist()
    hidden = mixed.replay_staged(num_tokens)
    bucket = mixed.bucket(num_tokens)
    assert hidden.shape[0] == num_tokens and seen["ids"].shape[0] == bucket
    md = plain.attn_metadata
    want = {"ids": plain.input_ids, "positions": plain.positions, "slots": md.slot_mapping}
    for name, value in want.items():
        torch.testing.assert_close(seen[name][:num_tokens], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(hidden[:, 0], plain.input_ids.float() * 10)  # the in-flight tokens included
    num_seqs = min(bucket, MAX_SEQS)
    assert seen["seq_lens"].tolist() == md.seq_lens.tolist() + [0] * (num_seqs - num_reqs)
    assert seen["qsl"].tolist() == md.query_start_loc.tolist() + [num_tokens] * (num_seqs - num_reqs)
    width = min(md.block_tables.shape[1], seen["tables"].shape[1])  # the plain step's is padded (aligned)
    torch.testing.assert_close(seen["tables"][:num_reqs, :width], md.block_tables[:, :width], rtol=0, atol=0)
    assert not md.block_tables[:, width:].any()
    # the leading decodes are the decode kernel's rows (the plain step's too, beside a prefill), not tiles
    decodes = leading_decodes(counts)
    assert decodes == next(i for i, c in enumerate(counts + [0]) if c != 1)
    lens = md.seq_lens.tolist()
    assert seen["decode_rows"].tolist() == lens[:decodes] + [0] * (num_seqs - decodes)
    if 0 < decodes < num_reqs:
        rows = md.decode_rows
        assert rows.count == decodes and rows.seq_lens.tolist() == lens[:decodes] and not rows.in_graph
        assert rows.rest_seq_lens.tolist() == lens[decodes:]
        assert rows.rest_query_start_loc.tolist() == md.query_start_loc.tolist()[decodes:]
        assert torch.equal(rows.rest_block_tables, md.block_tables[decodes:])
        for rest in (rows.rest_block_tables, rows.rest_seq_lens, rows.rest_query_start_loc):
            assert rest.data_ptr() % 16 == 0, "Triton compiles another variant for unaligned pointers"
    else:
        assert md.decode_rows is None
    tiled = np.array(counts)
    tiled[:decodes] = 0
    want_map = build_tile_map(tiled, md.seq_lens.cpu().numpy(), 16, seen["tile_map"].shape[0])
    assert seen["tile_map"].tolist() == want_map.tolist()
    # padding tokens write nothing and the attention grid is the bucket's, whatever the step's longest chunk
    assert (seen["slots"][num_tokens:] == -1).all() and seen["max_query_len"] == bucket


def test_buckets_are_padded_to_and_steps_too_large_refused(caplog):
    assert token_buckets(512) == [16, 32, 64, 128, 256, 384, 512]
    assert token_buckets(300) == [16, 32, 64, 128, 256, 300] and token_buckets(16) == [16]
    assert token_buckets(24) == [16, 24]
    mixed, _ = runners(torch.device("cpu"))
    assert [mixed.bucket(n) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    with caplog.at_level("INFO", logger="fastllm.compile.mixed_graphs"):
        assert not mixed.fits(65, None, None) and not mixed.fits(100, None, None)
        assert not mixed.fits(20, None, cascade=object())
        assert not mixed.fits(20, torch.zeros(9, dtype=torch.int64), None)  # 9 in-flight rows > argmax's 8
        assert mixed.fits(64, torch.zeros(8, dtype=torch.int64), None)
    said = [r.message for r in caplog.records]
    assert len(said) == 3 and "more than 64 tokens" in said[0] and "cascade" in said[1], said


def test_a_smaller_step_after_a_larger_one():
    """Buckets share the static buffers: a small step after a large one sees none of its inputs, and the
    graphs' table rows it uses are its own."""
    dev = torch.device("cpu")
    mixed, seen = runners(dev)
    rng = np.random.default_rng(3)
    large = mixed_requests(rng, [20, 0, 0, 25, 0, 0], 0)
    build_step_inputs(large, [20, 1, 1, 25, 1, 1], BLOCK, VOCAB, None, StepInputStager(dev),
                      mixed_graph=mixed)
    mixed.replay_staged(49)
    small = mixed_requests(rng, [3, 0], 0)
    plain = build_step_inputs(small, [3, 1], BLOCK, VOCAB, None, StepInputStager(dev))
    build_step_inputs(small, [3, 1], BLOCK, VOCAB, None, StepInputStager(dev), mixed_graph=mixed)
    mixed.replay_staged(4)
    assert seen["ids"][:4].tolist() == plain.input_ids.tolist() and (seen["slots"][4:] == -1).all()
    assert seen["seq_lens"].tolist()[:2] == plain.attn_metadata.seq_lens.tolist()
    assert (seen["tile_map"][2:] == -1).all()  # 3 tokens and 1 token: one tile each
