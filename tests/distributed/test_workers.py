"""The worker processes: gone after shutdown or when the engine is dropped; a killed worker or a silent
one is an error naming its rank within a timeout, not a hang; n > 1 (copy-on-write blocks on every
rank), prompt logprobs and speculative decoding across ranks; the single-device engine has no
processes and calls no collective."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from fastllm import SamplingParams
from fastllm.distributed import communication
from fastllm.worker.executor import os_process_state
from tests.conftest import PROMPTS, STORIES, cached_llm, python_sigint_handler
from tests.distributed.conftest import (SMALL_KV, forget_parallel_llm, shutdown_parallel_llm,
                                       start_parallel_llm)

KILL_TIMEOUT_S = 30  # the error must come well before this


def worker_processes(llm) -> dict:
    return dict(llm.engine.executor.workers.procs)


def live_worker_monitors() -> list:
    """The executor's monitor threads still running: one left at the interpreter's exit could abort the
    process (executor._Workers.close)."""
    return [t for t in threading.enumerate() if t.name == "fastllm-worker-monitor" and t.is_alive()]


def test_workers_are_gone_after_shutdown_and_serve_n_and_prompt_logprobs(monkeypatch):
    from fastllm.worker import executor, worker

    llm = start_parallel_llm(STORIES, tensor_parallel_size=2, block_size=4, **SMALL_KV)
    procs = worker_processes(llm)
    # Rank 0's CUDA graphs go before its process groups: NCCL (2.26+) waits for the graphs that hold its
    # collectives: in the other order the FP8 2-GPU test hung at shutdown.
    leaving = []
    monkeypatch.setattr(worker.Worker, "release_graphs", lambda self: leaving.append("graphs"))
    monkeypatch.setattr(executor, "destroy_distributed",
                        lambda destroy=executor.destroy_distributed: (leaving.append("groups"), destroy()))
    assert list(procs) == [1] and procs[1].is_alive()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, n=2, prompt_logprobs=2)
        got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        want = cached_llm(block_size=4, **SMALL_KV).generate(PROMPTS[:3], params, use_tqdm=False)
        for g, w in zip(got, want):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            for gp, wp in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
                assert gp.keys() == wp.keys()
                assert all(abs(gp[t].logprob - wp[t].logprob) < 1e-4 for t in gp)
    finally:
        shutdown_parallel_llm(llm)
    assert leaving == ["graphs", "groups"]
    for proc in procs.values():
        assert not proc.is_alive() and proc.exitcode == 0, proc.exitcode
    assert not live_worker_monitors()


def test_a_worker_imports_torch_dynamo_at_startup_not_in_its_first_step():
    """Our custom ops import torch._dynamo at their first call: in a worker process, where nothing compiles on
    the CPU, that was inside the first request's step (rank 0 waited for it at the first all-reduce)."""
    code = ("import sys; from fastllm.config import EngineConfig; from fastllm.worker.worker import Worker; "
            "assert 'torch._dynamo' not in sys.modules; "
            f"Worker(EngineConfig.from_kwargs({STORIES!r}, device='cpu')); "
            "assert 'torch._dynamo' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_workers_end_when_the_engine_is_dropped():
    import gc

    llm = start_parallel_llm(STORIES, tensor_parallel_size=2, **SMALL_KV)
    forget_parallel_llm(llm)
    proc = worker_processes(llm)[1]
    del llm
    gc.collect()
    proc.join(timeout=15)
    assert not proc.is_alive()
    assert not live_worker_monitors()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_a_killed_worker_is_an_error_naming_its_rank(layout):
    llm = start_parallel_llm(STORIES, **layout, **SMALL_KV)
    try:
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        os.kill(worker_processes(llm)[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank 1"):
            llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < KILL_TIMEOUT_S
        with pytest.raises(RuntimeError, match="worker rank 1"):  # and so is every later call
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        procs = worker_processes(llm)
        llm.engine.shutdown()
    # A child reaped outside multiprocessing (a waitpid elsewhere in the process: CI hit it once in ~10 runs,
    # the OS saying "no such process") stays alive to is_alive() forever; close() logs it. Gone is what the
    # OS says: a rank counts alive only where both see it.
    states = {rank: os_process_state(p.pid) for rank, p in procs.items() if p.is_alive()}
    alive = {rank: state for rank, state in states.items() if state != "no such process"}
    assert not alive, f"ranks alive after shutdown (the OS's view): {alive}"


def spawned_main_that_cannot_load(setup, *args):
    """A worker process whose shard fails to load once it has joined the process group (as an out-of-memory
    GPU would), while rank 0 goes on into its own startup's collectives."""
    from fastllm.worker import worker_process

    def load_worker(setup, groups):
        raise RuntimeError(f"rank {setup.parallel.rank} could not load its shard")

    worker_process.load_worker = load_worker
    worker_process.spawned_main(setup, *args)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_a_worker_that_fails_at_startup_is_an_error_naming_its_rank(layout, monkeypatch):
    """Under TP rank 0 was inside a collective when the worker died: it raised gloo's 'Connection reset by
    peer', naming no rank and without the worker's traceback."""
    from fastllm.worker import executor, worker_process

    monkeypatch.setattr(worker_process, "spawned_main", spawned_main_that_cannot_load)
    with pytest.raises(executor.WorkerFailed, match=r"(?s)worker rank 1 failed:.*rank 1 could not load"):
        start_parallel_llm(STORIES, **layout, **SMALL_KV)
    assert not live_worker_monitors()


@pytest.mark.parametrize("second", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_a_refused_second_engine_leaves_the_first_one_whole(second):
    """One multi-process engine a process: a second is refused before it starts workers, and its refusal no
    longer leaves the first engine's process groups (the first failed its next step)."""
    import multiprocessing

    llm = start_parallel_llm(STORIES, tensor_parallel_size=2, **SMALL_KV)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
        children = set(multiprocessing.active_children())
        with pytest.raises(RuntimeError, match="already holds a multi-process engine's process group"):
            start_parallel_llm(STORIES, **second, **SMALL_KV)
        assert set(multiprocessing.active_children()) == children
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
        assert after == before
    finally:
        shutdown_parallel_llm(llm)


@pytest.mark.timeout(120, method="thread")  # (the old code could hang inside a collective)
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_a_ctrl_c_in_a_step_raises_after_it_and_the_engine_goes_on(layout, monkeypatch):
    """A terminal's Ctrl-C reaches the workers too (they ignore it: they died of it) and rank 0 inside a step
    (it raised there, leaving its workers in the step's collectives: later steps failed or hung)."""
    with python_sigint_handler():
        llm = start_parallel_llm(STORIES, **layout, **SMALL_KV)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8)
            want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
            for proc in worker_processes(llm).values():
                os.kill(proc.pid, signal.SIGINT)
            worker, interrupted = llm.engine.executor.worker, []

            def execute_model(sched, run=worker.execute_model):
                if not interrupted:  # (mid-step: rank 0 has sent the step to its workers)
                    interrupted.append(sched.step_id)
                    os.kill(os.getpid(), signal.SIGINT)
                return run(sched)
            monkeypatch.setattr(worker, "execute_model", execute_model)
            with pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS[:2], SamplingParams(max_tokens=40), use_tqdm=False)
            assert interrupted
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
            assert got == want
            assert all(proc.is_alive() for proc in worker_processes(llm).values())
        finally:
            shutdown_parallel_llm(llm)


def test_an_interrupt_that_leaves_the_ranks_out_of_step_fails_the_engine_clearly(monkeypatch):
    """A second Ctrl-C raises inside the step: rank 0 left it halfway, so the engine refuses later steps with
    an error that says why, rather than pairing its next collectives with the workers' stale ones."""
    from fastllm.worker.executor import WorkerFailed

    llm = start_parallel_llm(STORIES, tensor_parallel_size=2, **SMALL_KV)
    procs = worker_processes(llm)
    try:
        def execute_model(sched):
            raise KeyboardInterrupt
        monkeypatch.setattr(llm.engine.executor.worker, "execute_model", execute_model)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        monkeypatch.undo()
        with pytest.raises(WorkerFailed, match="interrupted .* no longer be in step: shut this engine down"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        shutdown_parallel_llm(llm)
    assert not any(proc.is_alive() for proc in procs.values())


def test_os_process_state_tells_a_live_pid_from_a_reaped_one():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert os_process_state(child.pid) == "no such process"
    assert os_process_state(os.getpid()).startswith("State: ")


@pytest.mark.timeout(120, method="thread")  # (the old code waited 30 minutes in gloo, out of signals' reach)
@pytest.mark.parametrize("layout, silent", [
    (dict(pipeline_parallel_size=2), r"worker rank 1 sent nothing for 10 s.*did not start step \d+: \[1\]"),
    (dict(tensor_parallel_size=2), r"did not start step \d+: \[1\].*Timed out")], ids=["pp2", "tp2"])
def test_a_silent_worker_is_an_error_naming_its_rank_after_the_timeout(layout, silent):
    """A stopped worker (SIGSTOP): the engine waits for the last stage's tokens, or in a tensor-parallel
    all-reduce, no longer than distributed_timeout_s (a group from new_group waited torch's default, 30
    minutes, unless given the timeout)."""
    llm = start_parallel_llm(STORIES, **layout, distributed_timeout_s=10.0, **SMALL_KV)
    proc = worker_processes(llm)[1]
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=silent):
            llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 10.0 + 10.0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        llm.engine.shutdown()
    assert not proc.is_alive()


def test_speculative_decoding_across_tensor_parallel_ranks():
    # Every rank runs the (small, unsplit) draft model and verifies with the same gathered logits.
    spec = dict(speculative_model="llama2xs-279K", num_speculative_tokens=3, **SMALL_KV)
    params = [SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12)]
    want = [o.outputs[0].token_ids for o in cached_llm(**spec).generate(PROMPTS[:2], params, use_tqdm=False)]
    llm = start_parallel_llm(STORIES, tensor_parallel_size=2, **spec)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        shutdown_parallel_llm(llm)
    assert got == want


def test_unseeded_sampling_stays_in_step_across_ranks_whatever_the_engine_process_draws():
    """Every rank draws the same unseeded samples from the same gathered logits, each from its own
    random state: the engine process's global state is the user's too (torch.manual_seed, another
    engine built), and a rank 0 that followed it would feed its peers' KV other tokens than its own.
    Each sampled token's logprob is then checked against one process scoring the same text."""
    import torch

    from tests.conftest import tokenize

    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0)
    scorer = cached_llm(**SMALL_KV)
    llm = start_parallel_llm(STORIES, tensor_parallel_size=2, **SMALL_KV)
    try:
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
        torch.manual_seed(99)  # in the engine's process, between two requests
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    finally:
        shutdown_parallel_llm(llm)
    prompt = tokenize([PROMPTS[0]])[0]
    scored = scorer.generate([{"prompt_token_ids": prompt + list(out.token_ids)}],
                             SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    want = scored.prompt_logprobs[len(prompt):]
    for i, token in enumerate(out.token_ids):
        assert abs(out.logprobs[i][token].logprob - want[i][token].logprob) < 1e-4, (i, out.token_ids)


def test_one_device_runs_no_collective(monkeypatch):
    def refuse():
        raise AssertionError("a collective ran on one device")

    monkeypatch.setattr(communication, "get_tp_group", refuse)
    llm = cached_llm()
    assert llm.engine.executor is llm.engine.worker  # no executor, no processes
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
