"""EngineCore: the scheduler and the executor, stepped. Token ids in; each step's new token ids out.

It is LLMEngine minus tokenization and detokenization: the in-process LLMEngine drives one, and so does
the engine-core process behind `fastllm serve` (core_proc.py). Each step is schedule -> execute ->
update; with async scheduling step N+1 is launched before step N's tokens are read (one step in flight,
or one per pipeline stage), and step() returns the outputs of the steps that ended.

A step that raises fails only the requests it scheduled: they finish with finish_reason "error" (the
exception's text in EngineCoreOutput.error), their blocks are freed and the engine goes on with the
others. A failure of the machinery itself is raised instead, so the process can be restarted: a worker
of tensor/pipeline parallelism that is gone, or on a GPU a broken device (every later CUDA call fails).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from fastllm.compile.jit_watch import dynamo_graphs, process_watch
from fastllm.config import EngineConfig
from fastllm.core.beam_search import BeamSearch
from fastllm.core.scheduler import Scheduler
from fastllm.core.scheduler_output import SchedulerOutput
from fastllm.engine.input_processor import InputProcessor
from fastllm.engine.messages import BeamSearchResult, EngineCoreOutput, SchedulerStats, sample_ids
from fastllm.engine.request import Request, RequestStatus
from fastllm.sampling_params import BeamSearchParams, SamplingParams
from fastllm.tracing import nvtx_range
from fastllm.worker.async_output import AsyncRunnerOutput
from fastllm.worker.executor import WorkerFailed

logger = logging.getLogger(__name__)

SLOW_STEP_SECONDS = 1.0  # a step longer than this is logged: a stall every request in flight feels


class EngineCore:
    def __init__(self, config: EngineConfig, executor, scheduler: Scheduler, vocab_size: int):
        """executor: a Worker, or a MultiprocExecutor (tensor/pipeline parallelism) with its methods."""
        self.config, self.executor, self.scheduler = config, executor, scheduler
        self.worker = executor.driver_worker  # rank 0's, in this process
        self.checker = InputProcessor(None, vocab_size, config.model.max_model_len,
                                      config.scheduler.max_num_seqs)
        self.async_scheduling = config.scheduler.async_scheduling
        # Steps launched before their tokens are read: one with async scheduling, one per pipeline stage
        # (each stage works on a different batch).
        self._in_flight: deque[tuple[SchedulerOutput, AsyncRunnerOutput]] = deque()
        self._max_in_flight = config.parallel.pipeline_parallel_size if self.async_scheduling else 0
        self._failed_beam_searches: list[tuple[str, str]] = []  # (search id, error) until taken
        # Requests whose last output has not been returned yet (finished ones wait for it in _finish).
        self._samples: dict[str, list[str]] = {}  # request id -> its samples' ids
        self._live: dict[str, tuple[str, Request]] = {}  # sample id -> (request id, the sample)
        self.last_step_wait_s = 0.0  # the last step()'s wait for the GPU (bench: host = step - wait)
        self._finished_work = [0, 0]  # tokens, requests of the steps the last step() finished (its log)
        self.stats = SchedulerStats()
        self._kernel_compiles = process_watch()  # kernels first met by a step (a JIT stall)
        self._compiles_seen = self._compiles_now()  # (Triton kernels, torch.compile graphs) so far

    # requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_id: int | None) -> list[str]:
        """Queue a request (n samples) that ends at eos_token_id (None: none ends it); returns the samples'
        ids. ValueError, and nothing queued, if it cannot be served or an id is taken."""
        max_tokens = self.checker.check_request(prompt_token_ids, params, eos_token_id)
        ids = sample_ids(request_id, params.n)
        self._check_unused({request_id, *ids})
        block_size, hash_fn = self.config.cache.block_size, self.scheduler.hash_fn
        samples: list[Request] = []
        for i, sample_id in enumerate(ids):
            sample_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i)
            samples.append(Request(sample_id, prompt_token_ids, sample_params, eos_token_id, max_tokens,
                                   block_size, hash_fn, fork_of=samples[0] if i else None))
        self._samples[request_id] = ids
        for sample in samples:
            self._live[sample.request_id] = (request_id, sample)
            self.scheduler.add_request(sample)
        return ids

    def add_beam_search(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
                        eos_token_id: int | None) -> None:
        """Queue a beam search; its one output comes from take_beam_searches() when it ends. ValueError,
        and nothing queued, if it cannot be served or its id is taken."""
        max_tokens = self.checker.check_beam_search(prompt_token_ids, params, eos_token_id)
        self._check_unused({request_id})
        search = BeamSearch(request_id, prompt_token_ids, params, eos_token_id, max_tokens)
        first = Request(self.scheduler.new_beam_id(search), prompt_token_ids, params.sampling_params(),
                        eos_token_id, max_tokens, self.config.cache.block_size, self.scheduler.hash_fn)
        self.scheduler.add_beam_search(search, first)

    def _check_unused(self, ids: set[str]) -> None:
        sched = self.scheduler
        for i in ids:  # (beams are the scheduler's requests)
            if i in self._samples or i in self._live or i in sched.requests or i in sched.beam_searches:
                raise ValueError(f"request id {i!r} is already in use")

    def finish_requests(self, ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests (all their samples), beam searches (no output) or single samples; unknown ids
        are ignored."""
        samples = []
        for i in ids:
            samples += self._samples.get(i, [i] if i in self._live else [])
            self.scheduler.finish_beam_search(i)
        self.scheduler.finish_requests(samples, status)
        for sample_id in samples:
            self._forget(sample_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def _forget(self, sample_id: str) -> None:
        request_id, _ = self._live.pop(sample_id, (None, None))
        if request_id is None:
            return
        samples = self._samples[request_id]
        samples.remove(sample_id)
        if not samples:
            del self._samples[request_id]

    # the loop

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch one step; return the outputs of the step before it (async
        scheduling: its tokens were copied back while this one was being prepared) or of this
        one (async_scheduling=False, and speculative steps, which end before they return: the
        next step is scheduled from their proposals)."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        self.last_step_wait_s = 0.0
        self._finished_work = [0, 0]
        outputs = []
        while self._in_flight and (self._in_flight[0][1].done  # a speculative step
                                   or self.scheduler.beams_wait_for_steps_in_flight()):
            # (beams wait for their reports: finish the step so that they join the next one, at the cost of
            # the overlap for the requests beside them)
            outputs += self._finish(*self._in_flight.popleft())
        with nvtx_range("schedule"):
            scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not self._in_flight \
                and self.scheduler.has_unfinished_requests() \
                and not (scheduler_output.blocks_to_swap_out or scheduler_output.finished_req_ids):
            raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.requests)} requests "
                               "pending")
        try:
            launched = (scheduler_output, self.executor.execute_model(scheduler_output))
        except Exception as e:
            # The runner may not have dropped the requests this step told it about.
            self.scheduler.finished_req_ids |= scheduler_output.finished_req_ids
            while self._in_flight:
                outputs += self._finish(*self._in_flight.popleft())
            outputs += self._fail(scheduler_output, e)
        else:
            if self.async_scheduling and not scheduler_output.is_empty:
                self._in_flight.append(launched)
                if len(self._in_flight) > self._max_in_flight:
                    outputs += self._finish(*self._in_flight.popleft())
            else:
                while self._in_flight:  # nothing new was launched: nothing to overlap with
                    outputs += self._finish(*self._in_flight.popleft())
                outputs += self._finish(*launched)
        decode_step = self.worker.runner.last_decode_step
        if decode_step is not None and self.scheduler.spec_policy is not None:
            speculative, batch_size, caught_up = decode_step
            self.scheduler.spec_policy.observe(speculative, batch_size, time.perf_counter() - start, caught_up)
        self._record(scheduler_output, time.perf_counter() - start, time.thread_time() - cpu_start)
        return outputs

    def _finish(self, scheduler_output: SchedulerOutput,
                runner_output: AsyncRunnerOutput) -> list[EngineCoreOutput]:
        self._finished_work[0] += scheduler_output.total_num_scheduled_tokens
        self._finished_work[1] += len(scheduler_output.num_scheduled_tokens)
        try:
            with nvtx_range("wait_tokens"):
                result = runner_output.result()
            self.last_step_wait_s += runner_output.wait_s
            with nvtx_range("update"):
                updated = self.scheduler.update_from_output(scheduler_output, result)
        except Exception as e:
            return self._fail(scheduler_output, e)
        logprobs, prompt_logprobs = result.logprobs, result.prompt_logprobs
        outputs = []
        for request, tokens in updated:
            req_id = request.request_id
            out = EngineCoreOutput(req_id, tokens)
            if req_id in logprobs and tokens:  # (a stop may have cut the step's tokens)
                out.logprobs = logprobs[req_id][:len(tokens)]
            if req_id in prompt_logprobs:
                out.prompt_logprobs = prompt_logprobs[req_id]
            if request.is_finished:
                out.finish_reason, out.stop_reason = request.status.finish_reason, request.stop_reason
                self._forget(req_id)
            outputs.append(out)
        if prompt_logprobs:  # prompt chunks that sampled nothing yet
            sent = {o.request_id for o in outputs}
            outputs += [EngineCoreOutput(req_id, [], prompt_logprobs=entries) for req_id, entries
                        in prompt_logprobs.items() if req_id not in sent and req_id in self._live]
        return outputs

    def _fail(self, scheduler_output: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """A step raised: its requests end with the error, the others go on."""
        if isinstance(error, WorkerFailed):  # a rank is gone: every later step would fail too
            raise error
        scheduled, searches = self.scheduler.fail_step(scheduler_output)
        # The step's samples not reported yet (some may have finished in it before it raised).
        failed = [r for r in scheduled if self._live.get(r.request_id, (None, None))[1] is r]
        names = [r.request_id for r in failed] + searches
        logger.error("a step failed (%r); failing its %d requests: %s", error, len(names),
                     ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""), exc_info=error)
        self._check_device()
        message = f"the engine step serving this request failed: {error!r}"
        self._failed_beam_searches += [(search_id, message) for search_id in searches]
        for request in failed:
            self._forget(request.request_id)
        return [EngineCoreOutput(r.request_id, [], "error", error=message) for r in failed]

    def take_beam_searches(self) -> list[BeamSearchResult]:
        """The beam searches that ended since the last call: their beams best first, or the error of
        the failed step that ended them."""
        results = [BeamSearchResult(s.request_id, [(f.token_ids, f.cum_logprob, f.finish_reason)
                                                   for f in s.finished])
                   for s in self.scheduler.take_finished_beam_searches()]
        results += [BeamSearchResult(search_id, [], error) for search_id, error in self._failed_beam_searches]
        self._failed_beam_searches = []
        return results

    def _check_device(self) -> None:
        """Raise if the device itself is broken (a sticky CUDA error): then no later step can succeed."""
        device = self.worker.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _compiles_now(self) -> tuple[int, int]:
        return len(self._kernel_compiles.compiles), dynamo_graphs()

    def _record(self, scheduler_output: SchedulerOutput, seconds: float, cpu_seconds: float) -> None:
        s, sched = self.stats, self.scheduler
        (kernels_seen, graphs_seen), now = self._compiles_seen, self._compiles_now()
        compiles = now[0] - kernels_seen + max(0, now[1] - graphs_seen)  # (torch._dynamo.reset zeroes the latter)
        if compiles:
            self._compiles_seen = now
            s.num_compiles += compiles
            kernels = [name for name, _ in self._kernel_compiles.compiles[kernels_seen:]]
            # a warning: after startup's warm-up, every compile is a stall that requests in flight feel
            logger.warning("a step compiled %d kernels or graphs (Triton: %s)", compiles,
                           ", ".join(kernels) or "none")
        if seconds > SLOW_STEP_SECONDS:
            s.num_slow_steps += 1
            # (with async scheduling the time is mostly the earlier step's that it waited for)
            logger.warning("a step took %.2f s: it launched %d tokens of %d requests and finished %d tokens "
                           "of %d requests, %d compiles", seconds,
                           scheduler_output.total_num_scheduled_tokens,
                           len(scheduler_output.num_scheduled_tokens), *self._finished_work, compiles)
        if not scheduler_output.is_empty:
            s.num_steps += 1
            s.num_scheduled_requests += len(scheduler_output.num_scheduled_tokens)
            s.step_seconds += seconds
            s.step_wait_seconds += self.last_step_wait_s
            s.step_cpu_seconds += cpu_seconds
        s.num_running, s.num_waiting = len(sched.running) + sched.num_slots, len(sched.waiting)
        s.num_swapped = len(sched.swapped)
        s.kv_usage = sched.kv.usage
        s.num_preemptions = sched.num_preemptions
        spec = sched.spec_stats
        s.spec_num_drafts, s.spec_num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
        s.spec_num_accepted_tokens = spec.num_accepted_tokens

    def check_kv_pool_whole(self) -> None:
        """Raise AssertionError unless every KV block is free again (call when idle)."""
        self.scheduler.kv.assert_empty()
