"""`fastllm serve`'s app under uvicorn on the CPU (stories260K), driven by the official `openai` client:
greedy completions equal LLM.generate's, streams add up to the whole, chat goes through the chat
template, bad input is HTTP 400 with OpenAI's error body, a client that leaves frees its KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from fastllm import SamplingParams

# The server's extra ("serve": fastapi, uvicorn) and the test client: CI installs both; a machine
# without them (the GPU box) skips this module.
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
build_app = pytest.importorskip("fastllm.entrypoints.openai.server").build_app
from tests.conftest import PROMPTS, cached_llm  # noqa: E402
from tests.engine.engine_testing import count_steps, wait_idle  # noqa: E402
from tests.entrypoints.conftest import MODEL  # noqa: E402


def offline(prompts, **params):
    llm = cached_llm(device="cpu", dtype="float32")
    return [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(**params), use_tqdm=False)]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").status_code == 200


def test_greedy_completions_equal_offline(client):
    want = offline(PROMPTS[:3], temperature=0, max_tokens=24)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:3], temperature=0, max_tokens=24)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == want
    assert all(c.finish_reason in ("length", "stop") for c in out.choices)
    llm = cached_llm(device="cpu", dtype="float32")
    runs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert out.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in runs)
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in runs)
    tok = llm.get_tokenizer()
    ids = tok(PROMPTS[0])["input_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=24)
    assert by_ids.choices[0].text == want[0]


def test_stream_adds_up_to_the_whole(client):
    want = offline(PROMPTS[:2], temperature=0, max_tokens=32)
    texts, usage, finish = {}, None, {}
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[:2], temperature=0, max_tokens=32, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == want and set(finish) == {0, 1}
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0


def test_n_logprobs_and_stop(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=3, temperature=1.0, seed=7, max_tokens=16,
                                    logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1
        assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) >= 2 for t in lp.top_logprobs)
    full = offline([PROMPTS[0]], temperature=0, max_tokens=40)[0]
    cut = full.split()[3]
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=40, stop=[cut])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and cut not in choice.text and full.startswith(choice.text)


def test_streamed_choices_of_several_prompts_and_samples(client):
    """Two prompts x n=2, streamed: choice i*2+j carries prompt i's sample j, whole and in order, and each
    ends with a finish reason; chat with n=2 opens each choice with the assistant role."""
    params = dict(model=MODEL, temperature=0.9, seed=3, max_tokens=12)
    whole = client.completions.create(prompt=PROMPTS[:2], n=2, **params)
    want = {c.index: c.text for c in whole.choices}
    texts, finish = {}, {}
    for chunk in client.completions.create(prompt=PROMPTS[:2], n=2, stream=True, **params):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = finish.get(c.index) or c.finish_reason
    assert texts == want and sorted(want) == [0, 1, 2, 3] and all(finish.values())
    roles, contents = {}, {}
    for chunk in client.chat.completions.create(messages=[{"role": "user", "content": "Once"}], n=2, stream=True,
                                                **params):
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            contents[c.index] = contents.get(c.index, "") + (c.delta.content or "")
    assert roles == {0: "assistant", 1: "assistant"} and set(contents) == {0, 1}


def test_streamed_choice_says_its_finish_reason_once(client):
    """Samples that end at different steps (a stop string): a choice's finish_reason comes once, in its
    last chunk, as OpenAI and vLLM send it; the choices still running go on."""
    params = dict(model=MODEL, temperature=1.0, seed=1, max_tokens=25, n=3, stop=["."], stream=True)
    streams = [client.completions.create(prompt=PROMPTS[0], **params),
               client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[0]}], **params)]
    for stream in streams:
        finished, ended_at, chunks = {}, set(), 0
        for chunk in stream:
            chunks += 1
            for c in chunk.choices:
                assert c.index not in finished, f"choice {c.index} goes on after its finish_reason"
                if c.finish_reason is not None:
                    finished[c.index] = c.finish_reason
                    ended_at.add(chunks)
        assert sorted(finished) == [0, 1, 2]
        assert len(ended_at) > 1  # they did end at different steps


def test_chat_through_the_template(client):
    messages = [{"role": "system", "content": "Once upon a time"}, {"role": "user", "content": "there was"}]
    want = offline(["Once upon a time there was"], temperature=0, max_tokens=20)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                         logprobs=True, top_logprobs=2)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == want
    assert all(len(t.top_logprobs) == 2 for t in out.choices[0].logprobs.content)
    text, roles = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                                stream=True):
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
    assert roles == ["assistant"] and text == want


def test_echo_writes_the_prompt_back_with_its_logprobs(client):
    import torch

    from tests.conftest import STORIES, hf_logits

    want = offline([PROMPTS[0]], temperature=0, max_tokens=8)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=8, echo=True,
                                    logprobs=2)
    choice = out.choices[0]
    assert choice.text == PROMPTS[0] + want
    ids = cached_llm(device="cpu", dtype="float32").get_tokenizer()(PROMPTS[0])["input_ids"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = torch.log_softmax(hf_logits(STORIES, ids), dim=-1)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 1e-4
    # Offsets point into the text: the prompt's words where they are, the first new token after the prompt.
    assert lp.text_offset[len(ids)] == len(PROMPTS[0]) and lp.text_offset == sorted(lp.text_offset)
    for p in range(1, len(ids)):
        word = lp.tokens[p].strip()
        assert choice.text[lp.text_offset[p]:].lstrip().startswith(word), (p, word)
    # Streamed, the prompt comes with each choice's first chunk.
    stream = client.completions.create(model=MODEL, prompt=[ids], temperature=0, max_tokens=8, echo=True,
                                       stream=True)
    text = "".join(c.text for chunk in stream for c in chunk.choices)
    assert text == PROMPTS[0] + want


@pytest.mark.parametrize("body,status,match", [
    (dict(prompt="Hi", temperature=-1), 400, "temperature"),
    (dict(prompt="Hi", max_tokens=10**6), 400, "max_model_len"),
    (dict(prompt=""), 400, "empty"),
    (dict(prompt="Hi", top_p=0), 400, "top_p"),
    (dict(prompt="Hi", n=0), 400, "n"),
    (dict(prompt="Hi", suffix="!"), 400, "suffix"),
    (dict(prompt="Hi", unknown_field=1), 400, "unknown_field"),
    (dict(temperature=0), 400, "prompt"),
    (dict(prompt="Hi", model="gpt-4"), 404, "gpt-4"),
])
def test_bad_completion_requests(server, body, status, match):
    url, engine = server
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, **body} if "model" not in body else body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert match in error["message"] and error["code"] == status and error["type"]
    if "max_tokens" in body:
        assert error["param"] == "max_tokens", error
    wait_idle(engine)


@pytest.mark.parametrize("kwargs", [{"tokenize": True}, {"add_generation_prompt": False}, {"conversation": []}])
def test_chat_template_kwargs_that_clash_are_400(server, kwargs):
    url, engine = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Once"}], "max_tokens": 2,
            "chat_template_kwargs": kwargs}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"
    assert httpx.get(url + "/health").status_code == 200


def test_chat_template_that_raises_is_400():
    """A template's own refusal (raise_exception: "roles must alternate", ...) is the request's fault."""
    from fastapi.testclient import TestClient

    from tests.entrypoints.conftest import thread_engine

    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first role must be user') }}" \
               "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    engine = thread_engine(num_gpu_blocks=64)
    try:
        with TestClient(build_app(engine, MODEL, chat_template=template)) as http:
            body = {"messages": [{"role": "system", "content": "Once"}], "max_tokens": 2}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            assert "the first role must be user" in r.json()["error"]["message"]
            body["messages"][0]["role"] = "user"
            assert http.post("/v1/chat/completions", json=body).status_code == 200
    finally:
        engine.shutdown()


def test_bad_request_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["fine", ""], max_tokens=4)  # the second is empty
    assert "empty" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert client.completions.create(model=MODEL, prompt="Still", max_tokens=4).choices[0].text is not None


def test_client_that_leaves_frees_its_blocks(server):
    url, engine = server

    async def leave_early():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as aclient:
            stream = await aclient.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=400,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            await stream.close()
    aborted = aborted_count(url)
    with count_steps(engine) as steps:
        asyncio.run(leave_early())
        left_at = steps[0]
        wait_idle(engine)  # no request holds blocks
    assert steps[0] - left_at < 100, "the engine kept generating after the client left (400 tokens asked)"
    assert aborted_count(url) == aborted + 1


def test_refused_prompt_aborts_the_ones_taken_before_it(server):
    """Several prompts in one request, the last one bad: HTTP 400, and the engine requests already made
    for the others are aborted, not run to their max_tokens."""
    url, engine = server
    with count_steps(engine) as steps:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [PROMPTS[0], PROMPTS[1], ""],
                                                       "max_tokens": 400, "ignore_eos": True})
        wait_idle(engine)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    assert steps[0] < 100, "the accepted prompts ran on after the request was refused"


def test_non_streaming_client_that_leaves_frees_its_blocks(server):
    """A client that gives up on a whole (non-streamed) response: the server notices within its poll
    interval and aborts the request instead of generating the rest."""
    url, engine = server
    aborted = aborted_count(url)
    with count_steps(engine) as steps:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 450,
                                                       "temperature": 0, "ignore_eos": True}, timeout=0.3)
        wait_idle(engine)
    assert aborted_count(url) == aborted + 1
    assert steps[0] < 400, "the engine generated (nearly) all 450 tokens for a client that had left"


def aborted_count(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('fastllm_requests_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_concurrent_requests(server):
    url, engine = server
    want = offline(PROMPTS, temperature=0, max_tokens=16)

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as aclient:
            outs = await asyncio.gather(*(aclient.completions.create(model=MODEL, prompt=p, temperature=0,
                                                                      max_tokens=16) for p in PROMPTS))
        return [o.choices[0].text for o in outs]
    assert asyncio.run(all_at_once()) == want
    wait_idle(engine)


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="Once", max_tokens=4)
    text = httpx.get(server[0] + "/metrics").text
    for name in ("fastllm_requests_total", "fastllm_generation_tokens_total", "fastllm_e2e_request_latency_seconds",
                 "fastllm_kv_cache_usage_perc", "fastllm_num_requests_running", "fastllm_engine_slow_steps_total",
                 "fastllm_engine_compiles_total"):
        assert name in text, name


@contextlib.contextmanager
def first_step_fails(engine):
    """The first engine step that computes something raises (an idle engine: only the next request's)."""
    worker = engine.engine.worker
    execute, fired = worker.execute_model, []

    def execute_once(sched):
        if not fired and sched.num_scheduled_tokens:
            fired.append(sched)
            raise RuntimeError("planted launch failure")
        return execute(sched)
    worker.execute_model = execute_once
    try:
        yield fired
    finally:
        del worker.execute_model


def test_failed_step_is_500_for_its_request_only(server):
    """A step that raises fails its request (a 500, or an error event once the stream has begun); the
    server stays healthy and serves the next request, on the same kept-alive connection too."""
    url, engine = server
    wait_idle(engine)
    with httpx.Client(base_url=url) as keep_alive:
        with first_step_fails(engine) as fired:
            r = keep_alive.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 4})
        assert fired and r.status_code == 500 and "planted launch failure" in r.json()["error"]["message"]
        assert keep_alive.get("/health").status_code == 200
    with first_step_fails(engine):
        with httpx.stream("POST", url + "/v1/completions",
                          json={"model": MODEL, "prompt": "Once", "max_tokens": 4, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200  # the engine took the request: the failure comes as an event
    error = json.loads(events[-2][len("data: "):])["error"]
    assert "planted launch failure" in error["message"] and error["code"] == 500
    assert events[-1] == "data: [DONE]"
    out = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 4})
    assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(engine)


