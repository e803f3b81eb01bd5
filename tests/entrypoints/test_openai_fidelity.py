"""The server as OpenAI's API, checked with the official `openai` client: logprob tokens that join to the
text (offsets, unique top_logprobs keys, chat bytes), chat content as parts and no second BOS, OpenAI's
unsupported fields refused by name and its harmless ones accepted, logit_bias checked and applied, echo with
max_tokens 0, stop strings (never streamed and then taken back; after min_tokens; finish_reason "stop"),
and TTFT recorded for whole responses."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from fastllm import SamplingParams  # noqa: E402
from fastllm.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from fastllm.engine.llm_engine import LLMEngine  # noqa: E402
from tests.conftest import PROMPTS, cached_llm  # noqa: E402
from tests.entrypoints.conftest import MODEL  # noqa: E402


def offline_text(prompt, **params) -> str:
    return cached_llm(device="cpu", dtype="float32").generate(prompt, SamplingParams(**params),
                                                               use_tqdm=False)[0].outputs[0].text


def test_logprob_tokens_join_to_the_text(client, server):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=24, logprobs=3)
    choice = out.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(",")
    assert any(t.startswith(" ") for t in lp.tokens)  # word-boundary spaces are part of the tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # top_logprobs: the raw JSON holds each token string once per position
    body = {"model": MODEL, "prompt": PROMPTS[0], "temperature": 0, "max_tokens": 24, "logprobs": 5}
    raw = httpx.post(server[0] + "/v1/completions", json=body).text
    pairs = []
    json.loads(raw, object_pairs_hook=lambda kv: pairs.append([k for k, _ in kv]) or dict(kv))
    tops = json.loads(raw)["choices"][0]["logprobs"]["top_logprobs"]
    for top in tops:
        keys = next(p for p in pairs if sorted(p) == sorted(top))
        assert len(keys) == len(set(keys)) >= 5


def test_chat_logprobs_bytes_and_content_parts(client):
    messages = [{"role": "user", "content": "Once upon a time"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert bytes(t.bytes) == t.token.encode() and len(t.top_logprobs) == 3
        assert len({a.token for a in t.top_logprobs}) == 3
    parts = [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]
    as_parts = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                              temperature=0, max_tokens=16)
    joined = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=16,
                                            messages=[{"role": "user", "content": "Once upon\na time"}])
    assert as_parts.choices[0].message.content == joined.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="image_url.*not supported"):
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])
    with pytest.raises(openai.BadRequestError, match="messages.1.: a content part of type 'text' needs its"):
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "text"}]}])


def test_chat_template_that_writes_the_bos_gets_no_second_one():
    from fastapi.testclient import TestClient

    from fastllm.entrypoints.openai.server import build_app

    engine = AsyncLLMEngine(LLMEngine.from_kwargs(None, device="cpu", dtype="float32", num_gpu_blocks=64))
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": PROMPTS[0]}]
    tokenizer = engine.tokenizer
    ids = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                        add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1
    try:
        with TestClient(build_app(engine, MODEL, chat_template=template)) as http:
            body = {"messages": messages, "max_tokens": 2, "temperature": 0}
            r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)  # one BOS, the template's
    finally:
        engine.shutdown()


@pytest.mark.parametrize("endpoint,extra,param", [
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"store": True}, "store"),
    ("completions", {"suffix": "!"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
])
def test_unsupported_openai_fields_are_refused_by_name(client, endpoint, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once"}],
                                           max_tokens=4, **extra)
        else:
            client.completions.create(model=MODEL, prompt="Once", max_tokens=4, **extra)
    assert "not supported" in e.value.body["message"] and e.value.body["param"] == param


def test_stream_options_need_stream(client):
    for create in (lambda: client.completions.create(model=MODEL, prompt="Once", max_tokens=2,
                                                     stream_options={"include_usage": True}),
                   lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once"}],
                                                          max_tokens=2, stream_options={"include_usage": True})):
        with pytest.raises(openai.BadRequestError) as e:
            create()
        assert e.value.body["param"] == "stream_options" and "stream: true" in e.value.body["message"]


def test_harmless_openai_fields_are_accepted(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Once", "name": "narrator"},
                               {"role": "user", "content": "upon"}],
        max_tokens=4, user="someone", metadata={"k": "v"}, response_format={"type": "text"}, store=False,
        parallel_tool_calls=False, service_tier="auto", seed=3, tool_choice="none", n=1)
    assert out.choices[0].finish_reason == "length"
    out = client.completions.create(model=MODEL, prompt="Once", max_tokens=4, user="someone", best_of=1,
                                    echo=False, logit_bias={})
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("bias,match", [
    ({"512": 1}, "outside the vocabulary of 512"), ({"x": 1}, "token ids"), ({"5": 101}, "\\[-100, 100\\]"),
    ({"5": -100.5}, "\\[-100, 100\\]")])
def test_logit_bias_is_checked(client, bias, match):
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.completions.create(model=MODEL, prompt="Once", max_tokens=4, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias"


def test_logit_bias_and_vllm_filters_apply(client):
    """A +100 bias makes greedy pick that token every time; allowed_token_ids and bad_words (vLLM's
    extras) reach the sampler too."""
    forced = client.completions.create(model=MODEL, prompt="Once", max_tokens=5, temperature=0,
                                       logit_bias={"300": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [300] * 5
    allowed = client.completions.create(model=MODEL, prompt="Once", max_tokens=5, temperature=1.0, seed=1,
                                        extra_body={"allowed_token_ids": [7, 9], "return_token_ids": True})
    assert set(allowed.choices[0].model_extra["token_ids"]) <= {7, 9}
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert "Lily" in plain.choices[0].text
    banned = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                       extra_body={"bad_words": ["Lily"]})
    assert "Lily" not in banned.choices[0].text


def test_echo_with_max_tokens_0_scores_the_prompt(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text == PROMPTS[0] and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == PROMPTS[0] and len(lp.tokens) == out.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0)


def test_streamed_echo_of_a_prompt_scored_in_chunks():
    """A prompt longer than a step's token budget is scored over several steps: the streamed echo waits
    for all of its logprobs and equals the whole response's."""
    from tests.engine.engine_testing import wait_idle
    from tests.entrypoints.conftest import serving, thread_engine

    engine = thread_engine(num_gpu_blocks=64, max_num_batched_tokens=8)
    prompt = "Once upon a time there was a little girl named Lily. She loved to play outside."
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    try:
        with serving(engine) as url:
            whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            text, tokens = "", []
            for chunk in client.completions.create(**body, stream=True):
                for c in chunk.choices:
                    text += c.text
                    tokens += c.logprobs.tokens if c.logprobs else []
            wait_idle(engine)
    finally:
        engine.shutdown()
    assert len(engine.tokenizer(prompt)["input_ids"]) > 2 * 8
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]


