"""LLMEngine: add_request / step / abort_request. One step is schedule -> execute -> update."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path

from fastllm.config import EngineConfig
from fastllm.core.beam_search import BeamSearch
from fastllm.core.block_hash import HashFn, hash_block_tokens
from fastllm.core.scheduler import Scheduler
from fastllm.core.scheduler_output import SchedulerOutput
from fastllm.engine.output_processor import OutputProcessor
from fastllm.engine.request import Request, RequestStatus
from fastllm.outputs import RequestOutput
from fastllm.sampling_params import BeamSearchParams, SamplingParams
from fastllm.spec_decode.policy import SpecPolicy
from fastllm.tracing import nvtx_range
from fastllm.worker.async_output import AsyncRunnerOutput
from fastllm.worker.executor import MultiprocExecutor, launched_by_torchrun, torchrun_worker
from fastllm.worker.worker import Worker

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


def load_tokenizer(path: str):
    """The HF tokenizer of a model directory, or None when it ships none (dummy-weight configs)."""
    root = Path(path)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        logger.info("no tokenizer in %s: prompts must be token ids and outputs carry no text", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    def __init__(self, config: EngineConfig, hash_fn: HashFn = hash_block_tokens):
        self.config = config
        start = time.perf_counter()
        if config.parallel.world_size > 1 and launched_by_torchrun() and int(os.environ["RANK"]) > 0:
            torchrun_worker(config)  # a rank above 0 serves rank 0's engine, then exits
        self.tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        # One Worker on one device (the engine drives it directly); the ranks' processes with tensor or
        # pipeline parallelism (executor.py).
        self.executor = Worker(config) if config.parallel.world_size == 1 else MultiprocExecutor.start(config)
        self._shut_down = False
        self.worker = self.executor.driver_worker  # rank 0's, in this process
        self.config = config = self.worker.config  # with the device's defaults (max_num_seqs)
        try:
            num_blocks, num_cpu_blocks = self.executor.determine_num_blocks()  # the least of any rank
            capacity, max_len = (num_blocks - 1) * config.cache.block_size, config.model.max_model_len
            if capacity < max_len:
                raise ValueError(f"the KV cache holds {capacity} tokens, fewer than max_model_len {max_len}: "
                                 "lower max_model_len or give the cache more memory")
            self.executor.init_kv_cache(num_blocks, num_cpu_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        spec = config.speculative
        policy = SpecPolicy(spec.num_speculative_tokens, spec.adaptive) if spec.enabled else None
        if policy is not None:
            spec_ms, plain_ms = self.executor.step_costs()  # (every rank replays its graphs together)
            policy.set_step_costs(spec_ms, plain_ms)
            logger.info("speculative decoding: step ms by batch size, speculative %s, plain %s",
                        {b: round(t, 3) for b, t in spec_ms.items()}, {b: round(t, 3) for b, t in plain_ms.items()})
        pipeline = config.parallel.pipeline_parallel_size
        self.scheduler = Scheduler(config.scheduler, config.cache, config.model.max_model_len,
                                   num_blocks, num_cpu_blocks, hash_fn, policy, spec.uses_draft_model,
                                   config.model.kv_sliding_window, wait_for_sampled_tokens=pipeline > 1)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_id = self.worker.runner.eos_token_id
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_id = self.tokenizer.eos_token_id
        self.vocab_size = self.worker.runner.args.vocab_size
        self.async_scheduling = config.scheduler.async_scheduling
        # Steps launched before their tokens are read: one with async scheduling, one per pipeline stage
        # (each stage works on a different batch).
        self._in_flight: deque[tuple[SchedulerOutput, AsyncRunnerOutput]] = deque()
        self._max_in_flight = pipeline if self.async_scheduling else 0
        self.last_step_wait_s = 0.0  # time the last step() spent waiting for the GPU (bench: host = step - wait)
        self.startup_seconds = time.perf_counter() - start
        logger.info("engine ready in %.1f s: %d KV blocks of %d tokens (%.3f GiB) on %s", self.startup_seconds,
                    num_blocks, config.cache.block_size, self.worker.kv_cache_gib(), self.worker.device)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    # requests

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as {'prompt_token_ids': [...]}")
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        """Validate and queue a request. Raises ValueError (and queues nothing) on bad input."""
        params = params or SamplingParams()
        self._check_request_id(request_id)
        text, token_ids = self.tokenize(prompt)
        max_tokens = self._check_prompt(token_ids, params.max_tokens)
        params.tokenize_bad_words(self.tokenizer)
        params.check_token_ids(self.vocab_size)
        block_size = self.config.cache.block_size
        hash_fn = self.scheduler.hash_fn
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, token_ids, child_params, self.eos_token_id, max_tokens,
                                    block_size, hash_fn, fork_of=children[0] if i else None))
        self.output_processor.add_group(request_id, text, token_ids, children)
        for child in children:
            self.scheduler.add_request(child)

    def add_beam_search(self, request_id: str, prompt: PromptType, params: BeamSearchParams) -> None:
        """Validate and queue a beam search (LLM.beam_search): its one RequestOutput comes when it ends,
        with the beams best first. Raises ValueError (and queues nothing) on bad input."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if 2 * params.beam_width > self.vocab_size:
            raise ValueError(f"BeamSearchParams.beam_width must be at most half the vocabulary ({self.vocab_size})")
        self._check_request_id(request_id)
        text, token_ids = self.tokenize(prompt)
        max_tokens = self._check_prompt(token_ids, params.max_tokens)
        search = BeamSearch(request_id, text, token_ids, params, self.eos_token_id, max_tokens)
        first = Request(search.next_beam_id(), token_ids, params.sampling_params(), self.eos_token_id, max_tokens,
                        self.config.cache.block_size, self.scheduler.hash_fn)
        self.scheduler.add_beam_search(search, first)

    def _check_request_id(self, request_id: str) -> None:
        if request_id in self.output_processor.groups or request_id in self.scheduler.beam_searches:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _check_prompt(self, token_ids: list[int], max_tokens: int | None) -> int:
        """Raise ValueError unless the prompt's ids are in the vocabulary and it leaves room to generate;
        returns max_tokens (None: up to max_model_len)."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        max_len = self.config.model.max_model_len
        max_tokens = max_tokens if max_tokens is not None else max_len - len(token_ids)
        if len(token_ids) + max_tokens > max_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len ({max_len})")
        if max_tokens < 1:
            raise ValueError(f"the prompt ({len(token_ids)} tokens) leaves no room to generate within "
                             f"max_model_len ({max_len})")
        return max_tokens

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.finish_beam_search(request_id)
            children = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.groups) + len(self.scheduler.beam_searches)

    # the loop

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step before it (async
        scheduling: its tokens were copied back while this one was being prepared) or of this
        one (async_scheduling=False, and speculative steps, which end before they return: the
        next step is scheduled from their proposals)."""
        start = time.perf_counter()
        outputs = []
        while self._in_flight and self._in_flight[0][1].done:  # a speculative step
            outputs += self._finish(*self._in_flight.popleft())
        with nvtx_range("schedule"):
            scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not self._in_flight and self.scheduler.has_unfinished_requests() \
                and not (scheduler_output.blocks_to_swap_out or scheduler_output.finished_req_ids):
            raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.requests)} requests pending")
        self.last_step_wait_s = 0.0
        launched = (scheduler_output, self.executor.execute_model(scheduler_output))
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
            self.scheduler.spec_policy.observe(*decode_step, time.perf_counter() - start)
        return outputs

    def _finish(self, scheduler_output: SchedulerOutput, runner_output: AsyncRunnerOutput) -> list[RequestOutput]:
        with nvtx_range("wait_tokens"):
            result = runner_output.result()
        self.last_step_wait_s += runner_output.wait_s
        with nvtx_range("update"):
            updated = self.scheduler.update_from_output(scheduler_output, result)
        with nvtx_range("detokenize"):
            outputs, stopped = self.output_processor.process(updated, result.logprobs, result.prompt_logprobs)
            outputs += [s.to_output(self.tokenizer) for s in self.scheduler.take_finished_beam_searches()]
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def shutdown(self) -> None:
        """End the worker processes of tensor/pipeline parallelism (nothing to do on one device). Once:
        with reuse_workers the next engine may already run on them."""
        if not self._shut_down:
            self._shut_down = True
            self.executor.shutdown()

    def check_kv_pool_whole(self) -> None:
        """Raise AssertionError unless every KV block is free again (call when idle)."""
        self.scheduler.kv.assert_empty()