def test_an_unexpected_error_is_a_500_and_the_connection_goes_on(server, monkeypatch):
    """An exception no handler expects (a bug of ours) is a 500 for its request alone: the connection stays
    open for the client's next request (Starlette's own handler re-raised, and uvicorn closed it)."""
    from fastllm.entrypoints.openai import server as server_module

    url, engine = server

    async def planted_bug(self, body, request):
        raise RuntimeError("planted bug")
    with httpx.Client(base_url=url) as keep_alive:
        with monkeypatch.context() as patch:
            patch.setattr(server_module._Server, "complete", planted_bug)
            r = keep_alive.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: planted bug"
        out = keep_alive.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 4})
        assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(engine)


def test_failed_prompt_of_a_whole_response_stops_the_others(server):
    """One prompt of a non-streamed request fails in the engine: the response is a 500 at once, and the
    request's other prompts are aborted, not generated to their end for nobody."""
    url, engine = server
    wait_idle(engine)
    core = engine.engine.core
    add = core.add_request

    def refuse_second(request_id, *args):
        if request_id.endswith("-1"):
            raise ValueError("planted refusal")
        return add(request_id, *args)
    core.add_request = refuse_second
    try:
        with count_steps(engine) as steps:
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [PROMPTS[2], "Once"],
                                                          "max_tokens": 450, "ignore_eos": True}, timeout=60)
            wait_idle(engine)
    finally:
        del core.add_request
    assert r.status_code == 500 and "planted refusal" in r.json()["error"]["message"]
    assert steps[0] < 400, "the engine generated (nearly) all 450 tokens of a prompt whose response had failed"


def test_serve_command_parses():
    from fastllm.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
