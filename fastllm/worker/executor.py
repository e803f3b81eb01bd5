"""The engine's steps on tensor_parallel_size x pipeline_parallel_size ranks, one process and one
device each.

On one device the engine drives a plain Worker (no process, no collective); above that, a
MultiprocExecutor with the same methods. Rank 0 lives in the engine's process: with one pipeline stage
it samples, so the engine reads its tokens as it does on one device, async scheduling included. The
other ranks are worker processes (worker_process.py), which this executor spawns on one node, or which
torchrun started on several: then every rank runs the same command and LLMEngine(...) turns the ranks
above 0 into workers (torchrun_worker below).

Each step's SchedulerOutput is pickled once and the same bytes go to every worker. With pipeline
stages the tokens come back from the last stage's first rank, one message a step, and the executor
passes them on to the earlier stages (rank 0 among them) with the next step's message.

A worker that exits, fails (its traceback comes back), closes its connection or leaves an answer
waiting longer than distributed_timeout_s raises a RuntimeError naming its rank; so does a collective
that times out, naming the spawned workers that did not start the step. Every later call raises it
again; shutdown() ends every worker, as does dropping the executor or the engine process's exit.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import secrets
import socket
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, Listener, wait

import torch

from fastllm.config import EngineConfig
from fastllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from fastllm.distributed.parallel_state import ParallelRank, check_no_process_group, destroy_distributed
from fastllm.worker import worker_process as wp
from fastllm.worker.async_output import AsyncRunnerOutput
from fastllm.worker.worker import Worker

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a wait looks at the workers' health
MONITOR_JOIN_S = 10.0  # the worker monitor ends at once when every worker has exited; this bounds a stuck one


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"))


def torchrun_worker(config: EngineConfig) -> None:
    """A rank above 0 under torchrun: serve the rank-0 engine's steps until it shuts down, then end
    the process (the same command runs on every rank; only rank 0 goes on past LLMEngine(...))."""
    par = config.parallel
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    check_torchrun_world(config, world)
    parallel = ParallelRank.of(rank, par.tensor_parallel_size, par.pipeline_parallel_size)
    wp.serve_rank(wp.RankSetup(config, parallel, int(os.environ["LOCAL_RANK"]), "env://"))
    sys.exit(0)


def check_torchrun_world(config: EngineConfig, world: int) -> None:
    if world != config.parallel.world_size:
        raise ValueError(f"torchrun started {world} ranks but tensor_parallel_size x pipeline_parallel_size "
                         f"is {config.parallel.world_size}")


def uses_cuda(config: EngineConfig) -> bool:
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def main_script_hidden():
    """spawn runs the parent's main script again in each child (to find what it defines); a worker
    needs nothing from it, and a script without an `if __name__ == "__main__"` guard would build its
    engine again in there. So children start while the main module shows neither file nor spec."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class WorkerFailed(RuntimeError):
    pass


def _on_every_rank(method):
    """A call that runs on every rank at once: a KeyboardInterrupt inside it (a second Ctrl-C:
    engine/interrupts.py) may leave rank 0 out of step with its workers, whose collectives would then pair
    with the wrong ones, so the executor refuses every later call."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except KeyboardInterrupt:
            self._fail("interrupted (KeyboardInterrupt) inside a step of several ranks, which may no longer "
                       "be in step: shut this engine down and build another")
            raise
    return call


def os_process_state(pid: int) -> str:
    """What the OS says of a pid: its /proc State line, or that no such process exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "no such process"
    except PermissionError:
        return "another user's process (the pid was reused)"
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((" ".join(line.split()) for line in status if line.startswith("State:")), "running")
    except OSError:
        return "running"


