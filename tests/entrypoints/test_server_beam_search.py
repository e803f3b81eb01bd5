"""Beam search through the server (vLLM's use_beam_search / best_of on /v1/completions), checked with the
official `openai` client: the choices are LLM.beam_search's n best beams (tokens, text, order, finish
reasons) for several widths, n below the width, ending by EOS or by length, length_penalty and
early_stopping passed through; streamed as one chunk per prompt; usage counts the returned beams. Bad
values are a 400 naming the field and the server serves on; a client that leaves mid-search frees the
beams' blocks (the pool is whole)."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from fastllm import BeamSearchParams  # noqa: E402
from fastllm.entrypoints.openai.limits import ServerLimits  # noqa: E402
from tests.conftest import PROMPTS, cached_llm, nth_step_fails  # noqa: E402
from tests.engine.engine_testing import count_steps, wait_idle  # noqa: E402
from tests.entrypoints.conftest import MODEL, serving, thread_engine  # noqa: E402
from tests.entrypoints.test_beam_search import PERIOD, run_beam_search  # noqa: E402

MAX_TOKENS = 16
MAX_N, MAX_NUM_SEQS = 8, 6


@pytest.fixture(scope="module")
def server():
    """"." is the EOS, as in test_beam_search (stories260K's own ends a whole story): beams end by EOS."""
    engine = thread_engine(num_gpu_blocks=256, max_num_seqs=MAX_NUM_SEQS)
    engine.eos_token_id = PERIOD
    with serving(engine, limits=ServerLimits(max_n=MAX_N, max_prompts=3)) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture
def client(server):
    url, engine = server
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    wait_idle(engine)  # nothing left on either side, and the KV pool whole


def beam_request(client, prompts, n, width=None, **extra):
    """A beam search of width best_of (n when None), its token ids returned too."""
    body = {"use_beam_search": True, "return_token_ids": True, **extra}
    return client.completions.create(model=MODEL, prompt=prompts, n=n, best_of=width, max_tokens=MAX_TOKENS,
                                     extra_body=body)


def assert_choices_are_the_best_beams(out, prompts, n, want):
    """Prompt p's choices p*n .. p*n+n-1 are its n best beams of LLM.beam_search, in order."""
    tok = cached_llm().get_tokenizer()
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == list(range(len(prompts) * n))
    completion_tokens = 0
    for p, (prompt, beams) in enumerate(zip(prompts, want)):
        prompt_ids = tok(prompt)["input_ids"]
        for c, seq in zip(choices[p * n:(p + 1) * n], beams.sequences[:n], strict=True):
            tokens = seq.tokens[len(prompt_ids):]
            assert c.model_extra["token_ids"] == tokens
            assert tok.decode(prompt_ids, skip_special_tokens=True) + c.text == seq.text
            assert c.finish_reason == seq.finish_reason and c.logprobs is None
            completion_tokens += len(tokens)
    assert out.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in prompts)
    assert out.usage.completion_tokens == completion_tokens  # the returned beams' tokens, as n samples'


@pytest.mark.parametrize("width, n", [(1, 1), (2, 1), (3, 3), (4, 2)])
@pytest.mark.parametrize("eos", [True, False], ids=["eos", "ignore-eos"])
def test_choices_are_llm_beam_search_beams(client, width, n, eos):
    prompts = PROMPTS[:2]
    out = beam_request(client, prompts, n, width if width != n else None, ignore_eos=not eos)
    params = BeamSearchParams(width, MAX_TOKENS, ignore_eos=not eos)
    want = run_beam_search(cached_llm(), prompts, params, PERIOD)
    assert_choices_are_the_best_beams(out, prompts, n, want)
    ended_by_eos = [c.finish_reason == "stop" for c in out.choices]
    assert any(ended_by_eos) if eos else not any(ended_by_eos)


