"""AsyncLLMEngine: streams RequestOutputs to asyncio callers from an engine core that runs elsewhere.

    engine = AsyncLLMEngine.from_kwargs("path/to/model")      # the core in its own process
    async for out in engine.generate("Once upon a time", SamplingParams(max_tokens=32), "req-1"):
        ...   # one RequestOutput per engine step that changed it (params.output_kind decides its form)

This process tokenizes and validates (a bad request raises its ValueError from add_request, before
anything reaches the core), sends token ids to the core (EngineCoreClient: ZeroMQ + msgspec), and turns
each step's message of new token ids into RequestOutputs: text, stop strings, logprobs. A stop string
found here stops the sample in the core. AsyncLLMEngine(llm_engine) runs the core of an engine already
built on a thread of this process instead (tests): the same messages, without a second process.

add_request() returns the RequestStream of the request's outputs once it is sent; add_beam_search() that
of a beam search, which gives one output, its beams, when the search ends. A stream keeps at
most one output waiting: when its reader falls behind, DELTA outputs are merged into it (so a slow
reader costs one wake-up per read, not one per token) and other kinds keep only the newest. A stream
closed early, cancelled or dropped aborts its request. A request whose engine step failed raises
RequestFailedError from its stream; the engine serves on. end_all() ends every open request (a server
shutting down): each stream raises RequestCancelledError. If the core dies, every stream raises
EngineDeadError, as does every later add_request, and `on_death` callbacks run (the server exits).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor

from fastllm.config import EngineConfig
from fastllm.engine.core_client import EngineCoreClient, EngineDeadError
from fastllm.engine.input_processor import InputProcessor, PromptType, check_request_id
from fastllm.engine.messages import (
    Abort,
    BeamSearchRequest,
    EngineCoreRequest,
    SchedulerStats,
    StepOutputs,
    beam_params_to_wire,
    params_to_wire,
    sample_ids,
)
from fastllm.engine.output_processor import OutputProcessor
from fastllm.engine.tokenizer import eos_token_id, load_tokenizer
from fastllm.outputs import RequestOutput
from fastllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestCancelledError", "RequestFailedError",
           "RequestStream"]

# Texts longer than this are tokenized on a worker thread (tokenizers releases the GIL), so a huge
# prompt does not hold up the streams of others.
TOKENIZE_IN_THREAD_CHARS = 4096


class RequestFailedError(RuntimeError):
    """The engine step that served this request raised; the engine goes on with the others."""


class RequestCancelledError(RequestFailedError):
    """The engine's owner ended this request before it finished (end_all: a server shutting down)."""


