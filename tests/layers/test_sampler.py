"""The sampler's logits processing against plain-Python references: logit_bias, allowed_token_ids,
bad_words and the min_tokens mask (vLLM's semantics and order), and the penalties on exact values."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fastllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow, process_logits
from fastllm.sampling_params import SamplingParams

VOCAB = 12
EOS = 2
NEG_INF = float("-inf")


def processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    metadata = SamplingMetadata.build(rows, logits.shape[-1], logits.device)
    return process_logits(logits, metadata)


def reference(logits: list[float], row: SamplingRow) -> list[float]:
    """One row, processed as vLLM's sampler does, element by element."""
    p, out = row.params, row.output_token_ids
    x = list(logits)
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else NEG_INF for t, v in enumerate(x)]
    for word in p.bad_words_token_ids:
        n = len(word) - 1
        if n <= len(out) and (n == 0 or out[-n:] == word[:-1]):
            x[word[-1]] = NEG_INF
    if p.min_tokens and len(out) < p.min_tokens:
        for t in [*p.stop_token_ids, *([row.eos_token_id] if not p.ignore_eos else [])]:
            x[t] = NEG_INF
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    seen_out = set(out)
    seen = seen_out | set(row.prompt_token_ids)
    for t in range(len(x)):
        if t in seen and p.repetition_penalty != 1:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty * (t in seen_out)
    return x


def bad_words_params(words: list[list[int]], **kw) -> SamplingParams:
    params = SamplingParams(bad_words=["x"] * len(words), **kw)
    params._bad_words_token_ids = words  # as tokenize_bad_words would leave them
    return params


def random_params(rng: random.Random) -> SamplingParams:
    kw = {}
    if rng.random() < 0.5:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(rng.randint(1, 4))}
    if rng.random() < 0.4:
        kw["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randint(1, 6))
    if rng.random() < 0.5:
        kw["min_tokens"] = rng.randint(1, 6)
    if rng.random() < 0.6:
        kw.update(repetition_penalty=rng.uniform(0.5, 2), frequency_penalty=rng.uniform(-2, 2),
                  presence_penalty=rng.uniform(-2, 2))
    words = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(0, 3))]
    params = bad_words_params(words, **kw) if words else SamplingParams(**kw)
    return params


def test_processing_matches_the_reference_on_random_rows():
    rng = random.Random(0)
    for _ in range(40):
        rows = []
        for _ in range(4):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
            output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
            rows.append(SamplingRow(random_params(rng), None, prompt, output, EOS))
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(1000))) * 3
        got = processed(logits, rows)
        for i, row in enumerate(rows):
            want = torch.tensor(reference(logits[i].tolist(), row))
            torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)  # -inf where the reference has it


def test_greedy_sample_is_the_reference_argmax():
    rng = random.Random(1)
    sampler = Sampler()
    for _ in range(20):
        rows = [SamplingRow(random_params(rng).clone(temperature=0.0), None, [1, 3], [rng.randrange(VOCAB)], EOS)
                for _ in range(3)]
        logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(1000)))
        sampled = sampler(logits, SamplingMetadata.build(rows, VOCAB, logits.device)).sampled.tolist()
        for i, row in enumerate(rows):
            ref = reference(logits[i].tolist(), row)
            assert sampled[i] == max(range(VOCAB), key=lambda t: ref[t])


def test_random_draws_respect_the_masks():
    """Sampled (not greedy) rows never draw a masked token."""
    params = bad_words_params([[5], [1, 7]], temperature=1.0, allowed_token_ids=[3, 5, 7, 9])
    row = SamplingRow(params, None, [0], [4, 1], EOS)
    metadata = SamplingMetadata.build([row] * 64, VOCAB, torch.device("cpu"))
    drawn = set(Sampler()(torch.zeros(64, VOCAB), metadata).sampled.tolist())
    assert drawn == {3, 9}  # 5 is a bad word, 7 completes [1, 7] after the output's 1