@pytest.mark.parametrize("length_penalty, early_stopping", [(0.0, True), (2.0, "never")])
def test_length_penalty_and_early_stopping_reach_the_search(client, length_penalty, early_stopping):
    """Both change these prompts' beams (against the defaults), and the server's follow."""
    prompts = PROMPTS[2:4]
    out = beam_request(client, prompts, 3, length_penalty=length_penalty, early_stopping=early_stopping)
    params = BeamSearchParams(3, MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping)
    want = run_beam_search(cached_llm(), prompts, params, PERIOD)
    assert_choices_are_the_best_beams(out, prompts, 3, want)
    default = run_beam_search(cached_llm(), prompts, BeamSearchParams(3, MAX_TOKENS), PERIOD)
    assert [s.tokens for o in want for s in o.sequences] != [s.tokens for o in default for s in o.sequences]


def test_width_one_reads_as_the_greedy_sample(client):
    """One beam is greedy decoding: the same text as a temperature-0 sample (the beams' text is
    rendered after the prompt as a sample's is)."""
    beam = beam_request(client, PROMPTS[1], 1, ignore_eos=True)
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0, max_tokens=MAX_TOKENS,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert beam.choices[0].text == greedy.choices[0].text
    assert beam.choices[0].model_extra["token_ids"] == greedy.choices[0].model_extra["token_ids"]


def test_stream_gives_each_prompts_beams_as_one_chunk_and_echo_writes_the_prompt(client):
    prompts = PROMPTS[:2]
    whole = beam_request(client, prompts, 2, 3)
    body = {"use_beam_search": True, "return_token_ids": True}
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, best_of=3,
                                            max_tokens=MAX_TOKENS, stream=True,
                                            stream_options={"include_usage": True}, extra_body=body))
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) == len(prompts) and all(len(c.choices) == 2 for c in with_choices)
    streamed = sorted((c for chunk in with_choices for c in chunk.choices), key=lambda c: c.index)
    assert [(c.index, c.text, c.finish_reason, c.model_extra["token_ids"]) for c in streamed] == \
        [(c.index, c.text, c.finish_reason, c.model_extra["token_ids"]) for c in whole.choices]
    assert chunks[-1].usage == whole.usage and not chunks[-1].choices
    echoed = client.completions.create(model=MODEL, prompt=prompts, n=2, best_of=3, max_tokens=MAX_TOKENS,
                                       echo=True, extra_body=body)
    assert [c.text for c in echoed.choices] == [prompts[c.index // 2] + c.text for c in whole.choices]


BAD = [
    (dict(temperature=0.7), "temperature", "must be 0"),
    (dict(logprobs=2), "logprobs", "not supported with use_beam_search"),
    (dict(top_p=0.5), "top_p", "not supported with use_beam_search"),
    (dict(stop=["."]), "stop", "not supported with use_beam_search"),
    (dict(seed=3), "seed", "not supported with use_beam_search"),
    (dict(extra_body={"repetition_penalty": 1.2}), "repetition_penalty", "not supported with use_beam"),
    (dict(n=3, best_of=2), "best_of", "best_of must be >= n"),
    (dict(n=1, best_of=MAX_N + 1), "best_of", "--max-n"),
    (dict(n=1, best_of=MAX_NUM_SEQS + 1), "best_of", r"best_of \(the beam width\) must be <= max_num_seqs"),
    (dict(n=MAX_NUM_SEQS + 1), "n", rf"n \(the beam width\) must be <= max_num_seqs \({MAX_NUM_SEQS}\)"),
    (dict(n=0), "n", "n must be >= 1"),
    (dict(max_tokens=None), "max_tokens", "max_tokens is required"),
    (dict(max_tokens=0, echo=True), "max_tokens", "max_tokens must be an integer >= 1"),
    (dict(max_tokens=10**6), "max_tokens", "exceeds max_model_len"),
    (dict(prompt=PROMPTS[:4]), "prompt", "at most 3 prompts"),
    (dict(extra_body={"length_penalty": "long"}), "length_penalty", None),
    (dict(extra_body={"early_stopping": "sometimes"}), "early_stopping", None),
]


@pytest.mark.parametrize("kwargs, param, match", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_values_are_400_naming_the_field(client, kwargs, param, match):
    kwargs = dict(kwargs)
    body = {"use_beam_search": True, **kwargs.pop("extra_body", {})}
    request = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "extra_body": body, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**request)
    assert e.value.body["param"] == param, e.value.body
    if match is not None:
        assert re.search(match, e.value.body["message"]), e.value.body["message"]
    assert beam_request(client, PROMPTS[0], 1).choices[0].finish_reason is not None  # it serves on


def test_beam_fields_without_beam_search_and_on_chat_are_400(client, server):
    cases = [
        (dict(n=1, best_of=3), "best_of", "not supported without use_beam_search"),
        (dict(n=2, best_of=1), "best_of", "best_of must be >= n"),
        (dict(extra_body={"length_penalty": 0.5}), "length_penalty", "beam search only"),
        (dict(extra_body={"early_stopping": True}), "early_stopping", "beam search only"),
    ]
    for kwargs, param, match in cases:
        kwargs = dict(kwargs)
        with pytest.raises(openai.BadRequestError, match=match) as e:
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, **kwargs)
        assert e.value.body["param"] == param
    # best_of == n, and the beam fields at their defaults, ask for nothing beyond sampling
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, n=2, best_of=2,
                                    extra_body={"length_penalty": 1.0, "early_stopping": False})
    assert len(out.choices) == 2
    with pytest.raises(openai.BadRequestError, match="/v1/completions only") as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search"


