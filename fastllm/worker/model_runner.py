"""ModelRunner: SchedulerOutput in, sampled tokens out. Orchestration only: the flat batch is
built in input_batch.py, attention inputs live in attn_metadata.py, KV tensors in cache_engine.py."""

from __future__ import annotations

import logging
import time

import torch

from fastllm.compile.backend import compile_forward, mark_tokens_unbacked
from fastllm.compile.cuda_graphs import CUDAGraphRunner, default_capture_sizes
from fastllm.compile.mixed_graphs import MixedGraphRunner, token_buckets
from fastllm.config import EngineConfig
from fastllm.core.scheduler_output import SchedulerOutput
from fastllm.distributed.parallel_state import ParallelRank
from fastllm.kernels.reference import FP8
from fastllm.layers import fp8
from fastllm.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow
from fastllm.models.loader import load_model
from fastllm.sampling_params import SamplingParams
from fastllm.spec_decode.spec_runner import SpecDecodeRunner
from fastllm.tracing import nvtx_range
from fastllm.worker.async_output import AsyncRunnerOutput
from fastllm.worker.attn_metadata import forward_context
from fastllm.worker.beam_slots import BeamSlotRunner
from fastllm.worker.cache_engine import CacheEngine
from fastllm.worker.cascade import CascadePlanner
from fastllm.worker.input_batch import CachedRequestState, build_step_inputs
from fastllm.worker.kv_scales import calculate_kv_scales
from fastllm.worker.prompt_logprobs import compute_prompt_logprobs, wants_prompt_logprobs
from fastllm.worker.staging import StepInputStager
from fastllm.worker.step_warmup import warm_up_compiled_steps, warm_up_decode_rows, warm_up_sizes

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, parallel: ParallelRank = ParallelRank()):
        self.config = config
        self.device = device
        self.parallel = parallel
        self.block_size = config.cache.block_size
        if config.cache.kv_cache_dtype == "fp8":
            fp8.check_kv_cache_device(device)
        self.model = load_model(config.model, device, parallel)  # this rank's shard
        # A pipeline stage before the last hands its hidden states on and samples nothing.
        self.samples = self.model.computes_logits
        self.dtype = self.model.dtype
        # The target's KV cache: e4m3 (kv_cache_dtype="fp8") or the model's dtype. A draft model's stays 16-bit.
        self.kv_dtype = FP8 if config.cache.kv_cache_dtype == "fp8" else self.dtype
        self.args = self.model.args
        self.attention_layers = self.model.attention_layers()  # the forward context's, every step
        self.eos_token_id = config.model.hf_config.get("eos_token_id")
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0]
        self.sampler = Sampler()
        self.stager = StepInputStager(device)
        self.spec = SpecDecodeRunner(self) if config.speculative.enabled else None
        self.drafter = self.spec.drafter if self.spec is not None else None  # speculative decoding's draft model
        self.cache: CacheEngine | None = None
        self.caches: list[CacheEngine] = []  # the target's, then the draft's: swaps and copies apply to both
        self.requests: dict[str, CachedRequestState] = {}
        self.beam_slots = BeamSlotRunner(self)  # run-ahead beam searches' device state
        self.forward = self.model.forward  # replaced by the compiled forward in init_kv_cache
        self.graphs: CUDAGraphRunner | None = None
        self.mixed_graphs: MixedGraphRunner | None = None  # prefill and mixed steps' graphs, per token bucket
        self.warmup_seconds = 0.0  # the compiled forward's runs past the graphs at startup (step_warmup.py)
        self.compile_seconds = 0.0
        self.compile_how = None  # "compiled, saved to ..." / "loaded ..." (see compile/aot_cache.py)
        self.cascade = CascadePlanner(config.cache.cascade_attention, self.block_size, self.args.sliding_windows)
        self._last_output: AsyncRunnerOutput | None = None  # its tokens may still be on the device
        self._said_penalties_wait = False
        self._scoring_prompts: set[str] = set()  # requests whose prompt logprobs are still to come
        # (speculative?, batch size, caught up?) of the last step when it was a decode step (the speculation
        # policy's step costs; caught up: the draft first ran over tokens it missed, a probe's cost), else None
        self.last_decode_step: tuple[bool, int, bool] | None = None

    # setup

    def kv_bytes_per_block(self) -> int:
        target = CacheEngine.bytes_per_block(*self.model.kv_cache_shape(), self.block_size, self.kv_dtype)
        return target + (self.drafter.kv_bytes_per_block() if self.drafter is not None else 0)

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        if self.config.cache.calculate_kv_scales:
            scales = calculate_kv_scales(self.model, self.attention_layers, self.args.vocab_size,
                                         self.config.scheduler.max_num_batched_tokens,
                                         self.config.model.max_model_len, self.device)
            for layer, layer_scales in zip(self.attention_layers, scales):
                layer.calculated_kv_scales = layer_scales
        self.cache = CacheEngine(*self.model.kv_cache_shape(), self.block_size, self.kv_dtype, self.device,
                                 num_blocks, num_cpu_blocks)
        for layer, kv in zip(self.attention_layers, self.cache.layer_caches()):
            layer.bind_kv_cache(kv)
        has_scales = any(l.checkpoint_kv_scales for l in self.attention_layers)
        if self.config.cache.calculate_kv_scales:
            k_scales, v_scales = zip(*(l.calculated_kv_scales for l in self.attention_layers))
            instead = " (in place of the checkpoint's)" if has_scales else ""
            logger.info("KV cache: float8 e4m3, per-tensor scales per layer calculated at startup%s: k_scale "
                        "%.3g..%.3g, v_scale %.3g..%.3g", instead, min(k_scales), max(k_scales),
                        min(v_scales), max(v_scales))
        elif self.kv_dtype == FP8:
            logger.info("KV cache: float8 e4m3, per-tensor scales per layer (%s)",
                        "from the checkpoint" if has_scales else "1.0: the checkpoint has none")
        elif has_scales:
            logger.info("KV cache: %s; the checkpoint's FP8 KV-cache scales apply with kv_cache_dtype='fp8' only",
                        self.kv_dtype)
        self.caches = [self.cache]
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks, num_cpu_blocks)
            self.caches.append(self.drafter.cache)
        self._compile_and_capture()

    def _compile_and_capture(self) -> None:
        """torch.compile the forward and capture decode CUDA graphs, unless enforce_eager or the
        device rules them out (said once in the log, with the path that runs instead)."""
        cfg = self.config.compile
        sched, model = self.config.scheduler, self.config.model
        sizes = list(cfg.cuda_graph_sizes or default_capture_sizes(sched.max_num_seqs))
        draft_forward = self.drafter.forward if self.drafter is not None else None
        if cfg.enforce_eager or (self.device.type != "cuda" and not cfg.compile_on_cpu):
            why = "enforce_eager=True" if cfg.enforce_eager else \
                f"torch.compile and CUDA graphs are used on GPUs (compile_on_cpu=True compiles on {self.device.type} too)"
            logger.info("execution: eager on %s (%s): no torch.compile, no CUDA graphs", self.device.type, why)
            if self.spec is not None:
                self.spec.build_step(self.forward, draft_forward, sizes, capture=False)
            return
        start = time.perf_counter()
        with torch.inference_mode(), forward_context(None, self.attention_layers):
            ids = torch.zeros(2, dtype=torch.int64, device=self.device)
            self.forward, self.compile_how = compile_forward(self.model, mark_tokens_unbacked(ids, ids.clone()))
        if self.drafter is not None:
            with torch.inference_mode(), forward_context(None, self.drafter.attention_layers):
                ids = torch.zeros(2, dtype=torch.int64, device=self.device)
                draft_forward, how = compile_forward(self.drafter.model, mark_tokens_unbacked(ids, ids.clone()))
                self.drafter.forward = draft_forward
            self.compile_how += f"; draft model {how}"
        self.compile_seconds = time.perf_counter() - start
        logger.info("torch.compile: %.1f s (%s)", self.compile_seconds, self.compile_how)
        if self.device.type != "cuda":
            logger.info("execution: compiled, without CUDA graphs (device %s)", self.device.type)
            if self.spec is not None:
                self.spec.build_step(self.forward, draft_forward, sizes, capture=False)
            return
        if self.parallel.pp_size > 1:
            logger.info("execution: pipeline parallel: compiled, without CUDA graphs (the stages' send/recv "
                        "run inside the forward)")
            return
        max_blocks = -(-model.max_model_len // self.block_size)
        self.graphs = CUDAGraphRunner(self.forward, self.model.compute_logits, self.attention_layers, sizes,
                                      max_blocks, model.max_model_len, self.args.vocab_size, self.dtype, self.device)
        if self.cascade.mode is not False:
            self.graphs.enable_cascade()
        self.graphs.capture()
        logger.info("execution: compiled; decode batches up to %d replay CUDA graphs", self.graphs.max_bs)
        self._capture_mixed_graphs(max_blocks)
        graph_max = self.mixed_graphs.buckets[-1] if self.mixed_graphs is not None else 0
        self.warmup_seconds = warm_up_compiled_steps(
            self.forward, self.attention_layers, warm_up_sizes(graph_max, sched.max_num_batched_tokens),
            model.max_model_len, sched.max_num_seqs, max_blocks, self.device)
        self.warmup_seconds += warm_up_decode_rows(self.attention_layers, sched.max_num_seqs,
                                                   model.max_model_len, max_blocks, self.dtype, self.device)
        if self.spec is not None:
            self.spec.build_step(self.forward, draft_forward, sizes, capture=True)

    def _capture_mixed_graphs(self, max_blocks: int) -> None:
        max_tokens = min(self.config.compile.mixed_cuda_graph_max_tokens,
                         self.config.scheduler.max_num_batched_tokens)
        if not max_tokens:
            logger.info("execution: prefill and mixed steps run compiled, without CUDA graphs "
                        "(mixed_cuda_graph_max_tokens=0)")
            return
        self.mixed_graphs = MixedGraphRunner(self.forward, self.attention_layers, token_buckets(max_tokens),
                                             self.config.scheduler.max_num_seqs, max_blocks,
                                             self.config.model.max_model_len, self.graphs, self.device)
        self.mixed_graphs.capture()
        logger.info("execution: prefill and mixed steps of up to %d tokens replay CUDA graphs", max_tokens)

    def release_graphs(self) -> None:
        """Destroy every CUDA graph this runner captured, before a sharded model's process groups go
        (reset_graphs says why). For shutdown: the runner takes no step after."""
        spec_step = self.spec.step if self.spec is not None else None
        for owner in (self.graphs, self.mixed_graphs, spec_step):
            if owner is not None:
                owner.reset()

    def step_costs(self) -> tuple[dict[int, float], dict[int, float]]:
        """Measured milliseconds of a speculative and of a plain decode graph's replay, by batch size
        (empty without CUDA graphs): the speculation policy's cost model."""
        if self.spec is None or self.graphs is None or not self.spec.step.graphs:
            return {}, {}
        spec_ms = self.spec.step.step_ms
        return spec_ms, self.graphs.time_replays(sorted(spec_ms))

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward of the largest step (no KV cache yet) and a sampler pass, so the caller can
        read the peak memory the cache must leave room for."""
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, self.config.model.max_model_len * sched.max_num_seqs)
        input_ids = torch.randint(0, self.args.vocab_size, (num_tokens,), device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.config.model.max_model_len
        with forward_context(None, self.attention_layers):
            hidden = self.model(input_ids, positions)
        if self.samples:
            num_rows = min(sched.max_num_seqs, num_tokens)
            logits = self.model.compute_logits(hidden[:num_rows])
            params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)
            rows = [SamplingRow(params, None, [0], [0], None) for _ in range(num_rows)]
            self.sampler(logits, SamplingMetadata.build(rows, self.args.vocab_size, self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # one step

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> AsyncRunnerOutput:
        """Queue the step's GPU work and return at once; result() on the output waits for its tokens."""
        self._update_states(sched)
        for cache in self.caches:
            cache.swap_out(sched.blocks_to_swap_out)
            cache.swap_in(sched.blocks_to_swap_in)
            cache.copy(sched.blocks_to_copy)
        req_ids = list(sched.num_scheduled_tokens)
        self.last_decode_step = None
        self.beam_slots.drop(sched.ended_beam_slots)
        if sched.beam_slot_steps:
            return self.beam_slots.execute(sched)
        if sched.is_empty:
            return AsyncRunnerOutput(req_ids, [])
        if self.spec is not None and (sched.scheduled_spec_tokens or sched.num_spec_proposals):
            return self.spec.execute(sched, req_ids)
        if self.drafter is not None:
            self.spec.discard_drafts(req_ids)
        return self._execute_plain(sched, req_ids)

    def _execute_plain(self, sched: SchedulerOutput, req_ids: list[str]) -> AsyncRunnerOutput:
        """A step without drafts: a decode step's CUDA graph, or the compiled forward; then the sampler."""
        states = [self.requests[r] for r in req_ids]
        last = self._last_output if self._last_output is not None and not self._last_output.done else None
        if last is not None and any(s.num_pending and s.sampling_params.reads_output_tokens for s in states):
            if not self._said_penalties_wait:
                self._said_penalties_wait = True
                logger.info("penalties and bad_words read every output token: steps with them wait for the "
                            "previous step's tokens instead of overlapping it (logged once)")
            last.result()
            last = None
        num_scheduled = list(sched.num_scheduled_tokens.values())
        in_flight_tokens = last.sampled if last is not None else None
        scores_prompt = self.samples and bool(self._scoring_prompts) and any(
            wants_prompt_logprobs(s, s.num_computed_tokens) for s in states)
        cascade = self.cascade.plan(states, num_scheduled)  # shared-prefix groups (worker/cascade.py)
        graph = self.graphs if self.graphs is not None and not scores_prompt \
            and self.graphs.fits(num_scheduled, in_flight_tokens) else None
        num_tokens = sum(num_scheduled)
        mixed = self.mixed_graphs if graph is None and self.mixed_graphs is not None \
            and self.mixed_graphs.fits(num_tokens, in_flight_tokens, cascade) else None
        with nvtx_range("prepare_inputs"):
            inputs = build_step_inputs(states, num_scheduled, self.block_size, self.args.vocab_size,
                                       self.eos_token_id, self.stager, last, graph, cascade=cascade,
                                       mixed_graph=mixed)
        logits = greedy = None
        if inputs.staged_for_graph:
            self.last_decode_step = (False, len(states), False)
            with nvtx_range("forward_graph"):
                logits, greedy = self.graphs.replay_staged(len(states), inputs.logits_indices,
                                                           sampling=inputs.sampled_in_graph,
                                                           cascade=inputs.cascade_in_graph)
        elif inputs.staged_for_mixed_graph:
            with nvtx_range("forward_mixed_graph"):
                hidden = self.mixed_graphs.replay_staged(num_tokens)
        else:
            with nvtx_range("forward"), forward_context(inputs.attn_metadata, self.attention_layers):
                hidden = self.forward(inputs.input_ids, inputs.positions)
        prompt_logprobs = self._score_prompts(hidden, states, num_scheduled) if scores_prompt else {}
        for req_id, state in zip(req_ids, states):
            state.num_computed_tokens += sched.num_scheduled_tokens[req_id]
        if not self.samples:  # the last stage samples; its tokens come back with a later step (executor.py)
            return AsyncRunnerOutput(req_ids, inputs.sample_states)
        if not inputs.sample_states:
            return AsyncRunnerOutput(req_ids, [], prompt_logprobs=prompt_logprobs)
        with nvtx_range("sample"):
            if greedy is not None and (inputs.sampled_in_graph or inputs.sampling_metadata.argmax_only):
                out = SamplerOutput(greedy)  # sampled inside the graph
            else:
                if logits is None:
                    logits = self._logits(hidden, inputs)
                out = self.sampler(logits, inputs.sampling_metadata)
        for state in inputs.sample_states:
            state.num_pending += 1
        self._last_output = AsyncRunnerOutput(req_ids, inputs.sample_states, out.sampled, out.logprobs,
                                              prompt_logprobs)
        return self._last_output

    def _score_prompts(self, hidden: torch.Tensor, states, num_scheduled: list[int]):
        """The step's prompt logprobs (SamplingParams.prompt_logprobs), computed before the states
        advance; a request leaves the scoring set once its prompt is done."""
        with nvtx_range("prompt_logprobs"):
            out = compute_prompt_logprobs(self.model, hidden, states, [s.num_computed_tokens for s in states],
                                          num_scheduled)
        for state, n in zip(states, num_scheduled):
            if state.num_computed_tokens + n + 1 >= len(state.prompt_token_ids):
                self._scoring_prompts.discard(state.req_id)
        return out

    def _logits(self, hidden: torch.Tensor, inputs) -> torch.Tensor:
        """The logits of the step's rows that sample (all of them when logits_indices is None)."""
        return self.model.compute_logits(hidden if inputs.logits_indices is None else hidden[inputs.logits_indices])

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            state = self.requests.pop(req_id, None)
            self._scoring_prompts.discard(req_id)
            if state is not None and self.spec is not None:
                self.spec.remove_request(state)
        for new in sched.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), list(new.output_token_ids), params, generator,
                list(new.block_ids), new.num_computed_tokens, new.max_total_tokens)
            if params.prompt_logprobs is not None:
                self._scoring_prompts.add(new.req_id)
            if self.spec is not None:
                self.spec.add_request(self.requests[new.req_id])
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.block_ids is not None:
                state.set_block_ids(cached.block_ids)
                state.draft_len = min(state.draft_len, cached.num_computed_tokens)  # recomputed after preemption
            elif cached.new_block_ids:
                state.append_block_ids(cached.new_block_ids)
