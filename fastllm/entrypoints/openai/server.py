"""An OpenAI-compatible HTTP server over AsyncLLMEngine (`fastllm serve`).

    POST /v1/completions        text or token-id prompts (several per request), n, logprobs, echo, streaming
    POST /v1/chat/completions   messages through the tokenizer's chat template (or --chat-template)
    GET  /v1/models, /health, /metrics (Prometheus)

Each prompt of a request is one engine request (its n samples forked inside the engine). All of them
are taken by the engine before the response starts, so bad input is an HTTP 400 with OpenAI's error body,
never a broken stream. A stream's chunks follow the engine's steps (DELTA outputs); a client that goes
away aborts its requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastllm.engine.async_llm_engine import AsyncLLMEngine
from fastllm.engine.detokenizer import IncrementalDetokenizer
from fastllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, error_body
from fastllm.metrics import ServingMetrics
from fastllm.outputs import CompletionOutput, RequestOutput
from fastllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.kind = status, kind


def build_app(engine: AsyncLLMEngine, served_model_name: str, chat_template: str | None = None) -> FastAPI:
    app = FastAPI(title="fastllm")
    server = _Server(engine, served_model_name, chat_template)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(error_body(e.status, str(e), e.kind), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, e: RequestValidationError):
        message = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        return JSONResponse(error_body(400, message), status_code=400)

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, e: ValueError):
        return JSONResponse(error_body(400, str(e)), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):  # the engine failed (see /health)
        logger.error("request failed: %r", e)
        return JSONResponse(error_body(500, f"internal error: {e}", "InternalServerError"), status_code=500)

    @app.get("/health")
    async def health():
        if engine.errored is not None:
            raise APIError(503, f"the engine stopped after an error: {engine.errored!r}", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=ServingMetrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": server.created,
                                            "owned_by": "fastllm", "max_model_len": server.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.complete(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    return app


class _Server:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, chat_template: str | None):
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.tokenizer
        self.chat_template = chat_template
        self.max_model_len = engine.engine.config.model.max_model_len
        self.metrics = ServingMetrics(engine.engine)
        self.created = int(time.time())

    # the two endpoints

    async def complete(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        if body.suffix is not None or body.best_of not in (None, body.n):
            raise APIError(400, "suffix and best_of (other than n) are not supported")
        params = body.sampling_params(body.max_tokens, body.logprobs)
        if body.echo:
            if self.tokenizer is None:
                raise APIError(400, "echo needs the model's tokenizer to write the prompt back")
            if body.logprobs is not None:  # the prompt's tokens come with their logprobs too
                params = params.clone(prompt_logprobs=body.logprobs)
        return await self._respond("cmpl", "text_completion", body.prompts(), params, body, request, chat=False)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        params = body.sampling_params(body.token_limit(), body.num_logprobs())
        return await self._respond("chatcmpl", "chat.completion", [self._chat_prompt(body)], params, body, request,
                                   chat=True)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "NotFoundError")

    def _chat_prompt(self, body: ChatCompletionRequest) -> str:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids")
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, "this model's tokenizer has no chat template; start the server with --chat-template")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        return self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                  add_generation_prompt=body.add_generation_prompt)

    # requests and responses

    async def _respond(self, prefix: str, kind: str, prompts: list, params: SamplingParams, body, request: Request,
                       chat: bool):
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        arrival = time.perf_counter()
        streams = await self._add_all(response_id, prompts, params)
        echo = getattr(body, "echo", False)
        shape = _Shape(response_id, kind, self.model_name, int(time.time()), params.n, chat, params.logprobs,
                       self.tokenizer if echo else None)
        if body.stream:
            return StreamingResponse(self._stream(streams, shape, arrival, body.include_usage),
                                     media_type="text/event-stream")
        finals = asyncio.ensure_future(asyncio.gather(*(self._final(s, arrival) for s in streams)))
        # A whole response is written at the end: meanwhile, watch for a client that has gone.
        while not (await asyncio.wait({finals}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                finals.cancel()  # closes the streams, which aborts their requests
                with contextlib.suppress(asyncio.CancelledError):
                    await finals
                self.metrics.requests.labels(finish_reason="abort").inc(params.n * len(streams))
                return Response(status_code=499)  # nobody reads it
        return shape.full(finals.result())

    async def _add_all(self, response_id: str, prompts: list, params: SamplingParams) -> list:
        """Every prompt's engine request, taken; on a refused one, abort those already in."""
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{response_id}-{i}", prompt, params))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        return streams

    async def _final(self, stream: AsyncIterator[RequestOutput], arrival: float) -> RequestOutput:
        last = None
        async with contextlib.aclosing(stream):
            async for last in stream:  # FINAL_ONLY: the one finished output
                pass
        self._record(last, arrival, None)  # its first token's time is not seen here
        return last

    async def _stream(self, streams: list, shape: "_Shape", arrival: float, include_usage: bool):
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream):
            first_token, last, usage, ended_by = None, None, [0, 0], "abort"  # unless it finishes or fails
            try:
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        first_token = first_token or time.perf_counter()
                        usage[0] = len(out.prompt_token_ids)
                        usage[1] += sum(len(o.token_ids) for o in out.outputs)
                        last = out
                        await merged.put((index, out))
            except Exception as e:  # the engine failed mid-stream: the client gets an error event
                logger.error("stream failed: %r", e)
                ended_by = "error"
                await merged.put((index, e))
            finally:
                if last is not None and last.finished:
                    self._record_stream(last, usage, arrival, first_token)
                else:  # the client left first (the request was aborted), or the engine failed
                    self.metrics.requests.labels(finish_reason=ended_by).inc(shape.n)
                await merged.put((index, usage))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            if shape.chat:
                yield _sse(shape.chunk([_ChoiceDelta(i, role="assistant") for i in range(shape.n)]))
            open_streams, prompt_tokens, completion_tokens = len(tasks), 0, 0
            while open_streams:
                index, item = await merged.get()
                if isinstance(item, list):  # that prompt's stream ended: its usage
                    open_streams -= 1
                    prompt_tokens, completion_tokens = prompt_tokens + item[0], completion_tokens + item[1]
                    continue
                if isinstance(item, Exception):
                    yield _sse(error_body(500, f"internal error: {item}", "InternalServerError"))
                    break
                yield _sse(shape.chunk([shape.delta(index, o, item) for o in item.outputs]))
            if include_usage:
                yield _sse(shape.usage_chunk(prompt_tokens, completion_tokens))
            yield "data: [DONE]\n\n"
        finally:  # done, or the client went away: the pumps close their streams, aborting what is left
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _record(self, out: RequestOutput | None, arrival: float, first_token: float | None) -> None:
        if out is None:
            return
        tokens = sum(len(o.token_ids) for o in out.outputs)
        self._record_stream(out, [len(out.prompt_token_ids), tokens], arrival, first_token)

    def _record_stream(self, out: RequestOutput, usage: list[int], arrival: float, first_token: float | None):
        m = self.metrics
        for o in out.outputs:
            m.requests.labels(finish_reason=o.finish_reason or "abort").inc()
        m.prompt_tokens.inc(usage[0])
        m.generation_tokens.inc(usage[1])
        if first_token is not None:
            m.time_to_first_token.observe(first_token - arrival)
        m.e2e_latency.observe(time.perf_counter() - arrival)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _ChoiceDelta:
    def __init__(self, index: int, role: str | None = None, output: CompletionOutput | None = None,
                 text_offset: int = 0, echo: "_Echo | None" = None):
        self.index, self.role, self.output, self.text_offset = index, role, output, text_offset
        self.echo = echo  # the prompt written back before this choice's first text (completions' echo)