class _Workers:
    """The worker processes and connections, apart from the executor so that a finalizer can end
    them when an executor is dropped without shutdown()."""

    def __init__(self):
        self.procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self.conns: dict[int, Connection] = {}
        self.monitor: threading.Thread | None = None  # watch_workers
        self.joined = False  # the groups are this engine's to leave (a refused second engine's are not)
        self.closing = False

    def close(self, failed: bool = False) -> None:
        self.closing = True
        for conn in self.conns.values():
            try:
                conn.send_bytes(wp.dumps(wp.SHUTDOWN))
            except OSError:
                pass
        for proc in self.procs.values():
            proc.join(timeout=0 if failed else 10)
            if proc.is_alive():  # SIGKILL: under `fastllm serve` it ignores SIGTERM, as the core it came from
                proc.kill()
                proc.join()
            if proc.is_alive():  # reaped outside multiprocessing, whose poll then never sees the exit
                logger.warning("worker pid %d: multiprocessing still counts it alive after SIGKILL and join "
                               "(the OS: %s)", proc.pid, os_process_state(proc.pid))
        for conn in self.conns.values():
            conn.close()
        if self.monitor is not None:
            # Its end drops its hold on the process groups, whose destructor releases the GIL; a daemon thread
            # that wants the GIL back while the interpreter finalizes is ended by pthread_exit, inside that
            # destructor: std::terminate, the process aborted at exit. So it ends here, not at exit.
            self.monitor.join(timeout=MONITOR_JOIN_S)
        if self.joined:
            destroy_distributed()


_parked: "MultiprocExecutor | None" = None  # ranks kept for this process's next engine (reuse_workers)


def end_parked_workers() -> None:
    """End the ranks an engine with reuse_workers left behind, if any."""
    global _parked
    parked, _parked = _parked, None
    if parked is not None:
        parked._end()


def ranks_layout(config: EngineConfig) -> tuple:
    """What must match for an engine to reuse another's ranks."""
    par = config.parallel
    return par.tensor_parallel_size, par.pipeline_parallel_size, par.distributed_timeout_s, uses_cuda(config)


