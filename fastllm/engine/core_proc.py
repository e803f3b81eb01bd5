"""The engine-core process: an EngineCore stepped by a loop of its own, fed over ZeroMQ.

    API process --PUSH--> EngineCoreRequest, BeamSearchRequest, Abort, UtilityCall, Shutdown --PULL--> here
    API process <--PULL-- EngineReady (once), StepOutputs, UtilityResult                     <--PUSH-- here

Each turn takes every message that has come (waiting for one only when there is nothing to step),
steps once and sends that step's outputs, all requests together, as one message (with the beam
searches that ended in it). Nothing here shares
a GIL with HTTP, tokenization or detokenization. A request the core refuses (its own checks repeat the
API process's) comes back as an error output; a step that raises fails only its requests (EngineCore).
Anything else that escapes ends the process with a non-zero exit code, which the API process sees.

The loop also ends when the process that started it is gone (checked while idle), so a killed server
leaves no engine holding the GPU.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from fastllm.engine.messages import (
    Abort,
    BeamSearchRequest,
    BeamSearchResult,
    ClientMessage,
    CoreMessage,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineReady,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    beam_params_from_wire,
    params_from_wire,
)

logger = logging.getLogger("fastllm.engine.core_proc")  # also when run as __main__

IDLE_POLL_MS = 1000  # how often an idle core checks that its parent is still there


def make_socket(context: zmq.Context, kind: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # no limit: a send never blocks or drops (each side reads all)
    sock.setsockopt(zmq.SNDHWM, 0)
    return sock


def receive_all(sock: zmq.Socket, decoder: msgspec.msgpack.Decoder) -> list:
    """Every message that has come, without waiting (a ZeroMQ descriptor signals edges: read until empty)."""
    messages = []
    while True:
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return messages
        messages.append(decoder.decode(frame.buffer))


def run_engine_core(make_engine: Callable, input_address: str, output_address: str,
                    parent_pid: int | None = None) -> None:
    """Build the engine (an LLMEngine; its EngineCore is what runs), say EngineReady, and serve until
    Shutdown or until parent_pid is gone."""
    context = zmq.Context()
    inbound, outbound = make_socket(context, zmq.PULL), make_socket(context, zmq.PUSH)
    inbound.connect(input_address)  # the client binds both
    outbound.connect(output_address)
    try:
        engine = make_engine()
        config = engine.config
        ready = EngineReady(engine.vocab_size, config.model.max_model_len, engine.worker.runner.eos_token_id,
                            config.scheduler.max_num_seqs, engine.worker.num_gpu_blocks)
        outbound.send(msgspec.msgpack.encode(ready))
        orphaned = CoreLoop(engine.core, inbound, outbound, parent_pid).run()
    finally:
        inbound.close()
        outbound.close()
        context.term()
    if orphaned and input_address.startswith("ipc://"):  # (its client, killed, left its sockets' folder)
        shutil.rmtree(Path(input_address[len("ipc://"):]).parent, ignore_errors=True)


def main(argv: list[str]) -> None:
    """The process's entry point: `python -m fastllm.engine.core_proc IN OUT PARENT_PID LOG_LEVEL`, the
    config pickled on stdin."""
    from fastllm.compile_cache import keep_bytecode

    keep_bytecode()  # before torch is imported (see fastllm/compile_cache.py)
    input_address, output_address, parent_pid, log_level = argv
    logging.basicConfig(level=int(log_level), format="%(levelname)s %(name)s (engine core): %(message)s")
    # Ctrl-C, and a SIGTERM to the whole process group (systemd's stop, `timeout`), reach the server too,
    # which lets its requests in flight finish and then shuts this down; alone, this leaves once its parent
    # is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = pickle.loads(sys.stdin.buffer.read())
    from fastllm.engine.llm_engine import LLMEngine
    from fastllm.entrypoints.process_setup import prepare_gc_for_serving, set_cpu_threads

    set_cpu_threads(config)  # this process's settings, as a `fastllm` command's (process_setup.py)

    def build() -> LLMEngine:
        engine = LLMEngine(config, with_tokenizer=False)  # (requests come as token ids, with their EOS)
        prepare_gc_for_serving()
        return engine

    run_engine_core(build, input_address, output_address, int(parent_pid))


class CoreLoop:
    def __init__(self, core, inbound: zmq.Socket, outbound: zmq.Socket, parent_pid: int | None):
        self.core, self.inbound, self.outbound = core, inbound, outbound
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.encoder = msgspec.msgpack.Encoder()
        self.refused: list[EngineCoreOutput] = []  # requests the core would not take, told with the next send
        self.refused_searches: list[BeamSearchResult] = []  # beam searches likewise
        self.said_idle = True

    def run(self) -> bool:
        """Serve until Shutdown (False) or until the API process is gone (True), checked every step and
        every IDLE_POLL_MS while idle: nobody reads what an orphan computes."""
        core = self.core
        while True:
            if self.orphaned():
                return True
            if not core.has_unfinished_requests():
                if not self.said_idle or self.refused or self.refused_searches:  # the queue depths, refusals
                    self.send(self._news([]))
                    self.said_idle = True
                while not self.inbound.poll(IDLE_POLL_MS):
                    if self.orphaned():
                        return True
            for message in receive_all(self.inbound, self.decoder):
                if not self.handle(message):
                    return False
            if core.has_unfinished_requests():
                self.said_idle = False
                news = self._news(core.step())
                if news.outputs or news.beam_searches:
                    self.send(news)


    def orphaned(self) -> bool:
        if self.parent_pid is None or os.getppid() == self.parent_pid:
            return False
        logger.warning("the API process is gone: the engine core exits")
        return True

    def handle(self, message) -> bool:
        """Apply one message; False means stop."""
        if isinstance(message, EngineCoreRequest):
            try:
                params = params_from_wire(message.params)
                self.core.add_request(message.request_id, message.prompt_token_ids, params,
                                      message.eos_token_id)
            except ValueError as e:
                self.refused.append(EngineCoreOutput(message.request_id, [], "error", error=str(e)))
        elif isinstance(message, BeamSearchRequest):
            try:
                params = beam_params_from_wire(message.params)
                self.core.add_beam_search(message.request_id, message.prompt_token_ids, params,
                                          message.eos_token_id)
            except ValueError as e:
                self.refused_searches.append(BeamSearchResult(message.request_id, [], str(e)))
        elif isinstance(message, Abort):
            self.core.finish_requests(message.request_ids)
        elif isinstance(message, UtilityCall):
            self.send(self.call(message))
        elif isinstance(message, Shutdown):
            return False
        return True

    def call(self, message: UtilityCall) -> UtilityResult:
        method = UTILITIES.get(message.method)
        if method is None:
            return UtilityResult(message.call_id, error=f"no utility {message.method!r}")
        try:
            return UtilityResult(message.call_id, method(self.core, *message.args))
        except Exception as e:
            return UtilityResult(message.call_id, error=repr(e))

    def send(self, message: CoreMessage) -> None:
        self.outbound.send(self.encoder.encode(message), copy=False)

    def _news(self, outputs: list[EngineCoreOutput]) -> StepOutputs:
        """A step's outputs with the refusals since the last send and the beam searches that ended."""
        refused, self.refused = self.refused, []
        searches, self.refused_searches = self.refused_searches + self.core.take_beam_searches(), []
        return StepOutputs(refused + outputs, self.core.stats, searches)


def _is_idle(core) -> bool:
    """No request left; then every KV block must be free (AssertionError otherwise)."""
    if core.has_unfinished_requests():
        return False
    core.check_kv_pool_whole()
    return True


UTILITIES: dict[str, Callable] = {
    "is_idle": _is_idle,
    "num_unfinished_requests": lambda core: len(core.scheduler.requests) + core.scheduler.num_slots,
}



if __name__ == "__main__":
    main(sys.argv[1:])