class _Echo:
    """A prompt as `echo` writes it back: its text and, when the prompt was scored, the legacy
    logprobs of its tokens (the first has none: nothing predicts it), with each token's offset in
    that text."""

    def __init__(self, out: RequestOutput, tokenizer):
        ids = out.prompt_token_ids
        # Each token's place in the text, as the outputs' text is made (special tokens such as BOS add none).
        detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=[])
        self.offsets = []
        for token in ids:
            self.offsets.append(len(detokenizer.text))
            detokenizer.add_token(token)
        self.text = out.prompt if out.prompt is not None else detokenizer.text
        self.logprobs = None
        if out.prompt_logprobs is not None:
            scored = out.prompt_logprobs
            tokens = [tokenizer.decode(ids[:1])] + [scored[p][ids[p]].decoded_token or "" for p in range(1, len(ids))]
            self.logprobs = (tokens, [None] + [scored[p][ids[p]].logprob for p in range(1, len(ids))],
                             [None] + [{(lp.decoded_token or str(t)): lp.logprob for t, lp in scored[p].items()}
                                       for p in range(1, len(ids))])


class _Shape:
    """The OpenAI JSON of one response: completion or chat, whole or as stream chunks."""

    def __init__(self, response_id: str, kind: str, model: str, created: int, n: int, chat: bool,
                 num_logprobs: int | None, echo_tokenizer=None):
        self.id, self.kind, self.model, self.created, self.n, self.chat = response_id, kind, model, created, n, chat
        self.num_logprobs = num_logprobs or 0
        self.echo_tokenizer = echo_tokenizer  # set for completions' echo: it writes the prompt back
        self._echoes: dict[int, _Echo] = {}  # prompt index -> its echo, shared by the prompt's n choices
        self._text_offsets: dict[int, int] = {}  # choice index -> characters streamed so far

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def _echo(self, prompt_index: int, out: RequestOutput) -> _Echo | None:
        if self.echo_tokenizer is None:
            return None
        if prompt_index not in self._echoes:
            self._echoes[prompt_index] = _Echo(out, self.echo_tokenizer)
        return self._echoes[prompt_index]

    def full(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for p, out in enumerate(finals):
            for o in out.outputs:
                choice = {"index": p * self.n + o.index, "finish_reason": o.finish_reason}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": o.text}
                    choice["logprobs"] = _chat_logprobs(o, self.num_logprobs)
                else:
                    echo = self._echo(p, out)
                    choice["text"] = (echo.text if echo else "") + o.text
                    choice["logprobs"] = _completion_logprobs(o, 0, echo)
                choices.append(choice)
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        completion_tokens = sum(len(o.token_ids) for out in finals for o in out.outputs)
        return {**self._head(self.kind), "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    def delta(self, prompt_index: int, o: CompletionOutput, out: RequestOutput) -> _ChoiceDelta:
        index = prompt_index * self.n + o.index
        echo = None
        if index not in self._text_offsets:  # the choice's first chunk
            echo = self._echo(prompt_index, out)
        offset = self._text_offsets.get(index, 0)
        self._text_offsets[index] = offset + len(o.text) + (len(echo.text) if echo else 0)
        return _ChoiceDelta(index, output=o, text_offset=offset, echo=echo)

    def chunk(self, deltas: list[_ChoiceDelta]) -> dict:
        choices = []
        for d in deltas:
            o = d.output
            if self.chat:
                delta = {"role": d.role, "content": ""} if d.role else {"content": o.text} if o.text else {}
                choice = {"index": d.index, "delta": delta, "logprobs": _chat_logprobs(o, self.num_logprobs)}
            else:
                choice = {"index": d.index, "text": (d.echo.text if d.echo else "") + o.text,
                          "logprobs": _completion_logprobs(o, d.text_offset, d.echo)}
            choice["finish_reason"] = o.finish_reason if o is not None else None
            choices.append(choice)
        return {**self._head(self.kind + ".chunk" if self.chat else self.kind), "choices": choices}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head(self.kind + ".chunk" if self.chat else self.kind), "choices": [],
                "usage": _usage(prompt_tokens, completion_tokens)}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _completion_logprobs(o: CompletionOutput, text_offset: int, echo: _Echo | None = None) -> dict | None:
    """The legacy completions form: tokens, token_logprobs, top_logprobs, text_offset; an echoed
    prompt's tokens first."""
    if o.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    if echo is not None:
        if echo.logprobs is not None:
            tokens, token_logprobs, top = (list(x) for x in echo.logprobs)
            offsets = [text_offset + o for o in echo.offsets]
        text_offset += len(echo.text)
    for token_id, step in zip(o.token_ids, o.logprobs):
        chosen = step[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top.append({(lp.decoded_token or str(t)): lp.logprob for t, lp in step.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(o: CompletionOutput | None, num: int) -> dict | None:
    """The chat form: per token its text, logprob, UTF-8 bytes and the `num` most likely alternatives."""
    if o is None or o.logprobs is None:
        return None

    def entry(lp):
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for token_id, step in zip(o.token_ids, o.logprobs):
        top = sorted((lp for lp in step.values() if lp.rank <= num), key=lambda lp: lp.rank)
        content.append({**entry(step[token_id]), "top_logprobs": [entry(lp) for lp in top]})
    return {"content": content}


def served_name(model: str | None) -> str:
    return Path(model).name if model else "stories260K"


def run_server(engine_kwargs: dict, model: str | None, host: str, port: int, served_model_name: str | None,
               chat_template: str | None) -> None:
    import uvicorn

    from fastllm.entrypoints.process_setup import prepare_gc_for_serving

    if chat_template and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    engine = AsyncLLMEngine.from_kwargs(model, **engine_kwargs)
    prepare_gc_for_serving()  # the server process's settings, not the library's (process_setup.py)
    app = build_app(engine, served_model_name or served_name(model), chat_template)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        engine.shutdown()