class MultiprocExecutor:
    @classmethod
    def start(cls, config: EngineConfig) -> "MultiprocExecutor":
        """New ranks, or the parked ones of the engine before (reuse_workers) loading this model."""
        global _parked
        parked, _parked = _parked, None
        if parked is not None:
            if config.parallel.reuse_workers and ranks_layout(parked.config) == ranks_layout(config):
                parked.rebuild(config)
                return parked
            parked._end()
        return cls(config)

    def __init__(self, config: EngineConfig):
        par = config.parallel
        self.config = config
        self.tp, self.pp = par.tensor_parallel_size, par.pipeline_parallel_size
        self.world_size = par.world_size
        self.timeout_s = par.distributed_timeout_s
        self.output_rank = (self.pp - 1) * self.tp  # TP rank 0 of the last stage
        self.workers = _Workers()
        self._finalizer = weakref.finalize(self, self.workers.close)
        self.progress = None  # spawned workers' last launched step ids
        self.failure: str | None = None  # set once; every later call raises it
        self._exited: int | None = None  # a spawned worker's rank, as the monitor saw it exit
        self._last_sent_step = 0
        # Rank 0 as an earlier pipeline stage: its outputs awaiting the last stage's tokens.
        self._launched: dict[int, AsyncRunnerOutput] = {}
        self._forward: dict[int, dict[str, list[int]]] = {}  # tokens for the earlier stages' next message
        try:
            check_no_process_group()
            setup = self._join_torchrun() if launched_by_torchrun() else self._spawn()
            self.workers.joined = True  # (from here on its groups, once joined, are this engine's to leave)
            self.groups = wp.join(setup)
            self.local_rank = setup.local_rank
            if launched_by_torchrun():
                self._accept_torchrun_workers()
            self.worker = wp.load_worker(setup, self.groups)
            # Rank 0's random state, as its Worker seeded it: swapped in for every call into the worker.
            self.device = self.worker.device
            self._random_state = _random_state(self.device)
            for rank in self.workers.conns:
                self._receive(rank, wp.READY)
        except BaseException as e:
            # (rank 0 may have been in a collective with a worker that failed to start; its own ValueError
            # names an argument, and stays)
            blamed = None
            own = isinstance(e, (ValueError, WorkerFailed)) or not isinstance(e, Exception)
            if self.workers.conns and not own:
                blamed = self._blame_worker(e)
            self.workers.close(failed=True)
            if blamed is not None:
                raise blamed from e
            raise
        if self.workers.procs:  # (the thread holds no reference to the executor, which may be dropped)
            self.workers.monitor = threading.Thread(
                target=watch_workers, args=(self.workers, self.groups, weakref.ref(self)),
                name="fastllm-worker-monitor", daemon=True)
            self.workers.monitor.start()
        logger.info("%d ranks ready: tensor_parallel_size %d x pipeline_parallel_size %d%s", self.world_size,
                    self.tp, self.pp, " (torchrun)" if launched_by_torchrun() else "")

    @property
    def driver_worker(self) -> Worker:
        """Rank 0's Worker, in this process."""
        return self.worker

    def rebuild(self, config: EngineConfig) -> None:
        """Load another engine's model (and settings) into the same ranks."""
        self.config = config
        self._send_all(wp.dumps(wp.REBUILD, config))
        self.worker = None  # the old model and KV cache go first
        setup = wp.RankSetup(config, ParallelRank.of(0, self.tp, self.pp), self.local_rank, "")
        self.worker = self._guarded(wp.load_worker, setup, self.groups)
        for rank in self.workers.conns:
            self._receive(rank, wp.READY, skip=wp.OUTPUT)  # a step the old engine left unread
        self._last_sent_step = 0
        self._launched, self._forward = {}, {}
        if self.progress is not None:
            self.progress[:] = [0] * self.world_size

    # startup

    def _spawn(self) -> wp.RankSetup:
        if uses_cuda(self.config) and torch.cuda.device_count() < self.world_size:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks need "
                             f"as many GPUs, this machine has {torch.cuda.device_count()} "
                             "(tensor_parallel_size)")
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.progress = ctx.Array("q", self.world_size, lock=False)
        log_level = logging.getLogger("fastllm").getEffectiveLevel()
        for rank in range(1, self.world_size):
            parent_end, child_end = ctx.Pipe()
            setup = wp.RankSetup(self.config, ParallelRank.of(rank, self.tp, self.pp), rank, init_method)
            proc = ctx.Process(target=wp.spawned_main, name=f"fastllm-rank{rank}", daemon=True,
                               args=(setup, child_end, self.progress, torch.get_num_threads(), log_level))
            with main_script_hidden():
                proc.start()
            child_end.close()
            self.workers.procs[rank], self.workers.conns[rank] = proc, parent_end
        for rank in self.workers.conns:
            self._receive(rank, wp.HELLO)
        return wp.RankSetup(self.config, ParallelRank.of(0, self.tp, self.pp), 0, init_method)

    def _join_torchrun(self) -> wp.RankSetup:
        check_torchrun_world(self.config, int(os.environ["WORLD_SIZE"]))
        return wp.RankSetup(self.config, ParallelRank.of(0, self.tp, self.pp), int(os.environ["LOCAL_RANK"]),
                            "env://")

    def _accept_torchrun_workers(self) -> None:
        authkey = secrets.token_bytes(32)
        with Listener(("0.0.0.0", 0), authkey=authkey) as listener:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            wp.share_engine_address(self.groups, (host, listener.address[1], authkey))
            for _ in range(self.world_size - 1):
                conn = listener.accept()
                _, rank = wp.loads(conn.recv_bytes())  # HELLO
                self.workers.conns[rank] = conn

    # the calls every rank makes at once

    def determine_num_blocks(self) -> tuple[int, int]:
        """The KV blocks every rank can hold (the minimum over the ranks)."""
        return self._call("agree_num_blocks")

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self._call("init_kv_cache", num_blocks, num_cpu_blocks)

    def step_costs(self) -> tuple[dict[int, float], dict[int, float]]:
        """The speculation policy's step costs, measured on every rank at once (rank 0's)."""
        return self._call("step_costs")

    def measure_all_reduce(self, sizes: list[int]) -> list[float]:
        """Milliseconds per tensor-parallel all-reduce of each size in bytes (rank 0's timing)."""
        return self._call("measure_all_reduce", sizes)

    @_on_every_rank
    def _call(self, name: str, *args):
        self._send_all(wp.dumps(wp.CALL, name, args))
        return self._guarded(wp.CALLS[name], self.worker, self.groups, *args)

    def kv_cache_gib(self) -> float:
        return self.worker.kv_cache_gib()

    # steps

    @_on_every_rank
    def execute_model(self, sched: SchedulerOutput):
        """Send the step to every worker and run rank 0's part; the returned output's result() gives
        the step's tokens (rank 0's own with one stage, the last stage's otherwise)."""
        self._raise_if_failed()
        forwarded, self._forward = self._forward, {}
        self._send_all(wp.dumps(wp.STEP, sched, forwarded))
        self._last_sent_step = sched.step_id
        if self.pp == 1:
            return _CheckedOutput(self._guarded(self.worker.execute_model, sched), self)
        wp.forward_tokens(self._launched, forwarded)
        output = self._guarded(self.worker.execute_model, sched)
        if output.sample_states:
            self._launched[sched.step_id] = output
        return _StageOutput(self, sched.step_id)

    @_on_every_rank
    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        """The output rank's tokens of a step (pipeline parallelism), passed on to the earlier stages."""
        if step_id == self._last_sent_step:  # nothing after it will make the output rank finish it
            self._send(self.output_rank, wp.dumps(wp.FLUSH))
        _, got_step, result = self._receive(self.output_rank, wp.OUTPUT)
        assert got_step == step_id, f"the output of step {got_step} came while step {step_id}'s was awaited"
        tokens = {r: t for r, t in zip(result.req_ids, result.sampled_token_ids) if t}
        if tokens:
            self._forward[step_id] = tokens
        return result

    # failures

    def _send(self, rank: int, payload: bytes) -> None:
        try:
            self.workers.conns[rank].send_bytes(payload)
        except OSError as e:
            raise self._fail(f"worker rank {rank} is gone ({type(e).__name__} on its connection, exit code "
                             f"{self._exit_code(rank)})") from None

    def _exit_code(self, rank: int) -> int | str:
        """A spawned worker's exit code, once its process is reaped (a closed connection comes first), waiting
        up to 1 s. Polled: where the monitor thread reaps it first, this thread's wait finds no child and
        returns before the monitor has stored the code."""
        proc = self.workers.procs.get(rank)
        if proc is None:
            return "unknown"
        deadline = time.monotonic() + 1.0
        while proc.exitcode is None and time.monotonic() < deadline:
            proc.join(timeout=POLL_S)
        return proc.exitcode if proc.exitcode is not None else "none yet"

    def _send_all(self, payload: bytes) -> None:
        for rank in self.workers.conns:
            self._send(rank, payload)

    def _receive(self, rank: int, kind: str, skip: str | None = None) -> tuple:
        """The next message from a worker (passing over `skip` ones), which must be `kind`; raises
        naming the rank if it fails, exits or stays silent for distributed_timeout_s."""
        conn, proc = self.workers.conns[rank], self.workers.procs.get(rank)
        deadline = time.monotonic() + self.timeout_s
        while not conn.poll(POLL_S):
            self._raise_if_failed()
            if proc is not None and not proc.is_alive():
                raise self._fail(f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
            if time.monotonic() > deadline:
                raise self._fail(f"worker rank {rank} sent nothing for {self.timeout_s:.0f} s "
                                 f"(distributed_timeout_s){self._laggards('; ')}")
        try:
            message = wp.loads(conn.recv_bytes())
        except (EOFError, OSError):
            code = self._exit_code(rank)
            raise self._fail(f"worker rank {rank} closed its connection (exit code {code})") from None
        if message[0] == wp.ERROR:
            raise self._fail(f"worker rank {rank} failed:\n{message[2]}")
        if message[0] == skip:
            return self._receive(rank, kind, skip)
        if message[0] != kind:
            raise self._fail(f"worker rank {rank} sent {message[0]!r} where {kind!r} was expected")
        return message

    def _guarded(self, fn, *args):
        """Run rank 0's part of a collective step (in its own random state); an error there (a peer gone, a
        timeout) becomes one that names the worker behind it."""
        try:
            with self._own_random_state():
                return fn(*args)
        except Exception as e:
            blamed = self._blame_worker(e)
            if blamed is None:
                raise
            raise blamed from e

    def _blame_worker(self, e: Exception) -> WorkerFailed | None:
        """The worker behind an error rank 0 saw in a collective (a peer gone, a timeout), as an error that
        names it; None if no worker failed."""
        culprit = self._find_failed_worker(grace_s=3.0)
        if culprit is None:
            return None
        return self._fail(f"{culprit} (rank 0 saw: {type(e).__name__}: {str(e)[:200]})")

    @contextlib.contextmanager
    def _own_random_state(self):
        """Rank 0 draws from a random state of its own, as the workers do: the engine process's global one
        is the user's too (torch.manual_seed, another engine built), and a rank 0 that followed it would
        sample other unseeded tokens than its peers, whose KV would then hold tokens it never output."""
        user = _random_state(self.device)
        _set_random_state(self.device, self._random_state)
        try:
            yield
        finally:
            self._random_state = _random_state(self.device)
            _set_random_state(self.device, user)

    def _find_failed_worker(self, grace_s: float) -> str | None:
        """A worker that reported an error, closed its connection or exited, waiting up to grace_s for
        one to show."""
        deadline = time.monotonic() + grace_s
        while True:
            if self.failure is not None:
                return self.failure
            for rank in self.workers.conns:
                found = self._worker_failure(rank)
                if found is not None:
                    return found
            if time.monotonic() > deadline:
                laggards = self._laggards("no worker exited, but ")
                return laggards or None
            time.sleep(POLL_S)

    def _laggards(self, prefix: str) -> str:
        """The spawned workers still short of the last step sent (hung, or slow), after prefix; "" if none."""
        if self.progress is None or not self._last_sent_step:
            return ""
        behind = [r for r in self.workers.procs if self.progress[r] < self._last_sent_step]
        return f"{prefix}ranks that did not start step {self._last_sent_step}: {behind}" if behind else ""

    def _worker_failure(self, rank: int) -> str | None:
        """What is wrong with a worker, if anything: its error report first (it explains the exit)."""
        conn, proc = self.workers.conns[rank], self.workers.procs.get(rank)
        try:
            if conn.poll(0):
                message = wp.loads(conn.recv_bytes())
                if message[0] == wp.ERROR:
                    return f"worker rank {rank} failed:\n{message[2]}"
        except (EOFError, OSError):
            if proc is None:
                return f"worker rank {rank} closed its connection"
            proc.join(timeout=1.0)
        if proc is not None and not proc.is_alive():
            return f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def _fail(self, message: str) -> WorkerFailed:
        if self.failure is None:
            self.failure = message
            logger.error("%s", message)
        return WorkerFailed(self.failure)

    def _raise_if_failed(self) -> None:
        if self.failure is None and self._exited is not None:
            self._fail(self._worker_failure(self._exited) or f"worker rank {self._exited} exited")
        if self.failure is not None:
            raise WorkerFailed(self.failure)

    def shutdown(self) -> None:
        """End every worker (and leave the process group); idempotent. With reuse_workers a healthy
        executor is parked instead, for the next engine of the same ranks (the process's exit still
        ends its workers)."""
        global _parked
        if self.workers.closing or _parked is self:
            return
        if self.config.parallel.reuse_workers and self.failure is None and not launched_by_torchrun():
            if _parked is not None:
                _parked._end()
            self.worker.release_graphs()  # the engine may still hold this Worker (reset_graphs)
            self.worker = None
            _parked = self
            return
        self._end()

    def _end(self) -> None:
        self._finalizer.detach()
        if self.worker is not None:
            self.worker.release_graphs()  # before the process groups (reset_graphs)
        self.workers.close(failed=self.failure is not None)


def watch_workers(workers: _Workers, groups, executor_ref) -> None:
    """Notice a spawned worker's exit at once. On GPUs rank 0 may be waiting inside an NCCL collective
    that the dead rank will never join: abort the process groups so that it returns."""
    sentinels = {proc.sentinel: rank for rank, proc in workers.procs.items()}
    ready = wait(list(sentinels))
    executor = executor_ref()
    if workers.closing or executor is None:
        return
    rank = sentinels[ready[0]]
    executor._exited = rank  # the engine's thread reports it (with the worker's traceback, if it sent one)
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        groups.abort()
    logger.error("worker rank %d (pid %d) exited with code %s", rank, workers.procs[rank].pid,
                 executor._exit_code(rank))  # (after the abort: this waits for the exit code)


def _random_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_random_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _CheckedOutput:
    """Rank 0's output (one pipeline stage), checked against the workers' health once its tokens
    are in: a step whose collective lost a rank must not hand out what it computed."""

    def __init__(self, output: AsyncRunnerOutput, executor: MultiprocExecutor):
        self.output, self.executor = output, executor

    @property
    def wait_s(self) -> float:
        return self.output.wait_s

    @property
    def done(self) -> bool:
        return self.output.done

    def result(self) -> ModelRunnerOutput:
        result = self.output.result()
        self.executor._raise_if_failed()
        return result


class _StageOutput:
    """A step's output while it is in the pipeline: result() waits for the last stage's tokens."""

    def __init__(self, executor: MultiprocExecutor, step_id: int):
        self.executor, self.step_id = executor, step_id
        self.wait_s = 0.0
        self._result: ModelRunnerOutput | None = None

    @property
    def done(self) -> bool:
        return self._result is not None

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            start = time.perf_counter()
            self._result = self.executor.wait_output(self.step_id)
            self.wait_s = time.perf_counter() - start
        return self._result