def test_bad_words_mask_only_the_completing_token():
    words = [[4], [6, 8], [1, 2, 3]]
    cases = [([], {4}), ([6], {4, 8}), ([0, 1, 2], {4, 3}), ([1, 2, 6], {4, 8}), ([2, 1], {4})]
    for output, masked in cases:
        row = SamplingRow(bad_words_params(words), None, [6, 1, 2], output, None)  # the prompt does not count
        got = processed(torch.zeros(1, VOCAB), [row])[0]
        assert {t for t in range(VOCAB) if got[t] == NEG_INF} == masked, output


def test_logit_bias_and_allowed_ids_exact_values():
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.25, 0.0] + [0.0] * (VOCAB - 6)])
    row = SamplingRow(SamplingParams(logit_bias={1: 4.0, 3: -1.5, 5: 0.75}, allowed_token_ids=[1, 2, 3, 5]),
                      None, [0], [], EOS)
    got = processed(logits, [row])[0].tolist()
    assert got[:6] == [NEG_INF, 2.0, 0.5, 1.5, NEG_INF, 0.75]
    assert all(v == NEG_INF for v in got[6:])


def test_penalties_exact_values():
    """Repetition divides positive logits and multiplies negative ones (prompt and output tokens);
    frequency subtracts per occurrence in the output, presence once; prompt tokens get neither."""
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0, 1.0] + [0.0] * (VOCAB - 6)])
    prompt, output = [0, 1], [2, 3, 3, 3]
    cases = {
        (2.0, 0.0, 0.0): [1.0, -2.0, 0.25, -6.0, 4.0, 1.0],
        (1.0, 0.5, 0.0): [2.0, -1.0, 0.0, -4.5, 4.0, 1.0],  # frequency: 1 x 0.5 and 3 x 0.5
        (1.0, 0.0, 0.5): [2.0, -1.0, 0.0, -3.5, 4.0, 1.0],  # presence: 0.5 whatever the count
        (1.0, -0.5, 0.0): [2.0, -1.0, 1.0, -1.5, 4.0, 1.0],  # negative penalties reward repeats
        (2.0, 0.25, 1.0): [1.0, -2.0, -1.0, -7.75, 4.0, 1.0],  # 0.25 - 0.25 - 1; -6 - 0.75 - 1
    }
    for (rep, freq, pres), want in cases.items():
        params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        got = processed(logits, [SamplingRow(params, None, prompt, output, EOS)])[0].tolist()
        assert got[:6] == pytest.approx(want, abs=1e-7), (rep, freq, pres)
        assert got[6:] == [0.0] * (VOCAB - 6)


def test_logit_bias_comes_before_the_repetition_penalty():
    """vLLM's order: a bias that makes a seen token's logit positive is then divided, not multiplied."""
    logits = torch.tensor([[-1.0] + [0.0] * (VOCAB - 1)])
    params = SamplingParams(logit_bias={0: 3.0}, repetition_penalty=2.0)
    got = processed(logits, [SamplingRow(params, None, [0], [], EOS)])[0, 0].item()
    assert got == 1.0  # (-1 + 3) / 2, not -1 * 2 + 3


def test_rows_without_filters_are_untouched():
    logits = torch.randn(2, VOCAB)
    rows = [SamplingRow(SamplingParams(), None, [0], [1], EOS),
            SamplingRow(SamplingParams(logit_bias={3: 1.0}), None, [0], [1], EOS)]
    got = processed(logits, rows)
    assert torch.equal(got[0], logits[0])
    assert got[1, 3] == logits[1, 3] + 1.0


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {1: math.inf}), ("logit_bias", {1: math.nan}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"1": 1.0}), ("logit_bias", [1, 2]), ("allowed_token_ids", []),
    ("allowed_token_ids", [-3]), ("allowed_token_ids", [True]), ("bad_words", [""]), ("bad_words", "word"),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_token_ids_are_checked_against_the_vocabulary():
    for field, value in (("logit_bias", {VOCAB: 1.0}), ("allowed_token_ids", [0, VOCAB + 5])):
        with pytest.raises(ValueError, match=f"SamplingParams.{field} has token ids outside the vocabulary"):
            SamplingParams(**{field: value}).check_token_ids(VOCAB)
    with pytest.raises(ValueError, match="SamplingParams.bad_words has token ids outside"):
        bad_words_params([[1, VOCAB]]).check_token_ids(VOCAB)
    SamplingParams(logit_bias={VOCAB - 1: 1.0}, allowed_token_ids=[0]).check_token_ids(VOCAB)