def test_beam_width_above_half_the_vocabulary_is_400(client, server):
    """(stories260K's vocabulary holds any width up to 10: the API process's is made small here.)"""
    _, engine = server
    checker = engine.input_processor
    saved, checker.vocab_size = checker.vocab_size, 2 * 3 - 1
    try:
        with pytest.raises(openai.BadRequestError, match="half the vocabulary") as e:
            client.completions.create(model=MODEL, prompt=[1, 2], n=1, best_of=3, max_tokens=4,
                                      extra_body={"use_beam_search": True})
    finally:
        checker.vocab_size = saved
    assert e.value.body["param"] == "best_of"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_mid_search_frees_its_beams(server, stream):
    """The search is aborted while its beams run (far from its max_tokens steps): nothing is left on
    either side and the KV pool is whole."""
    url, engine = server
    max_tokens = 400  # ignore_eos: a search that runs to its end takes max_tokens steps

    async def leave_mid_search(steps):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            create = client.completions.create(
                model=MODEL, prompt=PROMPTS[0], n=2, best_of=4, max_tokens=max_tokens, stream=stream,
                extra_body={"use_beam_search": True, "ignore_eos": True})
            # A stream's response starts at once (its one chunk comes when the search ends).
            request = await create if stream else asyncio.ensure_future(create)
            deadline = time.monotonic() + 30
            while steps[0] < 20 or not engine.engine.scheduler.beam_searches:
                assert time.monotonic() < deadline and (stream or not request.done())
                await asyncio.sleep(0.01)
            assert engine.engine.scheduler.kv.usage > 0  # the beams hold blocks
            if stream:
                await request.close()  # the client leaves
            else:
                request.cancel()  # the connection closes
                with pytest.raises(asyncio.CancelledError):
                    await request

    with count_steps(engine) as steps:
        asyncio.run(leave_mid_search(steps))
        wait_idle(engine)
        assert not engine.engine.scheduler.beam_searches and not engine.output_processor.beam_searches
        assert steps[0] < max_tokens  # aborted, not run to its end


def test_a_failed_step_mid_search_is_500_for_that_search_only(client, server):
    """A step of the search raises: its response is a 500 with the cause (no beams), its beams' blocks
    are freed (the client fixture checks the pool) and the next search is served."""
    _, engine = server
    with nth_step_fails(engine.engine.worker, 5) as calls, \
            pytest.raises(openai.InternalServerError, match="planted step failure"):
        beam_request(client, PROMPTS[0], 2, 3, ignore_eos=True)
    assert len(calls) >= 5
    out = beam_request(client, PROMPTS[0], 2, 3, ignore_eos=True)
    assert [c.finish_reason for c in out.choices] == ["length", "length"]
