"""The ranks above 0: a worker process that runs the engine's steps on its shard of the model.

It gets one message per step from the engine (executor.py) over its connection (a pipe when the engine
spawned it, a socket under torchrun) and runs the same step as every other rank: the collectives
inside the forward keep them in lockstep. What comes back is little: the sampled tokens, from the last
pipeline stage's first rank only (with one stage, rank 0 in the engine samples them itself), a ready
message after startup, and the traceback of a failure.

Like the engine, a worker launches step N+1 before it reads step N's tokens, so its host work
overlaps the device. It finishes a step (reads its tokens and, on the output rank, sends them) when
the next step or a FLUSH arrives. The ranks of stages before the last do not sample: the engine
forwards the last stage's tokens to them with a later step's message, before they are needed.

A spawned worker exits when the engine process dies (a watchdog thread waits on the parent) or when
its connection closes, whatever it is blocked on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from fastllm.config import EngineConfig
from fastllm.distributed.communication import get_tp_group
from fastllm.distributed.parallel_state import (
    ParallelRank,
    ProcessGroups,
    destroy_distributed,
    init_distributed,
)
from fastllm.worker.streams import on_engine_stream
from fastllm.worker.worker import Worker, select_device

logger = logging.getLogger(__name__)

# engine -> worker
STEP = "step"  # (SchedulerOutput, forwarded tokens: {step_id: {req_id: tokens}})
FLUSH = "flush"  # finish every launched step now (the engine waits for one with nothing after it)
CALL = "call"  # (name, args): a setup call every rank makes at once (see CALLS)
REBUILD = "rebuild"  # (EngineConfig,): load another engine's model on the same ranks (reuse_workers)
SHUTDOWN = "shutdown"
# worker -> engine
HELLO = "hello"  # (rank,): started, about to join the process group
READY = "ready"  # (rank,): model loaded, groups joined
OUTPUT = "output"  # (step_id, ModelRunnerOutput): the output rank's tokens of a step
ERROR = "error"  # (rank, traceback text)


def dumps(*message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> tuple:
    return pickle.loads(data)


@dataclass
class RankSetup:
    """What every rank, rank 0 included, needs to start."""

    config: EngineConfig
    parallel: ParallelRank
    local_rank: int
    init_method: str  # torch.distributed's rendezvous: tcp://host:port, or env:// under torchrun


def join(setup: RankSetup) -> ProcessGroups:
    """Pick this rank's device and join the engine's process group (every rank at once)."""
    device = select_device(setup.config, setup.local_rank)
    timeout_s = setup.config.parallel.distributed_timeout_s
    return init_distributed(setup.parallel, device, setup.init_method, timeout_s)


def load_worker(setup: RankSetup, groups: ProcessGroups) -> Worker:
    """This rank's Worker (its shard of the model), and the all-reduce path agreed with its peers."""
    worker = Worker(setup.config, setup.parallel, setup.local_rank)
    if setup.parallel.tp_size > 1:
        with on_engine_stream(worker.device):  # (its buffers' setup ordered before the steps that use them)
            get_tp_group().enable_one_shot(worker.runner.dtype, groups.cpu)
    return worker


def share_engine_address(groups: ProcessGroups, address: tuple | None = None) -> tuple:
    """Rank 0 passes (host, port, authkey) of its listener to every rank, over the process group
    (under torchrun, where the workers were not started by the engine)."""
    box = [address]
    dist.broadcast_object_list(box, src=0, group=groups.cpu)
    return box[0]


def agree_num_blocks(worker: Worker, groups: ProcessGroups) -> tuple[int, int]:
    """Each rank's KV block count for its own shard and layers, then the smallest (every rank
    holds the same block ids)."""
    counts = torch.tensor(worker.determine_num_blocks(), dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=groups.cpu)
    worker.num_gpu_blocks, worker.num_cpu_blocks = counts.tolist()
    return worker.num_gpu_blocks, worker.num_cpu_blocks


def init_kv_cache(worker: Worker, groups: ProcessGroups, num_blocks: int, num_cpu_blocks: int) -> None:
    worker.init_kv_cache(num_blocks, num_cpu_blocks)


def step_costs(worker: Worker, groups: ProcessGroups) -> tuple[dict[int, float], dict[int, float]]:
    """The speculation policy's step costs: graph replays, which hold collectives (every rank at once)."""
    return worker.step_costs()


def measure_all_reduce(worker: Worker, groups: ProcessGroups, sizes: list[int]) -> list[float]:
    from fastllm.bench.all_reduce import time_all_reduce

    with on_engine_stream(worker.device):
        return time_all_reduce(get_tp_group(), worker.runner.dtype, sizes)


CALLS = {"agree_num_blocks": agree_num_blocks, "init_kv_cache": init_kv_cache, "step_costs": step_costs,
         "measure_all_reduce": measure_all_reduce}