def test_filters_keep_requests_off_the_graph_sampling_paths():
    for params in (SamplingParams(temperature=0, logit_bias={1: 1.0}), SamplingParams(temperature=0, allowed_token_ids=[1]),
                   SamplingParams(temperature=0, bad_words=["a"])):
        assert not params.argmax_only and not params.samples_in_graph
        metadata = SamplingMetadata.build([SamplingRow(params, None, [0], [], EOS)], VOCAB, torch.device("cpu"))
        assert not metadata.argmax_only
    assert SamplingParams(temperature=0, bad_words=["a"]).reads_output_tokens


def test_beam_steps_give_the_general_paths_top_logprobs_and_argmax():
    """A batch of beam search steps (only the top N read) gives the same top ids and logprobs as the general
    logprobs path, its argmax as the sampled token, and the runner's readback has them as (None, None, pairs)."""
    from fastllm.sampling_params import BeamSearchParams
    from fastllm.worker.async_output import AsyncRunnerOutput, collect_logprobs
    from fastllm.worker.input_batch import CachedRequestState

    params = BeamSearchParams(3, 8).sampling_params()
    plain = SamplingParams(temperature=0.0, logprobs=6)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 4
    states = [CachedRequestState(f"b{i}", [1], [], params, None, [0], 0) for i in range(4)]
    metadata = SamplingMetadata.beam_rows(4, 6)
    assert metadata.beam_steps and not SamplingMetadata.build(
        [SamplingRow(plain, None, [1], [], EOS)] * 4, 50, logits.device).beam_steps
    beam = Sampler()(logits, metadata)
    general = Sampler()(logits, SamplingMetadata.build([SamplingRow(plain, None, [1], [], EOS)] * 4, 50, logits.device))
    assert len(beam.logprobs) == 2
    assert beam.sampled.tolist() == general.sampled.tolist() == logits.argmax(dim=-1).tolist()
    assert torch.equal(beam.logprobs[0], general.logprobs[2]) and torch.equal(beam.logprobs[1], general.logprobs[3])
    got = collect_logprobs(states, beam.logprobs)
    want = collect_logprobs(states, general.logprobs)
    assert got == {r: (None, None, pairs) for r, (_, _, pairs) in want.items()}
    # The runner's readback: each state's sampled token (its argmax, from the top ids) and its top pairs
    result = AsyncRunnerOutput([s.req_id for s in states], states, beam.sampled, beam.logprobs).result()
    assert result.sampled_token_ids == [[t] for t in logits.argmax(dim=-1).tolist()]
    assert result.logprobs == {r: [entry] for r, entry in got.items()}  # one entry per new token
    assert [s.output_token_ids for s in states] == result.sampled_token_ids


@pytest.mark.gpu
def test_beam_steps_on_the_gpu_give_the_general_paths_top_logprobs():
    """On the GPU (bf16 logits of a real vocabulary's size, as a beam step's graph gives them) the beam
    path's top ids and logprobs are the general path's, its sampled token the sampler's argmax."""
    params = SamplingParams(temperature=0.0, logprobs=8)
    logits = (torch.randn(4, 128256, generator=torch.Generator().manual_seed(0)) * 3).to("cuda", torch.bfloat16)
    beam = Sampler()(logits, SamplingMetadata.beam_rows(4, 8))
    general = Sampler()(logits, SamplingMetadata.build([SamplingRow(params, None, [1], [], EOS)] * 4, 128256,
                                                       logits.device))
    assert torch.equal(beam.logprobs[0], general.logprobs[2]) and torch.equal(beam.logprobs[1], general.logprobs[3])
    # (bf16 logits tie often: the argmax is the lowest of the tied ids, the top-1 id one of them)
    top = logits.float().max(dim=-1).values
    assert (logits.float().gather(1, beam.sampled[:, None]).squeeze(1) == top).all()