class AsyncLLMEngine:
    def __init__(self, engine=None, *, client: EngineCoreClient | None = None, tokenizer=None):
        """engine: an LLMEngine whose core a thread of this process steps; or client: a started core
        (which has no tokenizer), with this process's tokenizer (None: the model has none)."""
        if (engine is None) == (client is None):
            raise ValueError("AsyncLLMEngine takes an LLMEngine or an EngineCoreClient (one of the two)")
        if engine is not None and tokenizer is not None:
            raise ValueError("AsyncLLMEngine(engine) uses the engine's tokenizer: pass no tokenizer")
        self.engine = engine  # the in-thread LLMEngine (tests look inside); None with a core process
        self.client = client or EngineCoreClient.start_thread(engine)
        ready = self.client.ready
        self.tokenizer = tokenizer = engine.tokenizer if engine is not None else tokenizer
        self.eos_token_id = eos_token_id(tokenizer, ready.config_eos_token_id)
        self.max_model_len = ready.max_model_len
        self.input_processor = InputProcessor(tokenizer, ready.vocab_size, ready.max_model_len,
                                              ready.max_num_seqs)
        # Long texts are encoded on a thread of their own, with a tokenizer of their own (a tokenizer is
        # not thread-safe), one at a time.
        self._thread_input_processor = copy.copy(self.input_processor)
        self._thread_input_processor.tokenizer = copy.deepcopy(tokenizer)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="fastllm-tokenize")
        self.output_processor = OutputProcessor(tokenizer)
        self.stats = SchedulerStats()  # the core's, after its last step
        self.errored: EngineDeadError | None = None
        self._shut_down = False
        self._streams: dict[str, _Collector] = {}
        # The core knows each request as "<k>:<request id>", k new for every request sent: an id may be used
        # again as soon as its request has ended here, while the core may still send outputs of the old one
        # (until the abort, or the stop a stop string found here, reaches it). Those are dropped by their k.
        self._incarnations = itertools.count()
        self._live: set[str] = set()  # the k of each request whose stream is open
        self._death_callbacks: list[Callable[[str], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.client.on_message = self._on_message
        self.client.on_death = self._on_death

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "AsyncLLMEngine":
        return cls.from_config(EngineConfig.from_kwargs(model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLMEngine":
        """The engine core in a process of its own (returns once it is ready). This process loads its
        tokenizer while the core starts."""
        loading = _in_background(load_tokenizer, config.model.tokenizer_path)
        client = EngineCoreClient.start_process(config)
        try:
            tokenizer = loading.result()
        except BaseException:
            client.shutdown()
            raise
        return cls(client=client, tokenizer=tokenizer)

    def on_death(self, callback: Callable[[str], None]) -> None:
        self._death_callbacks.append(callback)

    # requests

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams) -> "RequestStream":
        """Validate, tokenize and send the request; return the stream of its outputs (until the last,
        finished=True). Raises the request's ValueError (nothing sent) or EngineDeadError."""
        check_request_id(request_id)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = await self._tokenize(prompt)
        params.tokenize_bad_words(self.tokenizer)
        self.input_processor.check_request(token_ids, params, self.eos_token_id)
        self._check_unused({request_id, *sample_ids(request_id, params.n)})
        self.output_processor.add_group(request_id, text, token_ids, params)
        message = EngineCoreRequest(request_id, token_ids, self.eos_token_id, params_to_wire(params))
        return self._send(request_id, message, merge=params.output_kind == RequestOutputKind.DELTA)

    async def add_beam_search(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                              num_beams: int | None = None,
                              skip_special_tokens: bool = True) -> "RequestStream":
        """Validate, tokenize and send a beam search; its stream gives one output, when the search ends:
        its num_beams best beams (all beam_width by default), best first, one CompletionOutput each.
        Raises the request's ValueError (nothing sent) or EngineDeadError."""
        check_request_id(request_id)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if num_beams is not None and not (type(num_beams) is int and 1 <= num_beams <= params.beam_width):
            raise ValueError(f"num_beams must be an integer in [1, beam_width ({params.beam_width})], "
                             f"got {num_beams!r}")
        text, token_ids = await self._tokenize(prompt)
        self.input_processor.check_beam_search(token_ids, params, self.eos_token_id)
        self._check_unused({request_id})
        self.output_processor.add_beam_search(request_id, text, token_ids, num_beams, skip_special_tokens)
        message = BeamSearchRequest(request_id, token_ids, self.eos_token_id, beam_params_to_wire(params))
        return self._send(request_id, message, merge=False)

    async def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        self._check_alive()
        self.attach()
        if isinstance(prompt, str):
            return prompt, await self.encode(prompt)
        return self.input_processor.tokenize(prompt)

    def _check_unused(self, ids: set[str]) -> None:
        self._check_alive()  # (the engine may have died while the prompt was tokenized)
        processor = self.output_processor
        for i in ids:
            if i in processor.groups or i in processor.group_of or i in processor.beam_searches:
                raise ValueError(f"request id {i!r} is already in use")

    def _send(self, request_id: str, message: EngineCoreRequest | BeamSearchRequest,
              merge: bool) -> "RequestStream":
        """Send what the output processor has just taken in; the stream of its outputs."""
        collector = _Collector(asyncio.get_running_loop(), merge, str(next(self._incarnations)))
        self._streams[request_id] = collector
        self._live.add(collector.k)
        message.request_id = collector.core_id(request_id)
        try:
            self.client.send(message)
        except BaseException:  # not sent: nothing of it may stay here
            self._drop(request_id)
            raise
        return RequestStream(self, request_id, collector)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text (ValueError if it cannot be one); a long one on a worker thread."""
        if len(text) <= TOKENIZE_IN_THREAD_CHARS:
            return self.input_processor.encode(text, add_special_tokens)
        self.input_processor.check_text_length(text)  # too long for the context: refused at once
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, self._thread_input_processor.encode, text, add_special_tokens)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """add_request and iterate: vLLM's AsyncLLMEngine.generate."""
        outputs = await self.add_request(request_id, prompt, params)
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                yield output

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends without a final output, its blocks are freed; unknown ids are
        ignored. (A consumer that stops iterating aborts its request itself.)"""
        self._end(request_id, _ABORTED)

    def end_all(self, reason: str) -> None:
        """End every open request now: each stream raises RequestCancelledError(reason), and the core
        aborts them (frees their blocks)."""
        for request_id in list(self._streams):
            self._end(request_id, RequestCancelledError(reason))

    def _end(self, request_id: str, end, collector: "_Collector | None" = None) -> None:
        """End the open request request_id (only if its stream is `collector`, when given): its stream
        reads `end`, the core aborts it."""
        if collector is not None and self._streams.get(request_id) is not collector:
            return  # ended already; the id may be another request's by now
        collector = self._drop(request_id)
        if collector is not None:
            collector.put(end)
            self._abort_in_core([collector.core_id(request_id)])

    def _abort_in_core(self, core_ids: list[str]) -> None:
        if self.errored is None:
            with contextlib.suppress(EngineDeadError):
                self.client.send(Abort(core_ids))

    def _drop(self, request_id: str) -> "_Collector | None":
        self.output_processor.abort(request_id)
        collector = self._streams.pop(request_id, None)
        if collector is not None:
            self._live.remove(collector.k)
        return collector

    async def call_core(self, method: str, *args):
        """An EngineCore utility (core_proc.UTILITIES), e.g. "is_idle"."""
        self._check_alive()
        self.attach()
        return await self.client.call(method, *args)

    def shutdown(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)
        self._shut_down = True
        self.client.shutdown()
        self._tokenizer_thread.shutdown(wait=False)

    # messages from the core

    def attach(self) -> None:
        """Read the core on the running loop (a server calls this at startup, so a core that dies before
        any request is seen at once); streams of an earlier loop (closed: nobody reads them) end."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        for request_id, collector in list(self._streams.items()):
            if collector.loop is not loop:
                self.abort(request_id)
        self._loop = loop
        self.client.attach()

    def _on_message(self, message) -> None:
        if not isinstance(message, StepOutputs):
            return
        self.stats = message.stats
        if not message.outputs and not message.beam_searches:
            return
        core_ids = {}  # of this message's live samples: their ids here -> the core's
        samples = self._live_outputs(message.outputs, core_ids)
        outputs, to_stop = self.output_processor.process(samples)
        if to_stop:
            self._abort_in_core([core_ids[sample_id] for sample_id in to_stop])
        searches = self._live_outputs(message.beam_searches, core_ids)
        outputs += self.output_processor.process_beam_searches(searches)
        streams = self._streams
        for out in outputs:
            collector = streams.get(out.request_id)
            if collector is None:
                continue
            if out.finished:
                del streams[out.request_id]
                self._live.remove(collector.k)
            collector.put(RequestFailedError(out.error) if out.error is not None else out)

    def _live_outputs(self, outputs: list, core_ids: dict[str, str]) -> list:
        """The outputs of requests still open here, under their own ids (core_ids: each one's core id); a
        late output of an ended request is dropped."""
        live = []
        for out in outputs:
            k, _, own_id = out.request_id.partition(":")
            if k in self._live:
                core_ids[own_id], out.request_id = out.request_id, own_id
                live.append(out)
        return live

    def _on_death(self, reason: str) -> None:
        self.errored = EngineDeadError(reason)
        for request_id, collector in list(self._streams.items()):
            self.output_processor.abort(request_id)
            collector.put(self.errored)
        self._streams.clear()
        self._live.clear()
        for callback in self._death_callbacks:
            callback(reason)

    def _check_alive(self) -> None:
        if self.errored is not None:
            raise self.errored
        if self._shut_down:  # (its sockets are closed: ZeroMQ's own error said nothing of why)
            raise EngineDeadError("the engine was shut down")


_ABORTED = object()  # a stream's end without a final output


def _in_background(fn: Callable, *args) -> Future:
    """fn(*args) on a daemon thread: one that exit does not wait for (a Ctrl-C while the core starts)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # (for result() to raise)
            future.set_exception(e)

    threading.Thread(target=run, name="fastllm-load-tokenizer", daemon=True).start()
    return future


class _Collector:
    """The outputs of one request not read yet: at most one (vLLM's RequestOutputCollector)."""

    __slots__ = ("loop", "merge", "k", "item", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, merge: bool, k: str):
        self.loop, self.merge, self.k = loop, merge, k  # k: the request's number in the core's ids
        self.item = None  # a RequestOutput, an exception or _ABORTED
        self.waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        pending = self.item
        if pending is None:
            self.item = item
        elif not isinstance(pending, RequestOutput):
            return  # an end (an error, an abort) is waiting: nothing after it is read
        elif self.merge and isinstance(item, RequestOutput):
            _merge_delta(pending, item)
        else:
            self.item = item  # the newest whole output, or an end
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            try:
                waiter.set_result(None)
            except RuntimeError:  # its loop is closed: nobody will read this
                pass

    def core_id(self, sample_id: str) -> str:
        """The core's id of this request (its request id) or of one of its samples."""
        return f"{self.k}:{sample_id}"

    async def get(self):
        while self.item is None:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item, self.item = self.item, None
        return item


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Append a DELTA output to the one still waiting to be read (same samples, same order)."""
    for a, b in zip(into.outputs, new.outputs):
        a.text += b.text
        a.token_ids.extend(b.token_ids)
        if b.logprobs is not None:
            a.logprobs.extend(b.logprobs)
        a.cumulative_logprob = b.cumulative_logprob
        a.finish_reason, a.stop_reason = b.finish_reason, b.stop_reason
    into.finished, into.prompt_logprobs, into.error = new.finished, new.prompt_logprobs, new.error
    into.metrics.update(new.metrics)


class RequestStream:
    """The outputs of one request, as an async iterator. Closing it before the last output, being
    cancelled while waiting for one, or being dropped unfinished aborts the request (frees its blocks)."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, collector: _Collector):
        self.engine, self.request_id, self._collector = engine, request_id, collector
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._collector.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if not isinstance(item, RequestOutput):
            self.finished = True  # the engine has dropped the request already
            if item is _ABORTED:
                raise StopAsyncIteration
            raise item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._end(self.request_id, _ABORTED, self._collector)

    def __del__(self):
        if not self.finished:
            try:
                loop = self._collector.loop
                if not loop.is_closed():
                    loop.call_soon_threadsafe(self.engine._end, self.request_id, _ABORTED, self._collector)
            except Exception:
                pass
