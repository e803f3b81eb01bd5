"""An OpenAI-compatible HTTP server over AsyncLLMEngine (`fastllm serve`).

    POST /v1/completions        text or token-id prompts (several per request), n, logprobs, echo, streaming,
                                beam search (vLLM's use_beam_search: one output per prompt, when it ends)
    POST /v1/chat/completions   messages through the tokenizer's chat template (or --chat-template)
    GET  /v1/models, /health, /metrics (Prometheus)

This process does HTTP, auth, validation, tokenization, detokenization, stop strings and SSE; the engine
core runs in a process of its own (AsyncLLMEngine). Each prompt of a request is one engine request (its
n samples forked inside the engine). All are taken before the response starts, so bad input is an HTTP
400 with OpenAI's error body naming the field, never a broken stream; a failed engine step is a 500 for
its requests only. If the engine process dies, /health turns 503, open requests fail with 500 and the
server exits with a non-zero code (run_server), so a supervisor can restart it. On SIGTERM or Ctrl-C it
stops listening, lets open requests run for --shutdown-timeout seconds and then ends those left with a 503
(a stream: an error event and [DONE]), and exits 0.

Streaming is the hot path, one SSE event per engine step per request: the chunks are written as bytes
with msgspec (no pydantic), and a request's reader that falls behind reads merged deltas. A client that
goes away aborts its requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import jinja2
import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from fastllm.engine.async_llm_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestCancelledError,
    RequestFailedError,
    RequestStream,
)
from fastllm.entrypoints.openai.limits import (
    API_KEY_ENV,
    SHUTDOWN_TIMEOUT_S,
    ServerLimits,
    check_shutdown_timeout,
)
from fastllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
    error_body,
    param_of,
    request_schemas,
)
from fastllm.entrypoints.openai.responses import ResponseShape, sse
from fastllm.metrics import ServingMetrics
from fastllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

# add(request_id, prompt): one prompt's engine request, taken (AsyncLLMEngine.add_request or add_beam_search)
_Add = Callable[[str, Any], Awaitable[RequestStream]]

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
ENDED_RESPONSES_S = 5.0  # after the requests are ended, how long their responses may take to be sent
FORCED_RESPONSES_S = 1.0  # the same after a second Ctrl-C (a forced quit)
SHUTTING_DOWN = "the server is shutting down"
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def build_app(engine: AsyncLLMEngine, served_model_name: str, chat_template: str | None = None,
              limits: ServerLimits = ServerLimits(), api_key: str | None = None,
              shutdown_engine: bool = False) -> FastAPI:
    """The app; with shutdown_engine, the server's shutdown also stops the engine core (uvicorn may end
    the process right after, on a signal, so nothing after its run() can be relied on)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.attach()
        yield
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="fastllm", lifespan=lifespan)
    server = _Server(engine, served_model_name, chat_template, limits)
    app.state.server = server
    app.add_middleware(_Guard, api_key=api_key, max_request_bytes=limits.max_request_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, e: ValueError):
        return JSONResponse(error_body(400, str(e), param=param_of(str(e))), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError):
        return JSONResponse(error_body(500, f"the engine is gone: {e}", "InternalServerError"),
                            status_code=500)

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, e: ClientDisconnect):  # before its body was read: nothing failed
        logger.debug("a client left before its request body was read")
        return Response(status_code=499)  # (nginx's "client closed request"; nobody reads it)

    @app.get("/health")
    async def health():
        if engine.errored is not None:
            raise APIError(503, f"the engine is gone: {engine.errored}", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=ServingMetrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        server.check_model(model)
        return server.model_card()

    schemas = request_schemas()

    def body_of(name: str) -> dict:
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schemas[name]}}}}

    @app.post("/v1/completions", openapi_extra=body_of("completion"))
    async def completions(request: Request):
        return await server.complete(decode_body(await server.read_body(request), CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=body_of("chat"))
    async def chat_completions(request: Request):
        return await server.chat(decode_body(await server.read_body(request), ChatCompletionRequest), request)

    def openapi() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            document = get_openapi(title=app.title, version="1", routes=app.routes)
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas["components"])
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
    return app


