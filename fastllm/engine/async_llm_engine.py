"""AsyncLLMEngine: an LLMEngine stepped by a background thread, streaming RequestOutputs to asyncio callers.

    engine = AsyncLLMEngine.from_kwargs("path/to/model")
    async for out in engine.generate("Once upon a time", SamplingParams(max_tokens=32), "req-1"):
        ...   # one RequestOutput per step that changed the request (params.output_kind decides its form)

add_request() separates the two halves: it returns once the engine has taken the request (or raises its
ValueError), with the RequestStream of its outputs, so a server can refuse bad input before it streams.

Only the engine thread touches the LLMEngine, which is not thread-safe. Callers queue commands (add,
abort); the thread applies them between steps, steps while any request is unfinished, and hands each
output to its request's asyncio.Queue on the caller's event loop. So the event loop (an HTTP server's)
never blocks on a step, and a step never waits for the event loop. (Both still share the GIL: the
host work of a step and of the HTTP handlers interleave.)

A request whose consumer goes away early (a closed stream, a cancelled task) is aborted and its KV
blocks freed. A bad request raises its ValueError from generate() and the engine serves on. If a step
itself fails, every open request gets that error and the engine refuses new ones (`errored`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from fastllm.engine.llm_engine import LLMEngine, PromptType
from fastllm.outputs import RequestOutput
from fastllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutputs, ending with a finished one, an exception or _ABORTED

    def put(self, item) -> bool:
        """False when the consumer's event loop is closed (nobody will read this stream again)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    stream: _Stream
    added: asyncio.Future  # done once add_request returned (or raised)


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self.errored: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="fastllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_kwargs(model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> "RequestStream":
        """Queue the request; once the engine has taken it, return the stream of its outputs (until the
        last, finished=True). Raises the request's ValueError if the engine refused it."""
        if self.errored is not None:
            raise RuntimeError(f"the engine stopped after an error: {self.errored!r}")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        added = loop.create_future()
        self._commands.put(_Add(request_id, prompt, params, stream, added))
        try:
            await added
        except asyncio.CancelledError:  # cancelled while queued: the request may be in by now
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream.queue)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """add_request and iterate: vLLM's AsyncLLMEngine.generate."""
        outputs = await self.add_request(request_id, prompt, params)
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                yield output

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends without a final output, its blocks are freed; unknown ids are
        ignored. (A consumer that stops iterating aborts its request itself.)"""
        self._commands.put(_Abort(request_id))

    def shutdown(self) -> None:
        self._commands.put(_Stop())
        self._thread.join()

    # the engine thread

    def _loop(self) -> None:
        device = self.engine.worker.device
        if device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(device)
        while True:
            busy = self.errored is None and self.engine.has_unfinished_requests()
            commands = [] if busy else [self._commands.get()]  # idle: sleep until a command comes
            while True:  # and take whatever else has come
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if not self._apply(command):
                    return
            if self.errored is None and self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # the engine's state is unknown: end every request, refuse new ones
                    logger.exception("engine step failed; failing %d open requests", len(self._streams))
                    self.errored = e
                    for stream in self._streams.values():
                        stream.put(RuntimeError(f"engine step failed: {e!r}"))
                    self._streams.clear()
                    continue
                for output in outputs:
                    self._deliver(output)

    def _apply(self, command) -> bool:
        """Apply one command; False means stop the loop."""
        if isinstance(command, _Stop):
            for request_id in list(self._streams):
                self._abort(request_id)
            return False
        if isinstance(command, _Abort):
            self._abort(command.request_id)
            return True
        try:
            if self.errored is not None:
                raise RuntimeError(f"the engine stopped after an error: {self.errored!r}")
            if command.request_id in self._streams:
                raise ValueError(f"request id {command.request_id!r} is already in use")
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except Exception as e:
            _resolve(command, e)
            return True
        self._streams[command.request_id] = command.stream
        if not _resolve(command, None):
            self._abort(command.request_id)
        return True

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            if self.errored is None:
                self.engine.abort_request(request_id)
            stream.put(_ABORTED)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        if not stream.put(output) and not output.finished:
            self._abort(output.request_id)  # its event loop is gone


_ABORTED = object()  # a stream's end without a final output


class RequestStream:
    """The outputs of one request, as an async iterator. Closing it before the last output, being
    cancelled while waiting for one, or being dropped unfinished aborts the request (frees its blocks)."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, outputs: asyncio.Queue):
        self.engine, self.request_id, self._outputs = engine, request_id, outputs
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._outputs.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if item is _ABORTED or isinstance(item, BaseException):
            self.finished = True  # the engine has dropped the request already
            if item is _ABORTED:
                raise StopAsyncIteration
            raise item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    def __del__(self):
        if not self.finished:
            self.engine.abort(self.request_id)  # a thread-safe queue put


def _resolve(command: _Add, error: BaseException | None) -> bool:
    """Tell generate() that its request was queued (or why not); False when its event loop is closed."""
    def settle():
        if command.added.done():  # generate() was cancelled meanwhile
            return
        if error is None:
            command.added.set_result(None)
        else:
            command.added.set_exception(error)
    try:
        command.stream.loop.call_soon_threadsafe(settle)
    except RuntimeError:
        return False
    return True
