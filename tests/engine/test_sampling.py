"""Seeded sampling is reproducible whatever shares the batch; top-k / top-p / min-p only ever
emit tokens their rule allows, checked against the model's own logits."""

from __future__ import annotations

import pytest
import torch

from fastllm import SamplingParams
from tests.conftest import PROMPTS, STORIES, cached_llm, hf_logits


def test_same_seed_same_text_whatever_the_batch():
    llm = cached_llm()
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=48)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0]
    others = [SamplingParams(temperature=1.2, max_tokens=30 + i) for i in range(6)]
    crowd = llm.generate([PROMPTS[0]] + PROMPTS[1:7], [seeded] + others, use_tqdm=False)[0].outputs[0]
    other_seed = llm.generate(PROMPTS[0], seeded.clone(seed=99), use_tqdm=False)[0].outputs[0]
    assert crowd.token_ids == alone.token_ids and crowd.text == alone.text
    assert other_seed.token_ids != alone.token_ids  # the seed matters (48 tokens at T=1 never all agree)


def test_seeded_n_samples_differ_but_reproduce():
    llm = cached_llm()
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=32)
    first = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    second = llm.generate([PROMPTS[2], PROMPTS[1]], params, use_tqdm=False)[1]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3


def allowed(logits: torch.Tensor, params: SamplingParams, slack: float = 1e-4) -> set[int]:
    """The tokens a rule allows, from the reference logits (slack absorbs float rounding)."""
    logits = logits / params.temperature
    probs = torch.softmax(logits, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max() * (1 - slack)
    if params.top_k > 0:
        kth = logits.topk(params.top_k).values[-1]
        keep &= logits >= kth - slack
    if params.top_p < 1:
        masked = torch.where(keep, logits, torch.tensor(float("-inf")))
        p = torch.softmax(masked, dim=-1)
        sorted_p, order = p.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p
        ok = torch.zeros_like(keep)
        ok[order] = before <= params.top_p + slack
        keep &= ok
    return set(torch.nonzero(keep).flatten().tolist())


@pytest.mark.parametrize("rule", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.2), dict(top_k=5, top_p=0.7, min_p=0.05)])
def test_filters_only_emit_allowed_tokens(rule):
    llm = cached_llm()
    params = SamplingParams(temperature=1.5, max_tokens=40, seed=3, **rule)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    checked = 0
    for out in outputs:
        tokens = out.outputs[0].token_ids
        logits = hf_logits(STORIES, out.prompt_token_ids + tokens)
        for i, token in enumerate(tokens):
            ok = allowed(logits[len(out.prompt_token_ids) - 1 + i], params)
            assert token in ok, f"{rule}: token {token} at step {i} is outside {sorted(ok)[:10]}"
            checked += 1
    assert checked == 8 * 40


def test_filters_really_restrict():
    """With top_k=1 sampling at any temperature is greedy."""
    llm = cached_llm()
    greedy = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    topk1 = llm.generate(PROMPTS[:4], SamplingParams(temperature=2.0, top_k=1, max_tokens=24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_sampling_distribution_matches_softmax():
    """Many one-token samples of one prompt: frequencies follow softmax(logits / T)."""
    llm = cached_llm()
    temperature, num = 1.3, 2000
    outs = llm.generate([PROMPTS[4]] * num, SamplingParams(temperature=temperature, max_tokens=1), use_tqdm=False)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]), minlength=512).float()
    probs = torch.softmax(hf_logits(STORIES, outs[0].prompt_token_ids)[-1] / temperature, dim=-1)
    top = probs.topk(5).indices
    # each of the 5 likeliest tokens within 5 standard deviations of its expected count
    for t in top.tolist():
        expected, sd = probs[t] * num, (probs[t] * (1 - probs[t]) * num).sqrt()
        assert abs(counts[t] - expected) < 5 * sd + 1, (t, counts[t].item(), expected.item())


def test_logprobs_and_cumulative_logprob():
    llm = cached_llm()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)[0]
    completion = out.outputs[0]
    ref = torch.log_softmax(hf_logits(STORIES, out.prompt_token_ids + completion.token_ids), dim=-1)
    total = 0.0
    for i, (token, step) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(out.prompt_token_ids) - 1 + i]
        assert set(step) == set(row.topk(3).indices.tolist()) | {token}
        assert step[token].rank == 1  # greedy picks the top token
        assert abs(step[token].logprob - row[token].item()) < 1e-4
        total += step[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
    # Each token's string is what it adds in context (its leading space too): they join to the text.
    assert "".join(step[t].decoded_token for t, step in zip(completion.token_ids, completion.logprobs)) \
        == completion.text
    tokenizer = llm.get_tokenizer()
    prompt = out.prompt_token_ids
    for i, step in enumerate(completion.logprobs):
        context = tokenizer.decode(prompt + completion.token_ids[:i])
        for t, lp in step.items():  # alternatives render after the same tokens
            assert context + lp.decoded_token == tokenizer.decode(prompt + completion.token_ids[:i] + [t]), t


def test_penalties_change_logits_as_defined():
    """repetition_penalty > 1 with greedy never repeats a token when it is applied strongly enough
    to the seen ones, and frequency/presence penalties turn greedy repetition down."""
    llm = cached_llm()
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    penalized = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=48, frequency_penalty=2.0,
                                                         presence_penalty=2.0), use_tqdm=False)[0].outputs[0]
    def repeats(ids):
        return len(ids) - len(set(ids))
    assert repeats(penalized.token_ids) < repeats(plain.token_ids)
    rep = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=48, repetition_penalty=2.0),
                       use_tqdm=False)[0].outputs[0]
    assert rep.token_ids != plain.token_ids and repeats(rep.token_ids) < repeats(plain.token_ids)


def test_min_tokens_and_stop_token_ids():
    llm = cached_llm()
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    stop_at = plain.token_ids[5]
    first = plain.token_ids.index(stop_at)
    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_at]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == plain.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    assert plain.finish_reason == "length"
    late = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, min_tokens=first + 2,
                                                    stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= first + 2 and stop_at not in late.token_ids[:first + 2]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0), SamplingParams(temperature=0, ignore_eos=True, stop_token_ids=[3]),
    SamplingParams(temperature=0.7), SamplingParams(temperature=0, logprobs=0),
    SamplingParams(temperature=0, min_tokens=2), SamplingParams(temperature=0, repetition_penalty=1.1),
    SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0, frequency_penalty=-0.5),
    SamplingParams(temperature=0, logit_bias={1: 0.5}), SamplingParams(temperature=0, allowed_token_ids=[3, 4]),
    SamplingParams(temperature=0, bad_words=["a"]),
])
def test_argmax_only_params_take_the_shortcut_build_would(params):
    """The runner skips SamplingMetadata.build when every row's params are argmax_only; that must be
    exactly when build itself would find the batch argmax-only, and give the same metadata."""
    from fastllm.layers.sampler import SamplingMetadata, SamplingRow

    built = SamplingMetadata.build([SamplingRow(params, None, [1, 2], [], 2)] * 3, 32, torch.device("cpu"))
    assert params.argmax_only == built.argmax_only
    if params.argmax_only:
        assert SamplingMetadata.argmax_rows() == built


def test_argmax_only_follows_a_changed_params_object():
    """LLMEngine.add_request takes the params object as given; one reused after a change must not
    keep an earlier answer (a cached value once sent such requests down the greedy shortcut)."""
    params = SamplingParams(temperature=0, seed=7)
    assert params.argmax_only
    params.temperature = 1.0
    assert not params.argmax_only
    params.temperature, params.logprobs = 0, 2
    assert not params.argmax_only