class _Guard:
    """ASGI middleware: the API key on /v1/* (Bearer, compared in constant time), a body size limit read
    from Content-Length before anything else (read_body enforces it on the body itself), and an error no
    handler expects (a bug of ours; a failed engine step is an APIError of its own) as a 500 for its request
    alone. (Starlette's handler for Exception re-raises after replying, and uvicorn then closes the
    connection, failing a keep-alive client's next request too.)"""

    def __init__(self, app, api_key: str | None, max_request_bytes: int):
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await _reply(send, 401, "Unauthorized: a valid API key is needed "
                                    "(Authorization: Bearer ...)", "AuthenticationError")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_request_bytes):
            return await _reply(send, 413, f"the request body is larger than {self.max_request_bytes} bytes "
                                "(--max-request-bytes)", "RequestTooLargeError")
        unsent = []  # what send raised: the connection is gone (its client left), not a failed request

        async def send_or_note(message):
            try:
                await send(message)
            except Exception as e:
                unsent.append(e)
                raise

        try:
            await self.app(scope, receive, send_or_note)
        except Exception as e:
            if e in unsent:
                logger.debug("a client left while its response was sent (%r)", e)
                return
            logger.error("request failed: %r", e)
            try:
                await _reply(send, 500, f"internal error: {e}", "InternalServerError")
            except Exception:  # its response had begun: nothing more can be said on it
                raise e from None


