"""LLMEngine: add_request / step / abort_request. One step is schedule -> execute -> update."""

from __future__ import annotations

import contextlib
import logging
import os
import time

from fastllm.config import EngineConfig
from fastllm.core.beam_run_ahead import run_ahead_off_reason
from fastllm.core.block_hash import HashFn, hash_block_tokens
from fastllm.core.scheduler import Scheduler
from fastllm.engine.core import EngineCore
from fastllm.engine.input_processor import InputProcessor, PromptType, check_request_id
from fastllm.engine.interrupts import interrupt_after_step
from fastllm.engine.messages import sample_ids
from fastllm.engine.output_processor import OutputProcessor
from fastllm.engine.request import RequestStatus
from fastllm.engine.tokenizer import eos_token_id, load_tokenizer
from fastllm.outputs import RequestOutput
from fastllm.sampling_params import BeamSearchParams, SamplingParams
from fastllm.spec_decode.policy import SpecPolicy
from fastllm.tracing import nvtx_range
from fastllm.worker.executor import MultiprocExecutor, launched_by_torchrun, torchrun_worker
from fastllm.worker.worker import Worker

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    def __init__(self, config: EngineConfig, hash_fn: HashFn = hash_block_tokens, *,
                 with_tokenizer: bool = True):
        """with_tokenizer=False: an engine core process's, whose requests come as token ids (with their
        EOS) from an API process that has the tokenizer."""
        self.config = config
        start = time.perf_counter()
        if config.parallel.world_size > 1 and launched_by_torchrun() and int(os.environ["RANK"]) > 0:
            torchrun_worker(config)  # a rank above 0 serves rank 0's engine, then exits
        self.tokenizer = load_tokenizer(config.model.tokenizer_path) if with_tokenizer else None
        # One Worker on one device (the engine drives it directly); the ranks' processes with tensor or
        # pipeline parallelism (executor.py).
        self.executor = Worker(config) if config.parallel.world_size == 1 else MultiprocExecutor.start(config)
        self._shut_down = False
        # (a Ctrl-C in a step of several ranks waits for the step's end: interrupts.py)
        self._step_guard = interrupt_after_step if config.parallel.world_size > 1 else contextlib.nullcontext
        self.worker = self.executor.driver_worker  # rank 0's, in this process
        self.config = config = self.worker.config  # with the device's defaults (max_num_seqs)
        try:
            num_blocks, num_cpu_blocks = self.executor.determine_num_blocks()  # the least of any rank
            capacity, needed = (num_blocks - 1) * config.cache.block_size, config.tokens_a_request_holds()
            if capacity < needed:
                raise ValueError(f"the KV cache holds {capacity} tokens, fewer than the {needed} one request may "
                                 "hold: lower max_model_len or give the cache more memory")
            self.executor.init_kv_cache(num_blocks, num_cpu_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        spec = config.speculative
        policy = SpecPolicy(spec.num_speculative_tokens, spec.adaptive) if spec.enabled else None
        if policy is not None:
            spec_ms, plain_ms = self.executor.step_costs()  # (every rank replays its graphs together)
            policy.set_step_costs(spec_ms, plain_ms)
            if spec_ms:
                logger.info("speculative decoding: step ms by batch size, speculative %s, plain %s",
                            {b: round(t, 3) for b, t in spec_ms.items()},
                            {b: round(t, 3) for b, t in plain_ms.items()})
            elif spec.adaptive:  # (the policy's cost model is the graphs' replay times)
                logger.info("speculative decoding: every decode step proposes %d tokens: the adaptive policy "
                            "needs CUDA graphs' step times, and there are none here",
                            spec.num_speculative_tokens)
        pipeline = config.parallel.pipeline_parallel_size
        self.scheduler = Scheduler(config.scheduler, config.cache, config.model.max_model_len,
                                   num_blocks, num_cpu_blocks, hash_fn, policy, spec.uses_draft_model,
                                   config.model.kv_sliding_window, wait_for_sampled_tokens=pipeline > 1,
                                   beam_run_ahead_off=run_ahead_off_reason(config))
        self.eos_token_id = eos_token_id(self.tokenizer, self.worker.runner.eos_token_id)
        self.vocab_size = self.worker.runner.args.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, config.model.max_model_len,
                                              config.scheduler.max_num_seqs)
        self.core = EngineCore(config, self.executor, self.scheduler, self.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.startup_seconds = time.perf_counter() - start
        logger.info("engine ready in %.1f s: %d KV blocks of %d tokens (%.3f GiB) on %s", self.startup_seconds,
                    num_blocks, config.cache.block_size, self.worker.kv_cache_gib(), self.worker.device)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    # requests

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        """Validate and queue a request. Bad input raises ValueError naming the field (nothing is queued)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = self.input_processor.tokenize(prompt)
        params.tokenize_bad_words(self.tokenizer)
        self.input_processor.check_request(token_ids, params, self.eos_token_id)  # (n among the rest)
        self._check_request_ids(request_id, sample_ids(request_id, params.n))
        self.core.add_request(request_id, token_ids, params, self.eos_token_id)
        self.output_processor.add_group(request_id, text, token_ids, params)

    def add_beam_search(self, request_id: str, prompt: PromptType, params: BeamSearchParams) -> None:
        """Validate and queue a beam search (LLM.beam_search): its one RequestOutput comes when it ends,
        with the beams best first. Raises ValueError (and queues nothing) on bad input."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        self._check_request_ids(request_id, [])
        text, token_ids = self.input_processor.tokenize(prompt)
        self.core.add_beam_search(request_id, token_ids, params, self.eos_token_id)  # (check_beam_search)
        self.output_processor.add_beam_search(request_id, text, token_ids)

    def _check_request_ids(self, request_id: str, samples: list[str]) -> None:
        check_request_id(request_id)
        processor = self.output_processor
        for i in {request_id, *samples}:
            if i in processor.groups or i in processor.group_of or i in self.scheduler.beam_searches:
                raise ValueError(f"request id {i!r} is already in use")

    def abort_request(self, request_ids: str | list[str]) -> None:
        """End requests (all their samples) and beam searches. Other ids are ignored: unknown or finished
        ones, and one sample of a request of n > 1 (as vLLM, whose samples' ids are its own)."""
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        tracked = self.output_processor
        known = [r for r in request_ids if r in tracked.groups or r in tracked.beam_searches]
        self.core.finish_requests(known)
        for request_id in known:
            self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.groups) + len(self.scheduler.beam_searches)

    @property
    def stats(self):
        """The core's SchedulerStats as of its last step (what ServingMetrics reads)."""
        return self.core.stats

    @property
    def last_step_wait_s(self) -> float:
        """Time the last step() spent waiting for the GPU (bench: host = step - wait)."""
        return self.core.last_step_wait_s

    # the loop

    def step(self) -> list[RequestOutput]:
        """One engine step (EngineCore.step) and the RequestOutputs of the requests it changed. A step
        that raised ends the requests it scheduled with finish_reason "error"; the others go on."""
        with self._step_guard():
            core_outputs = self.core.step()
            with nvtx_range("detokenize"):
                outputs, stopped = self.output_processor.process(core_outputs)
                outputs += self.output_processor.process_beam_searches(self.core.take_beam_searches())
            self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for out in outputs:
            if out.error is not None:
                logger.error("request %s failed: %s", out.request_id, out.error)
        return outputs

    def shutdown(self) -> None:
        """End the worker processes of tensor/pipeline parallelism (nothing to do on one device). Once:
        with reuse_workers the next engine may already run on them."""
        if not self._shut_down:
            self._shut_down = True
            self.executor.shutdown()

    def check_kv_pool_whole(self) -> None:
        """Raise AssertionError unless every KV block is free again (call when idle)."""
        self.core.check_kv_pool_whole()
