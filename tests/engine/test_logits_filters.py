"""logit_bias, allowed_token_ids and bad_words through the engine: greedy output equals a reference
greedy loop over Hugging Face's logits with the same processing, sampled output stays inside the
masks, bad token ids are refused at the engine boundary, and the graph path gives what eager gives."""

from __future__ import annotations

import pytest
import torch

from fastllm import SamplingParams
from tests.conftest import PROMPTS, STORIES, cached_llm, hf_logits, release_cached_engines

MAX_TOKENS = 12


def reference_greedy(prompt_ids: list[int], process, max_tokens: int = MAX_TOKENS) -> list[int]:
    """HF's greedy continuation with process(logits [V], output so far) applied at each step."""
    out: list[int] = []
    for _ in range(max_tokens):
        logits = process(hf_logits(STORIES, prompt_ids + out)[-1].clone(), out)
        out.append(int(logits.argmax()))
        if out[-1] == 2:  # EOS
            break
    return out


def bias_of(bias: dict[int, float]):
    def process(logits, _):
        for t, b in bias.items():
            logits[t] += b
        return logits
    return process


def only(allowed: list[int]):
    def process(logits, _):
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[allowed] = True
        return logits.masked_fill(~keep, float("-inf"))
    return process


def without(words: list[list[int]]):
    def process(logits, out):
        for word in words:
            n = len(word) - 1
            if n <= len(out) and out[len(out) - n:] == word[:-1]:
                logits[word[-1]] = float("-inf")
        return logits
    return process


def greedy(llm, prompt: str, **fields):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **fields)
    return llm.generate(prompt, params, use_tqdm=False)[0]


def test_logit_bias_equals_the_reference():
    llm = cached_llm()
    plain = greedy(llm, PROMPTS[0]).outputs[0].token_ids
    # Push the runner-up of the first two steps above the winner, and push a later winner down.
    logits = hf_logits(STORIES, greedy(llm, PROMPTS[0]).prompt_token_ids)[-1]
    runner_up = int(logits.topk(2).indices[1])
    bias = {runner_up: float(logits.max() - logits[runner_up]) + 0.5, plain[3]: -3.0}
    out = greedy(llm, PROMPTS[0], logit_bias=bias)
    assert out.outputs[0].token_ids == reference_greedy(out.prompt_token_ids, bias_of(bias))
    assert out.outputs[0].token_ids[0] == runner_up != plain[0]


def test_allowed_token_ids_equal_the_reference_and_bound_sampling():
    llm = cached_llm()
    allowed = list(range(300, 420))
    out = greedy(llm, PROMPTS[1], allowed_token_ids=allowed)
    assert out.outputs[0].token_ids == reference_greedy(out.prompt_token_ids, only(allowed))
    sampled = llm.generate(PROMPTS[:4], SamplingParams(temperature=1.5, max_tokens=20, seed=5,
                                                       allowed_token_ids=allowed), use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in sampled)


def test_bad_words_equal_the_reference_and_never_appear():
    llm = cached_llm()
    tok = llm.get_tokenizer()
    word = "Lily"
    assert word in greedy(llm, PROMPTS[0]).outputs[0].text  # what the ban must change
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, bad_words=[word])
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert word not in out.outputs[0].text
    params.tokenize_bad_words(tok)  # (generate tokenized its own copy)
    spellings = params.bad_words_token_ids
    assert tok.encode(word, add_special_tokens=False) in spellings
    assert out.outputs[0].token_ids == reference_greedy(out.prompt_token_ids, without(spellings))


def test_bad_words_with_async_scheduling_read_the_in_flight_token():
    """A multi-token bad word's mask depends on the newest token: async and sync steps agree."""
    word = "little girl"
    outs = []
    for async_scheduling in (True, False):
        llm = cached_llm(async_scheduling=async_scheduling)
        outs.append([o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=30, bad_words=[word]), use_tqdm=False)])
        assert all(word not in o.outputs[0].text for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=30, bad_words=[word]), use_tqdm=False))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("fields, field", [
    (dict(logit_bias={512: 1.0}), "logit_bias"), (dict(allowed_token_ids=[1, 600]), "allowed_token_ids"),
])
def test_out_of_vocabulary_ids_are_refused_at_the_engine(fields, field):
    llm = cached_llm()
    with pytest.raises(ValueError, match=f"SamplingParams.{field} has token ids outside the vocabulary of 512"):
        llm.generate(PROMPTS[0], SamplingParams(**fields), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_words_need_a_tokenizer():
    llm = cached_llm()
    llm.engine.tokenizer, saved = None, llm.engine.tokenizer
    try:
        with pytest.raises(ValueError, match="SamplingParams.bad_words needs a tokenizer"):
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(bad_words=["a"]), use_tqdm=False)
    finally:
        llm.engine.tokenizer = saved
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.gpu
def test_graph_path_applies_the_filters():
    """With CUDA graphs the forward replays and the sampler applies the filters to its logits: the
    tokens equal the eager engine's."""
    release_cached_engines()
    params = [SamplingParams(temperature=0, max_tokens=24, logit_bias={300: 5.0}),
              SamplingParams(temperature=0, max_tokens=24, allowed_token_ids=list(range(200, 400))),
              SamplingParams(temperature=0, max_tokens=24, bad_words=["Lily", "little"])]
    runs = []
    for enforce_eager in (True, False):
        llm = cached_llm(device="cuda", enforce_eager=enforce_eager)
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)])
    assert cached_llm(device="cuda", enforce_eager=False).engine.worker.runner.graphs is not None
    assert runs[0] == runs[1]


@pytest.mark.parametrize("spec", [{"model": "llama2xs-279K", "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": 3}], ids=["draft", "ngram"])
def test_speculative_decoding_applies_the_filters(spec):
    """Requests with filters speculate: greedy verify rows give the plain engine's tokens, and sampled ones
    accept no draft token a filter forbids (the target's p is the filtered distribution)."""
    fields = [dict(logit_bias={300: 4.0, 267: -5.0}), dict(allowed_token_ids=list(range(250, 450))),
              dict(bad_words=["Lily", "little girl"]), dict(min_tokens=20, logit_bias={2: 30.0})]
    plain, speculative = cached_llm(), cached_llm(speculative_config=spec)
    for kw in fields:
        params = SamplingParams(temperature=0, max_tokens=30, **kw)
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in speculative.generate(PROMPTS[:3], params, use_tqdm=False)] == want
    allowed = list(range(250, 450))
    sampled = speculative.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                                                           allowed_token_ids=allowed, bad_words=["Lily"]),
                                   use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) and "Lily" not in o.outputs[0].text for o in sampled)
    assert speculative.engine.scheduler.spec_stats.num_draft_tokens > 0