async def _reply(send, status: int, message: str, kind: str) -> None:
    body = msgspec.json.encode(error_body(status, message, kind))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Server:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, chat_template: str | None,
                 limits: ServerLimits):
        self.engine, self.model_name, self.limits = engine, model_name, limits
        self.tokenizer = engine.tokenizer
        self.chat_template = chat_template
        self.max_model_len = engine.max_model_len
        self.metrics = ServingMetrics(engine)
        self.created = int(time.time())
        self.ended = False  # the server is shutting down and has ended its open requests
        self.reading: set[asyncio.Task] = set()  # requests whose bodies are still arriving

    def end_requests(self) -> None:
        """Shutting down: end every open request (503), those still reading their bodies too, and refuse any
        still being taken."""
        self.ended = True
        self.engine.end_all(SHUTTING_DOWN)
        for task in self.reading:
            task.cancel(SHUTTING_DOWN)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "fastllm",
                "max_model_len": self.max_model_len}

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.model_name}`.", "NotFoundError", "model")

    async def read_body(self, request: Request) -> bytes:
        """The body; a 503 if the server ends its requests before the body has come (a client that sent
        the headers alone would otherwise hold the shutdown until uvicorn cancels its task)."""
        limit, size, chunks = self.limits.max_request_bytes, 0, []
        task = asyncio.current_task()
        self.reading.add(task)
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"the request body is larger than {limit} bytes "
                                   "(--max-request-bytes)", "RequestTooLargeError")
                chunks.append(chunk)
        except asyncio.CancelledError as e:
            if e.args != (SHUTTING_DOWN,):
                raise
            task.uncancel()
            raise APIError(503, SHUTTING_DOWN, "ServiceUnavailableError") from None
        finally:
            self.reading.discard(task)
        return b"".join(chunks)

    # the two endpoints

    async def complete(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        body.check_supported()
        prompts = body.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise APIError(400, f"at most {self.limits.max_prompts} prompts a request (--max-prompts), "
                           f"got {len(prompts)}", param="prompt")
        self._check_common(body)
        score_only = body.max_tokens == 0  # echo the prompt with its logprobs, generate nothing
        if score_only and not body.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
        if body.echo and self.tokenizer is None:
            raise APIError(400, "echo needs the model's tokenizer to write the prompt back", param="echo")
        if body.use_beam_search:
            n, add = self._beam_search(body)
        else:
            params = body.sampling_params(1 if score_only else body.max_tokens, body.logprobs)
            if body.echo and body.logprobs is not None:  # the prompt's tokens come with their logprobs too
                params = params.clone(prompt_logprobs=body.logprobs)
            n, add = params.n, functools.partial(self.engine.add_request, params=params)
        shape = ResponseShape("cmpl", "text_completion", self.model_name, n, chat=False,
                       num_logprobs=body.logprobs, echo_tokenizer=self.tokenizer if body.echo else None,
                       score_only=score_only, token_ids=body.return_token_ids,
                       skip_special_tokens=body.skip_special_tokens)
        return await self._respond(shape, prompts, add, body, request)

    def _beam_search(self, body: CompletionRequest) -> tuple[int, _Add]:
        """use_beam_search: each prompt's engine request is a beam search, its n best beams the choices
        (given once the search ends: a stream has one chunk of them per prompt). Returns (n, the adder)."""
        if body.best_of is not None and body.best_of > self.limits.max_n:
            raise APIError(400, f"best_of must be <= {self.limits.max_n} (--max-n), got {body.best_of}",
                           param="best_of")
        params, n = body.beam_search_params()

        async def add(request_id: str, prompt) -> RequestStream:
            try:
                return await self.engine.add_beam_search(request_id, prompt, params, n,
                                                         body.skip_special_tokens)
            except ValueError as e:
                raise body.beam_search_error(e) from None

        return n, add

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        body.check_supported()
        self._check_common(body)
        try:
            params = body.sampling_params(body.token_limit(), body.num_logprobs())
        except ValueError as e:
            raise body.refusal(e) from None
        shape = ResponseShape("chatcmpl", "chat.completion", self.model_name, params.n, chat=True,
                       num_logprobs=params.logprobs, tokenizer=self.tokenizer,
                       token_ids=body.return_token_ids)
        add = functools.partial(self.engine.add_request, params=params)
        return await self._respond(shape, [await self._chat_prompt(body)], add, body, request)

    def _check_common(self, body) -> None:
        if body.n is not None and body.n > self.limits.max_n:
            raise APIError(400, f"n must be <= {self.limits.max_n} (--max-n), got {body.n}", param="n")

    async def _chat_prompt(self, body: ChatCompletionRequest) -> dict:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids")
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, "this model's tokenizer has no chat template; start the server with "
                           "--chat-template")
        try:
            text = self.tokenizer.apply_chat_template(body.texts(), chat_template=template, tokenize=False,
                                                      add_generation_prompt=body.add_generation_prompt,
                                                      **(body.chat_template_kwargs or {}))
        except TypeError as e:  # a chat_template_kwargs key that is one of apply_chat_template's own
            raise APIError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
        except jinja2.TemplateError as e:  # the template refuses the messages (raise_exception)
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None
        except ValueError as e:  # transformers' checks of its arguments (continue_final_message, tools, ...)
            param = "chat_template_kwargs" if body.chat_template_kwargs else "messages"
            raise APIError(400, f"the chat template could not be applied: {e}", param=param) from None
        # A template that writes the BOS itself gets no second one from the tokenizer.
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special = not (bos and text.startswith(bos))
        try:
            return {"prompt": text, "prompt_token_ids": await self.engine.encode(text, add_special)}
        except ValueError as e:  # empty, or too long for max_model_len
            raise body.refusal(e) from None

    # requests and responses

    async def _respond(self, shape: "ResponseShape", prompts: list, add: _Add, body, request: Request):
        arrival = time.perf_counter()
        streams = await self._add_all(shape.id, prompts, add, body)
        if body.stream:
            if len(streams) == 1:
                chunks = self._stream_one(streams[0], shape, arrival, body.include_usage)
            else:
                chunks = self._stream_many(streams, shape, arrival, body.include_usage)
            return _EventStream(chunks)
        readers = [asyncio.ensure_future(self._final(s)) for s in streams]
        finals = asyncio.gather(*readers)
        # A whole response is written at the end: meanwhile, watch for a client that has gone.
        while not (await asyncio.wait({finals}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                finals.cancel()  # closes the streams, which aborts their requests
                with contextlib.suppress(asyncio.CancelledError):
                    await finals
                self.metrics.requests.labels(finish_reason="abort").inc(shape.n * len(streams))
                return Response(status_code=499)  # nobody reads it
        try:
            outs = finals.result()
        except (RequestFailedError, EngineDeadError) as e:
            for reader in readers:  # the other prompts' output would go unread: abort them
                reader.cancel()
            self.metrics.requests.labels(finish_reason=_unfinished_reason(e)).inc(shape.n * len(streams))
            raise _failure(e) from None
        for out in outs:
            self._record(out, arrival)
        return Response(msgspec.json.encode(shape.full(outs)), media_type="application/json")

    async def _add_all(self, response_id: str, prompts: list, add: _Add, body) -> list[RequestStream]:
        """Every prompt's engine request, taken; on a refused one, abort those already in."""
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = response_id if len(prompts) == 1 else f"{response_id}-{i}"
                streams.append(await add(request_id, prompt))
            if self.ended:  # (taken while end_requests ran: nothing would end it)
                raise APIError(503, SHUTTING_DOWN, "ServiceUnavailableError")
        except BaseException as e:
            for stream in streams:
                await stream.aclose()
            if isinstance(e, ValueError):
                raise body.refusal(e) from None
            raise
        return streams

    async def _final(self, stream: RequestStream) -> RequestOutput:
        last = None
        async with contextlib.aclosing(stream):
            async for last in stream:  # FINAL_ONLY: the one finished output
                pass
        return last

    async def _stream_one(self, stream: RequestStream, shape: "ResponseShape", arrival: float,
                          include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE events of a one-prompt request: the hot path, one event per step that changed it."""
        first_token, last, completion_tokens, unfinished = None, None, 0, "abort"
        try:
            if shape.chat:
                yield shape.role_chunk()
            async for out in stream:
                if first_token is None:
                    first_token = time.perf_counter()
                for o in out.outputs:
                    completion_tokens += len(o.token_ids)
                last = out
                if chunk := shape.chunk(0, out):
                    yield chunk
            if include_usage and last is not None:
                yield shape.usage_chunk(len(last.prompt_token_ids), completion_tokens)
            yield b"data: [DONE]\n\n"
        except (RequestFailedError, EngineDeadError) as e:
            unfinished = _unfinished_reason(e)
            yield sse(_failure(e).body())
            yield b"data: [DONE]\n\n"
        finally:  # done, failed, or the client went away (then this closes the stream: an abort)
            await stream.aclose()
            self._record_stream(last, shape.n, arrival, first_token, completion_tokens, unfinished)

    async def _stream_many(self, streams: list[RequestStream], shape: "ResponseShape", arrival: float,
                           include_usage: bool) -> AsyncIterator[bytes]:
        """Several prompts: each read by a task of its own into one queue, written in arrival order."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream):
            first_token, last, tokens, unfinished = None, None, 0, "abort"
            try:
                async for out in stream:
                    first_token = first_token or time.perf_counter()
                    tokens += sum(len(o.token_ids) for o in out.outputs)
                    last = out
                    await merged.put((index, out))
            except (RequestFailedError, EngineDeadError) as e:
                unfinished = _unfinished_reason(e)
                await merged.put((index, e))
            finally:
                await stream.aclose()
                self._record_stream(last, shape.n, arrival, first_token, tokens, unfinished)
                await merged.put((index, (len(last.prompt_token_ids) if last else 0, tokens)))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            if shape.chat:
                yield shape.role_chunk()
            open_streams, prompt_tokens, completion_tokens = len(tasks), 0, 0
            while open_streams:
                index, item = await merged.get()
                if isinstance(item, tuple):  # that prompt's stream ended: its usage
                    open_streams -= 1
                    prompt_tokens, completion_tokens = prompt_tokens + item[0], completion_tokens + item[1]
                elif isinstance(item, Exception):  # as _stream_one: the error, then [DONE] (no usage)
                    yield sse(_failure(item).body())
                    yield b"data: [DONE]\n\n"
                    return
                elif chunk := shape.chunk(index, item):
                    yield chunk
            if include_usage:
                yield shape.usage_chunk(prompt_tokens, completion_tokens)
            yield b"data: [DONE]\n\n"
        finally:  # done, or the client went away: the pumps close their streams, aborting what is left
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _record(self, out: RequestOutput, arrival: float) -> None:
        tokens = sum(len(o.token_ids) for o in out.outputs)
        m = self.metrics
        for o in out.outputs:
            m.requests.labels(finish_reason=o.finish_reason or "abort").inc()
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(tokens)
        first_token = out.metrics.get("first_token_time")
        if first_token is not None:
            m.time_to_first_token.observe(first_token - arrival)
        m.e2e_latency.observe(time.perf_counter() - arrival)

    def _record_stream(self, last: RequestOutput | None, n: int, arrival: float, first_token: float | None,
                       completion_tokens: int, unfinished: str) -> None:
        """unfinished: the finish reason counted if the stream did not end ("error": the engine failed it;
        "abort": the client left, or the server ended it)."""
        m = self.metrics
        if last is None or not last.finished:
            m.requests.labels(finish_reason=unfinished).inc(n)
            return
        for o in last.outputs:
            m.requests.labels(finish_reason=o.finish_reason or "abort").inc()
        m.prompt_tokens.inc(len(last.prompt_token_ids))
        m.generation_tokens.inc(completion_tokens)
        if first_token is not None:
            m.time_to_first_token.observe(first_token - arrival)
        m.e2e_latency.observe(time.perf_counter() - arrival)


class _EventStream(Response):
    """An SSE response: Starlette's StreamingResponse without its task group per response, so each
    event costs one send. A client that disconnects cancels the writing (which aborts the requests)."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes]):
        super().__init__(media_type=self.media_type)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # chunked
        self.chunks = chunks

    async def __call__(self, scope, receive, send) -> None:
        writer = asyncio.current_task()
        gone = False

        async def watch():
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            writer.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            writer.uncancel()  # the client left: the response simply ends
        finally:
            watcher.cancel()
            await self.chunks.aclose()


def _unfinished_reason(e: Exception) -> str:
    """The finish reason /metrics counts for a request the engine did not finish: "abort" where the server
    ended it (shutting down), as where its client left; else "error"."""
    return "abort" if isinstance(e, RequestCancelledError) else "error"


def _failure(e: Exception) -> APIError:
    """A request the engine did not finish: 503 if the server ended it (shutting down), else 500."""
    if isinstance(e, RequestCancelledError):
        return APIError(503, str(e), "ServiceUnavailableError")
    return APIError(500, str(e), "InternalServerError")


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, whose shutdown (SIGTERM, Ctrl-C) gives open requests shutdown_timeout seconds to
    finish and then ends those left through the engine: a stream gets a 503 error event and [DONE], a whole
    response a 503. (uvicorn alone would cancel their tasks mid-write after its own timeout.) A second
    Ctrl-C (uvicorn's forced quit) ends them at once the same way, and stops the app as usual: uvicorn would
    leave the requests' tasks and the app's lifespan to be cancelled with the loop, each a traceback."""

    def __init__(self, app: FastAPI, shutdown_timeout: float, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=shutdown_timeout + ENDED_RESPONSES_S,
                                        **config))
        self.app_server: _Server = app.state.server
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        ender = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.app_server.end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()
        if self.force_exit:
            if not self.app_server.ended:
                self.app_server.end_requests()
            deadline = time.monotonic() + FORCED_RESPONSES_S
            while self.server_state.tasks and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if not self.lifespan.shutdown_event.is_set():  # (set: the quit came during uvicorn's own)
                await self.lifespan.shutdown()


def log_fast_path() -> None:
    """Say which event loop and HTTP parser uvicorn will use: uvloop and httptools (the `serve` extra)
    cost less per streamed token than asyncio's loop and h11."""
    import importlib.util

    missing = [m for m in ("uvloop", "httptools") if importlib.util.find_spec(m) is None]
    if missing:
        logger.warning("%s not installed: serving on %s (more CPU per streamed token; pip install %s)",
                       " and ".join(missing), "asyncio's loop and h11" if len(missing) == 2 else
                       "asyncio's loop" if "uvloop" in missing else "h11", " ".join(missing))
    else:
        logger.info("serving on uvloop and httptools")


def served_name(model: str | None) -> str:
    return Path(model).name if model else "stories260K"


def resolve_api_key(api_key: str | None) -> str | None:
    """--api-key, else $FASTLLM_API_KEY, else none (an empty variable is unset; an empty --api-key, an error:
    it would serve with no key)."""
    if api_key == "":
        raise ValueError("--api-key is empty, which would serve with no key: leave it out to serve "
                         "without one")
    return api_key or os.environ.get(API_KEY_ENV) or None


def read_chat_template(chat_template: str | None) -> str | None:
    """--chat-template as a template: a file's text, or the text itself (a Jinja template holds a tag);
    compiled here, so a broken one stops the server at startup rather than failing every chat request."""
    if not chat_template:
        return chat_template
    if Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    elif "{{" not in chat_template and "{%" not in chat_template:
        raise ValueError(f"--chat-template is neither a file nor a Jinja template: {chat_template!r:.80}")
    from transformers.utils.chat_template_utils import _compile_jinja_template  # as apply_chat_template does

    try:
        _compile_jinja_template(chat_template)
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template does not compile: {e}") from None
    return chat_template


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine starts: a host that is no address here or a port in use
    is a ValueError naming it now, not an exit once the model has loaded."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"host={host!r} is not an address to listen on ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds: a restart reuses it)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"port={port}: cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


class _Terminated(Exception):
    """SIGTERM, as KeyboardInterrupt is SIGINT."""


def _raise_terminated(signum, frame):
    raise _Terminated


def run_server(engine_kwargs: dict, model: str | None, host: str, port: int, served_model_name: str | None,
               chat_template: str | None, api_key: str | None = None, limits: ServerLimits = ServerLimits(),
               log_requests: bool = True, uvicorn_log_level: str = "info",
               shutdown_timeout: float = SHUTDOWN_TIMEOUT_S) -> int:
    """Serve until stopped; returns the exit code (1 when the engine process died)."""
    from fastllm.config import EngineConfig, has_tokenizer
    from fastllm.entrypoints.process_setup import prepare_gc_for_serving
    from fastllm.worker.worker import device_type

    chat_template = read_chat_template(chat_template)
    api_key = resolve_api_key(api_key)
    check_shutdown_timeout(shutdown_timeout)
    config = EngineConfig.from_kwargs(model, **engine_kwargs)  # a bad argument fails before the engine starts
    config.check_device_args(device_type(config))  # (the engine process checks them again, with tracebacks)
    if chat_template and not has_tokenizer(config.model.tokenizer_path):
        raise ValueError("chat_template formats chat messages for the model's tokenizer, and this model has "
                         "none (its chat endpoint answers 400 either way)")
    # uvicorn shuts down on SIGINT / SIGTERM, then raises the signal again: done, and exit 0. Either signal
    # while the engine starts stops the start (its core process killed, not waited for): exit 0 too.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    engine = None
    try:
        with listening_socket(host, port) as sock:
            if api_key is None and host not in _LOCAL_HOSTS:
                logger.warning("serving on %s without an API key: anyone who can reach it can use it "
                               "(--api-key or %s)", host, API_KEY_ENV)
            engine = AsyncLLMEngine.from_config(config)
            prepare_gc_for_serving()  # the server process's settings, not the library's (process_setup.py)
            app = build_app(engine, served_model_name or served_name(model), chat_template, limits, api_key,
                            shutdown_engine=True)
            log_fast_path()
            server = DrainingServer(app, shutdown_timeout, host=host, port=port, log_level=uvicorn_log_level,
                                    access_log=log_requests)
            engine.on_death(lambda reason: setattr(server, "should_exit", True))
            bound = sock.getsockname()[1]
            # (uvicorn logs its address only for sockets it binds itself)
            logging.getLogger("uvicorn.error").info("Serving on http://%s:%d (Press CTRL+C to quit)",
                                                    f"[{host}]" if ":" in host else host, bound)
            server.run(sockets=[sock])
    except (KeyboardInterrupt, _Terminated):
        if engine is None:
            logger.info("stopped while the engine was starting")
            return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if engine is not None:
            engine.shutdown()  # if the app never started
    if engine.errored is not None:
        logger.error("exiting: %s", engine.errored)
        return 1
    return 0
