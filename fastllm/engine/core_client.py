"""EngineCoreClient: the API process's end of the engine core.

It starts the core (core_proc.py) in a process of its own, or in a thread over an LLMEngine that is
already built (tests, notebooks: the same sockets and messages, without a second process), sends it
requests and aborts, and hands every message from it to `on_message`, one message per engine step.

No thread of ours reads the core: the event loop in use watches the output socket's file descriptor
(add_reader), and the core's end (the process sentinel, or a pipe the core thread closes when it
returns). When the core dies, `on_death` is called with the reason after the messages it sent before
dying, and every later send raises EngineDeadError; nothing waits on a dead core.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

import fastllm
from fastllm.engine.core_proc import make_socket, receive_all, run_engine_core
from fastllm.engine.messages import CoreMessage, EngineReady, Shutdown, UtilityCall, UtilityResult

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is gone: nothing more will be served until the server is restarted."""


class _CoreProcess:
    """`python -m fastllm.engine.core_proc` (a fresh interpreter: no fork of this process, no re-import
    of its main module), its config pickled through stdin."""

    def __init__(self, config, input_address: str, output_address: str):
        # Its copy of the write end closes when it exits, so this read end turns readable (EOF) then.
        self.sentinel, write_end = os.pipe()
        level = logging.getLogger("fastllm").getEffectiveLevel()
        # The same fastllm as this process's, wherever the working directory is.
        root = str(Path(fastllm.__file__).resolve().parents[1])
        path = [root, *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastllm.engine.core_proc", input_address, output_address,
             str(os.getpid()), str(level)], stdin=subprocess.PIPE, pass_fds=(write_end,), env=env)
        os.close(write_end)
        self.proc.stdin.write(pickle.dumps(config))
        self.proc.stdin.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def reason(self) -> str:
        return f"the engine core process exited with code {self.proc.wait()}"

    def stop(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # (it ignores SIGTERM: core_proc.py)
            self.proc.kill()
            self.proc.wait()
        _close_once(self)


class _CoreThread:
    def __init__(self, engine, input_address: str, output_address: str):
        self.error: BaseException | None = None
        self.sentinel, self._write_end = os.pipe()  # closed by the thread when it returns: readable (EOF)
        self.thread = threading.Thread(target=self._run, args=(engine, input_address, output_address),
                                       name="fastllm-engine-core", daemon=True)
        self.thread.start()

    def _run(self, engine, input_address: str, output_address: str) -> None:
        device = engine.worker.device
        if device.type == "cuda":  # the current device is per thread
            import torch

            torch.cuda.set_device(device)
        try:
            run_engine_core(lambda: engine, input_address, output_address)
        except BaseException as e:
            logger.exception("the engine core thread failed")
            self.error = e
        finally:
            os.close(self._write_end)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def reason(self) -> str:
        return "the engine core thread ended" + (f": {self.error!r}" if self.error else "")

    def stop(self, timeout: float) -> None:
        self.thread.join(timeout)
        _close_once(self)


def _close_once(core) -> None:
    if core.sentinel is not None:
        os.close(core.sentinel)
        core.sentinel = None


class EngineCoreClient:
    def __init__(self, start: Callable[[str, str], _CoreProcess | _CoreThread]):
        self._dir = tempfile.mkdtemp(prefix="fastllm-core-")
        input_address, output_address = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._context = zmq.Context()
        self._input = make_socket(self._context, zmq.PUSH)
        self._output = make_socket(self._context, zmq.PULL)
        self._input.setsockopt(zmq.IMMEDIATE, 1)  # a send with no live core fails at once instead of queueing
        self._input.bind(input_address)
        self._output.bind(output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self.on_message: Callable[[CoreMessage], None] = lambda message: None
        self.on_death: Callable[[str], None] = lambda reason: None
        self.dead: str | None = None  # why the core is gone
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._core = start(input_address, output_address)
        self._finalizer = weakref.finalize(self, _release, self._core, self._dir, self._context, self._input,
                                           self._output)
        try:
            self.ready = self._wait_ready()
        except BaseException:  # (also Ctrl-C, or a SIGTERM handler's exception, while the core starts)
            self._closing = True
            self._core.stop(timeout=0)  # a core building its engine reads no Shutdown: it is not waited for
            self._finalizer()
            raise

    @classmethod
    def start_process(cls, config) -> "EngineCoreClient":
        """The core in a spawned process, built from the config (returns once it is ready)."""
        return cls(lambda i, o: _CoreProcess(config, i, o))

    @classmethod
    def start_thread(cls, engine) -> "EngineCoreClient":
        """The core of an LLMEngine already built, stepped by a thread of this process."""
        return cls(lambda i, o: _CoreThread(engine, i, o))

    def _wait_ready(self) -> EngineReady:
        while not self._output.poll(200):
            if not self._core.alive():
                raise RuntimeError(f"the engine core failed to start: {self._core.reason()} (its log above "
                                   "says why)")
        message = self._decoder.decode(self._output.recv())
        if not isinstance(message, EngineReady):
            raise RuntimeError(f"the engine core said {type(message).__name__} before it was ready")
        return message

    # sending

    def send(self, message) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            self._input.send(self._encoder.encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineDeadError("the engine core is not reachable") from None

    async def call(self, method: str, *args):
        """EngineCore utility `method` (core_proc.UTILITIES), run between two steps."""
        self.attach()
        call_id = next(self._calls)
        future = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        self.send(UtilityCall(call_id, method, list(args)))
        return await future

    def call_sync(self, method: str, *args, timeout: float = 30.0):
        """call() for code outside an event loop (tests); messages that come meanwhile go to on_message."""
        call_id = next(self._calls)
        self.send(UtilityCall(call_id, method, list(args)))
        deadline = time.monotonic() + timeout
        while True:
            for message in self.drain():
                if isinstance(message, UtilityResult) and message.call_id == call_id:
                    if message.error is not None:
                        raise RuntimeError(f"engine core {method}: {message.error}")
                    return message.result
                self._dispatch(message)
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine core {method} did not answer in {timeout} s")
            if not self._output.poll(50) and not self._core.alive():
                self._died()

    # receiving

    def attach(self) -> None:
        """Read the core on the running event loop (again, if an earlier loop was in use)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop or self.dead is not None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._output.getsockopt(zmq.FD))
            self._loop.remove_reader(self._core.sentinel)
        self._loop = loop
        loop.add_reader(self._output.getsockopt(zmq.FD), self._on_readable)
        loop.add_reader(self._core.sentinel, self._died)
        loop.call_soon(self._on_readable)  # messages that came while no loop was reading

    def drain(self) -> list:
        """Every message that has come."""
        return [] if self._output.closed else receive_all(self._output, self._decoder)

    def _on_readable(self) -> None:
        for message in self.drain():
            self._dispatch(message)

    def _dispatch(self, message) -> None:
        if isinstance(message, UtilityResult):
            future = self._pending_calls.pop(message.call_id, None)
            if future is not None and not future.done():
                if message.error is not None:
                    future.set_exception(RuntimeError(message.error))
                else:
                    future.set_result(message.result)
            return
        self.on_message(message)

    def _died(self) -> None:
        if self.dead is not None or self._closing:
            return
        self._on_readable()  # what it sent before it went
        self.dead = self._core.reason()
        logger.error("%s: failing every open request", self.dead)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._output.getsockopt(zmq.FD))
            self._loop.remove_reader(self._core.sentinel)
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(self.dead))
        self._pending_calls.clear()
        self.on_death(self.dead)

    # the end

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the core to stop (kill it if it does not within timeout) and release everything."""
        if self._closing:
            return
        self._closing = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._output.getsockopt(zmq.FD))
            self._loop.remove_reader(self._core.sentinel)
        _stop_core(self._core, self._input, timeout)
        self._finalizer()


def _stop_core(core, input_socket: zmq.Socket, timeout: float) -> None:
    if not input_socket.closed:
        try:
            input_socket.send(msgspec.msgpack.encode(Shutdown()), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # no live core to tell
            pass
    core.stop(timeout)


def _release(core, directory: str, context: zmq.Context, input_socket: zmq.Socket,
             output_socket: zmq.Socket) -> None:
    """After shutdown(), or at exit or when a client is dropped without it: no core outlives its client,
    and no socket keeps the interpreter from exiting."""
    _stop_core(core, input_socket, timeout=5)
    input_socket.close(linger=0)
    output_socket.close(linger=0)
    context.term()
    shutil.rmtree(directory, ignore_errors=True)