def forward_tokens(launched: dict, forwarded: dict) -> None:
    """Append the last stage's tokens to this (earlier) stage's request states: for each step, the
    states that step sampled (objects, not ids: an id may already belong to a newer request)."""
    for step_id, tokens in forwarded.items():
        output = launched.pop(step_id, None)
        if output is None:
            continue
        for state in output.sample_states:
            state.output_token_ids.extend(tokens.get(state.req_id, ()))


class WorkerLoop:
    def __init__(self, setup: RankSetup, worker: Worker, groups: ProcessGroups, conn: Connection,
                 progress=None):
        self.setup, self.worker, self.groups, self.conn = setup, worker, groups, conn
        self.parallel = groups.rank
        self.set_overlap(setup.config)
        self.progress = progress  # shared step counters (spawned workers): the engine reads who lags
        self.pending: deque = deque()  # (step_id, AsyncRunnerOutput) launched, not yet finished
        self.launched: dict = {}  # earlier stages: step_id -> its output, until its tokens arrive

    def run(self) -> None:
        while True:
            kind, *payload = loads(self.conn.recv_bytes())
            if kind == STEP:
                self.step(*payload)
            elif kind == FLUSH:
                self.finish(len(self.pending))
            elif kind == CALL:
                name, args = payload
                CALLS[name](self.worker, self.groups, *args)
            elif kind == REBUILD:
                self.rebuild(*payload)
            elif kind == SHUTDOWN:
                self.finish(len(self.pending))
                self.worker.release_graphs()  # before the process groups (reset_graphs)
                return

    def set_overlap(self, config: EngineConfig) -> None:
        # Read a step's tokens when the engine reads rank 0's: the runner decides how to build the next
        # step (in-flight tokens read on the device or not) by whether they were read, and every rank
        # must decide alike. The engine overlaps steps with async scheduling (a speculative step ends
        # before it returns: its output has no tokens on the device, and is finished at once here too).
        self.overlaps_steps = config.scheduler.async_scheduling

    def rebuild(self, config: EngineConfig) -> None:
        self.worker = self.pending = self.launched = None  # the old model and KV cache go first
        self.setup = dataclasses.replace(self.setup, config=config)
        self.set_overlap(config)
        self.worker = load_worker(self.setup, self.groups)
        self.pending, self.launched = deque(), {}
        self.conn.send_bytes(dumps(READY, self.parallel.rank))

    def step(self, sched, forwarded: dict) -> None:
        forward_tokens(self.launched, forwarded)
        output = self.worker.execute_model(sched)
        if self.progress is not None:
            self.progress[self.parallel.rank] = sched.step_id
        self.finish(len(self.pending))  # the steps before this one: their tokens are (nearly) there
        self.pending.append((sched.step_id, output))
        if output.sampled is None or not self.overlaps_steps:  # nothing to wait for, or no overlap
            self.finish(1)

    def finish(self, count: int) -> None:
        for _ in range(count):
            step_id, output = self.pending.popleft()
            result = output.result()
            if self.parallel.is_output_rank:
                self.conn.send_bytes(dumps(OUTPUT, step_id, result))
            elif not self.parallel.is_last_stage and output.sample_states:
                self.launched[step_id] = output


def exit_with_parent() -> None:
    """End this process as soon as its parent (the engine) is gone, whatever the main thread is
    blocked on (a collective, a device sync)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="fastllm-parent-watch", daemon=True).start()


def serve_rank(setup: RankSetup, conn: Connection | None = None, progress=None) -> None:
    """Start this rank, say so to the engine, run steps until SHUTDOWN; a failure goes back as
    ERROR. conn: the engine's pipe to a spawned worker; None under torchrun, where the engine's
    address comes over the process group."""
    from multiprocessing.connection import Client

    rank = setup.parallel.rank
    try:
        if conn is not None:
            conn.send_bytes(dumps(HELLO, rank))
        groups = join(setup)
        if conn is None:
            host, port, authkey = share_engine_address(groups)
            conn = Client((host, port), authkey=authkey)
            conn.send_bytes(dumps(HELLO, rank))
        worker = load_worker(setup, groups)
        conn.send_bytes(dumps(READY, rank))
        WorkerLoop(setup, worker, groups, conn, progress).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.error("rank %d: the engine's connection closed: exiting", rank)
        os._exit(1)
    except BaseException:
        text = traceback.format_exc()
        logger.error("rank %d failed:\n%s", rank, text)
        if conn is not None:
            try:
                conn.send_bytes(dumps(ERROR, rank, text))
            except OSError:
                pass
        os._exit(1)
    finally:
        destroy_distributed()


def spawned_main(setup: RankSetup, conn: Connection, progress, num_threads: int, log_level: int) -> None:
    """Entry point of a worker process the engine spawned."""
    logging.basicConfig(level=log_level,
                        format=f"rank {setup.parallel.rank}: %(levelname)s %(name)s: %(message)s")
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the process group: the engine handles it
    torch.set_num_threads(num_threads)
    serve_rank(setup, conn, progress)
    logging.shutdown()
    os._exit(0)  # done: skip the interpreter's teardown (seconds with torch loaded)
