"""A decode step staged for a CUDA graph: the inputs land in the graph runner's static buffers,
padded to the replay size, and the graph's forward sees the same batch as the ordinary unpadded
path, tokens still on the device included. The runner runs in its no-replay mode (the same buffers
and code around the forward, without capture), so this runs on the CPU too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastllm.compile.cuda_graphs import CUDAGraphRunner
from fastllm.sampling_params import SamplingParams
from fastllm.worker.async_output import AsyncRunnerOutput
from fastllm.worker.attn_metadata import get_attn_metadata
from fastllm.worker.input_batch import CachedRequestState, build_step_inputs
from fastllm.worker.staging import StepInputStager

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BLOCK, MAX_BLOCKS, VOCAB = 4, 8, 50



def same_tables(graph_tables: torch.Tensor, plain_tables: torch.Tensor) -> None:
    """The graph's table rows hold the plain step's, whose width is padded (input_batch.aligned_tables)."""
    width = min(graph_tables.shape[1], plain_tables.shape[1])
    torch.testing.assert_close(graph_tables[:, :width], plain_tables[:, :width], rtol=0, atol=0)
    assert not plain_tables[:, width:].any()

def graph_runner(device):
    seen = {}

    def forward(input_ids, positions):
        md = get_attn_metadata()
        seen.update(ids=input_ids.clone(), positions=positions.clone(), slots=md.slot_mapping.clone(),
                    seq_lens=md.seq_lens.clone(), tables=md.block_tables.clone())
        return input_ids.float().unsqueeze(1)  # each row's "hidden state" is its input token

    def compute_logits(hidden, out):  # one-hot of the input token: a row's argmax is its input
        return out.zero_().scatter_(1, hidden.long(), 1.0)

    runner = CUDAGraphRunner(forward, compute_logits, [], [1, 2, 4, 8], MAX_BLOCKS, MAX_BLOCKS * BLOCK, VOCAB,
                             torch.float32, device)
    runner.graphs = dict.fromkeys(runner.sizes)  # as if captured; replay=False never touches them
    runner.replay = False
    return runner, seen


def decoding_requests(rng, num, pending):
    """num requests in decode; the first `pending` have their newest token still on the device."""
    states = []
    for i in range(num):
        prompt = rng.integers(1, VOCAB, int(rng.integers(1, 20))).tolist()
        output = rng.integers(1, VOCAB, int(rng.integers(1, 5))).tolist()
        total = len(prompt) + len(output) + (i < pending)
        blocks = rng.permutation(np.arange(1, 64))[:-(-total // BLOCK)].tolist()
        state = CachedRequestState(f"r{i}", prompt, output, SamplingParams(temperature=0), None, blocks,
                                   num_computed_tokens=total - 1)
        state.num_pending = int(i < pending)
        states.append(state)
    return states


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num,pending", [(1, 0), (1, 1), (3, 2), (8, 8)])
def test_graph_sees_the_plain_batch(device, num, pending):
    dev = torch.device(device)
    rng = np.random.default_rng(10 * num + pending)
    states = decoding_requests(rng, num, pending)
    in_flight = None
    if pending:  # the previous step sampled these rows, in a shuffled order, with more rows than now
        extra = min(2, 8 - num)
        order = rng.permutation(num + extra)
        sampled = torch.tensor(rng.integers(1, VOCAB, num + extra), device=dev)
        others = [CachedRequestState(f"gone{j}", [1], [], SamplingParams(), None, [1], 0) for j in range(extra)]
        prev_states = [(states + others)[j] for j in order]
        in_flight = AsyncRunnerOutput([s.req_id for s in prev_states], prev_states, sampled)
    args = (states, [1] * num, BLOCK, VOCAB, None)
    plain = build_step_inputs(*args, StepInputStager(dev), in_flight)
    runner, seen = graph_runner(dev)
    assert runner.fits([1] * num, in_flight.sampled if in_flight else None)
    staged = build_step_inputs(*args, StepInputStager(dev), in_flight, graph=runner)
    assert staged.staged_for_graph and staged.attn_metadata is None
    assert len(staged.sample_states) == num and staged.sampling_metadata.argmax_only
    runner.replay_staged(num)
    bs = runner.padded_size(num)
    md = plain.attn_metadata
    want = {"ids": plain.input_ids, "positions": plain.positions, "slots": md.slot_mapping,
            "seq_lens": md.seq_lens}
    for name, value in want.items():
        torch.testing.assert_close(seen[name][:num], value, rtol=0, atol=0, msg=name)
    same_tables(seen["tables"][:num], md.block_tables)
    # padding rows up to the replay size are harmless: no KV write (slot -1), one token of the null block
    assert (seen["slots"][num:bs] == -1).all() and (seen["seq_lens"][num:bs] == 1).all()
    assert (seen["tables"][num:bs] == 0).all() and seen["ids"].shape[0] == bs


def test_previous_step_too_wide_for_the_graph_is_not_staged():
    runner, _ = graph_runner(torch.device("cpu"))
    assert not runner.fits([1, 1], torch.zeros(9, dtype=torch.int64))  # 9 rows > argmax's 8
    assert not runner.fits([1, 2], None) and not runner.fits([1] * 9, None)


@pytest.mark.parametrize("device", DEVICES)
def test_one_token_prefill_chunk_does_not_sample(device):
    """Every request has one token this step, but one of them is a chunk of its prompt: it replays
    the graph, and only the others get a token."""
    dev = torch.device(device)
    states = decoding_requests(np.random.default_rng(5), 3, 0)
    prompt = list(range(1, 11))
    states.insert(1, CachedRequestState("prefilling", prompt, [], SamplingParams(temperature=0), None, [9, 10, 11],
                                        num_computed_tokens=3))
    args = (states, [1] * 4, BLOCK, VOCAB, None)
    plain = build_step_inputs(*args, StepInputStager(dev))
    runner, seen = graph_runner(dev)
    staged = build_step_inputs(*args, StepInputStager(dev), graph=runner)
    assert [s.req_id for s in staged.sample_states] == ["r0", "r1", "r2"]  # not "prefilling", row 1
    assert staged.logits_indices.tolist() == plain.logits_indices.tolist() == [0, 2, 3]
    logits, greedy = runner.replay_staged(4, staged.logits_indices)
    assert logits.shape[0] == 3
    torch.testing.assert_close(greedy, plain.input_ids[plain.logits_indices], rtol=0, atol=0)
    assert seen["ids"][1].item() == prompt[3]  # the chunk's token went through the graph too


def test_a_narrower_step_keeps_the_graph_tables_right():
    """Only the step's own block-table width is staged: after a wide step, a narrower one still
    gives every row its blocks (older ids linger only past a row's length) and padding the null block."""
    dev = torch.device("cpu")
    runner, seen = graph_runner(dev)
    rng = np.random.default_rng(7)
    wide = decoding_requests(rng, 5, 0)
    build_step_inputs(wide, [1] * 5, BLOCK, VOCAB, None, StepInputStager(dev), graph=runner)
    runner.replay_staged(5)
    narrow = [CachedRequestState(f"n{i}", [3, 4], [], SamplingParams(temperature=0), None, [20 + i], 1)
              for i in range(3)]
    build_step_inputs(narrow, [1] * 3, BLOCK, VOCAB, None, StepInputStager(dev), graph=runner)
    runner.replay_staged(3)
    assert seen["tables"][:3, 0].tolist() == [20, 21, 22] and seen["tables"][3, 0].item() == 0
    assert seen["slots"].tolist() == [20 * BLOCK + 1, 21 * BLOCK + 1, 22 * BLOCK + 1, -1]


def _sampling_step(dev, params, num=4, sample_seed=0):
    """A decode step of `num` requests with these params (one per row, cycled) through the graph runner."""
    states = decoding_requests(np.random.default_rng(3), num, 0)
    for i, state in enumerate(states):
        state.sampling_params = params[i % len(params)]
    args = (states, [1] * num, BLOCK, VOCAB, None)
    plain = build_step_inputs(*args, StepInputStager(dev))
    runner, seen = graph_runner(dev)
    staged = build_step_inputs(*args, StepInputStager(dev), graph=runner)
    torch.manual_seed(sample_seed)
    _, tokens = runner.replay_staged(num, staged.logits_indices, sampling=staged.sampled_in_graph)
    return runner, seen, plain, staged, tokens


@pytest.mark.parametrize("device", DEVICES)
def test_graph_draws_the_tokens_of_unseeded_sampling(device):
    """Temperature / top-k / top-p / min-p rows sample in the graph (their params staged beside the inputs,
    the block tables after them); greedy rows in the same step keep their argmax. With top-k 1, a tiny
    top-p or a min-p of 1 every draw is the argmax, whatever the noise."""
    dev = torch.device(device)
    params = [SamplingParams(temperature=0.9, top_k=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.5, top_p=1e-6), SamplingParams(temperature=0.7, min_p=1.0)]
    for seed in range(5):
        runner, seen, plain, staged, tokens = _sampling_step(dev, params, sample_seed=seed)
        assert staged.sampled_in_graph and staged.sampling_metadata is None  # no sampler tensors built
        torch.testing.assert_close(tokens, plain.input_ids, rtol=0, atol=0)  # the one-hot logits' argmax
        md = plain.attn_metadata
        same_tables(seen["tables"][:4], md.block_tables)
        temperature, top_k, top_p, min_p = runner.sampling_params[:, :4].tolist()
        assert temperature == [pytest.approx(0.9), 0.0, 1.5, pytest.approx(0.7)]
        assert top_k == [1, VOCAB, VOCAB, VOCAB] and top_p[2] == pytest.approx(1e-6) and min_p[3] == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_graph_sampling_draws_from_the_distribution(device):
    """Unfiltered temperature-1 rows draw every token: on one-hot logits (e vs 1 for the other 49 tokens)
    the hot token comes up ~5% of the time, never all the time."""
    dev = torch.device(device)
    hits, draws = 0, 0
    for seed in range(25):
        _, _, plain, staged, tokens = _sampling_step(dev, [SamplingParams(temperature=1.0)], num=8, sample_seed=seed)
        hits += (tokens == plain.input_ids).sum().item()
        draws += tokens.numel()
        assert ((0 <= tokens) & (tokens < VOCAB)).all()
    assert 0.01 < hits / draws < 0.15, hits / draws  # p = e / (e + 49) = 0.053


def test_large_batches_sample_outside_the_graph(monkeypatch):
    """Above MAX_SAMPLING_GRAPH_SIZE the graph only computes the logits: sampling graphs' temporaries stay
    in the pool, which the KV sizing did not see."""
    import fastllm.compile.cuda_graphs as cuda_graphs

    monkeypatch.setattr(cuda_graphs, "MAX_SAMPLING_GRAPH_SIZE", 2)
    params = [SamplingParams(temperature=0.7)]
    assert _sampling_step(torch.device("cpu"), params, num=2)[3].sampled_in_graph
    _, seen, plain, staged, _ = _sampling_step(torch.device("cpu"), params, num=3)  # padded to 4
    assert not staged.sampled_in_graph and staged.sampling_metadata is not None
    md = plain.attn_metadata
    same_tables(seen["tables"][:3], md.block_tables)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, logprobs=2),
                                    SamplingParams(temperature=0.8, presence_penalty=0.5),
                                    SamplingParams(temperature=0.8, min_tokens=3),
                                    SamplingParams(temperature=0.8, logit_bias={3: 1.0}),
                                    SamplingParams(temperature=0.8, allowed_token_ids=[1, 2]),
                                    SamplingParams(temperature=0.8, bad_words=["x"])])
def test_graph_leaves_other_sampling_to_the_sampler(params):
    """A seeded row (its own generator), logprobs, penalties, min_tokens or a logits filter: the graph only
    computes the logits (no params staged), and the sampler draws outside it."""
    _, seen, plain, staged, _ = _sampling_step(torch.device("cpu"), [SamplingParams(temperature=0.5), params])
    assert not staged.sampled_in_graph and not staged.sampling_metadata.argmax_only
    md = plain.attn_metadata
    same_tables(seen["tables"][:4], md.block_tables)