def stream_texts(client, **kwargs) -> tuple[list[str], str | None]:
    pieces, finish = [], None
    for chunk in client.completions.create(model=MODEL, stream=True, **kwargs):
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
    return pieces, finish


def test_stop_strings_are_never_streamed_then_taken_back(client):
    full = offline_text(PROMPTS[0], temperature=0, max_tokens=40)
    target = "girl named"  # several tokens: "girl" streams before " named" decides
    assert target in full
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=40,
                                      stop=[target])
    assert whole.choices[0].text == full[:full.index(target)] and whole.choices[0].finish_reason == "stop"
    pieces, finish = stream_texts(client, prompt=PROMPTS[0], temperature=0, max_tokens=40, stop=[target])
    assert "".join(pieces) == whole.choices[0].text and finish == "stop"
    assert len([p for p in pieces if p]) > 3  # it did stream, piece by piece


def test_streamed_text_offsets_count_text_held_for_a_stop_string(client):
    """A token whose text is held back (it could begin a stop string) comes in one chunk, its text in a
    later one: the offsets of the tokens after it still count it."""
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=12, logprobs=0)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    stop = [whole.tokens[2] + "\x01", whole.tokens[5] + "\x01"]  # never met: the same text, held twice
    tokens, offsets = [], []
    for chunk in client.completions.create(**kwargs, stop=stop, stream=True):
        for c in chunk.choices:
            tokens += c.logprobs.tokens
            offsets += c.logprobs.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset


def test_stop_strings_wait_for_min_tokens(client, server):
    tokenizer = server[1].tokenizer
    plain = cached_llm(device="cpu", dtype="float32").generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0]
    first = plain.text.index("Lily")
    # the tokens up to and including the first "Lily": a stop string there does not count
    before = next(i for i in range(1, len(plain.token_ids) + 1)
                  if "Lily" in tokenizer.decode(plain.token_ids[:i], skip_special_tokens=True))
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=60,
                                    stop=["Lily"], extra_body={"min_tokens": before + 1})
    text = out.choices[0].text
    assert text.startswith(plain.text[:first + 4]) and len(text) > first + 4
    if "Lily" in plain.text[first + 4:]:  # the next one stops it
        second = plain.text.index("Lily", first + 4)
        assert out.choices[0].finish_reason == "stop" and text == plain.text[:second]


def ttft_count(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("fastllm_time_to_first_token_seconds_count"):
            return float(line.split()[-1])
    return 0.0


def test_ttft_is_recorded_for_whole_responses(client, server):
    before = ttft_count(server[0])
    client.completions.create(model=MODEL, prompt=["Once", "The dog"], max_tokens=4)
    assert ttft_count(server[0]) == before + 2


def test_long_prompts_are_tokenized_off_the_event_loop(client, server, monkeypatch):
    """A text past TOKENIZE_IN_THREAD_CHARS goes through the tokenizer thread, with the same ids."""
    from fastllm.engine import async_llm_engine

    monkeypatch.setattr(async_llm_engine, "TOKENIZE_IN_THREAD_CHARS", 100)  # the model's context is short
    engine = server[1]
    text = "Once upon a time there was a dog. " * 10
    calls = []
    encode = engine._thread_input_processor.encode

    def spy(*args):
        import threading

        calls.append(threading.current_thread().name)
        return encode(*args)
    engine._thread_input_processor.encode = spy
    try:
        out = client.completions.create(model=MODEL, prompt=text, max_tokens=1, echo=True, logprobs=0)
    finally:
        del engine._thread_input_processor.encode
    assert calls and calls[0].startswith("fastllm-tokenize")
    assert out.usage.prompt_tokens == len(engine.tokenizer(text)["input_ids"])
