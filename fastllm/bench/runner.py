"""Drive an LLMEngine for a benchmark: build it (with its startup breakdown), submit requests, and
time every engine.step().

A step returns host token ids, so its wall time includes the device work (no extra sync needed).
Each step records, from the outputs it returned, which requests got their first token and the
context length of every request that decoded, which is all the latency and roofline math needs.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from fastllm.bench.gc_watch import GCWatch
from fastllm.compile.jit_watch import TritonCompileWatch
from fastllm.config import EngineConfig
from fastllm.engine.llm_engine import LLMEngine
from fastllm.sampling_params import RequestOutputKind, SamplingParams
from fastllm.spec_decode.stats import SpecDecodingStats


def build_config(model: str | None, engine_kwargs: dict) -> EngineConfig:
    """Validated config (ValueError on a bad one) before anything heavy happens."""
    return EngineConfig.from_kwargs(model, **engine_kwargs)


def check_lengths(config: EngineConfig, prompt_len: int, output_len: int) -> None:
    max_len = config.model.max_model_len
    if prompt_len + output_len > max_len:
        raise ValueError(f"prompt ({prompt_len} tokens) + output ({output_len} tokens) = {prompt_len + output_len} "
                         f"exceeds the model's context of {max_len} tokens")


def startup_breakdown(engine: LLMEngine) -> dict:
    """Seconds per startup phase, from Worker.timings; None (n/a) for a phase that did not run
    (compile and CUDA-graph capture with enforce_eager or on the CPU)."""
    timings = getattr(engine.worker, "timings", {}) or {}

    def phase(name: str, zero_is_absent: bool = False) -> float | None:
        value = timings.get(name)
        if value is None or (zero_is_absent and value == 0):
            return None
        return float(value)

    out = {
        "load_s": phase("load"),
        "compile_s": phase("compile", zero_is_absent=True),
        "cuda_graph_s": phase("cuda_graphs", zero_is_absent=True),
        "warm_up_s": phase("warm_up", zero_is_absent=True),
        "kv_profile_s": phase("profile"),
        "kv_alloc_s": phase("kv_alloc"),
        "total_s": float(engine.startup_seconds),
    }
    known = sum(v for k, v in out.items() if k != "total_s" and v is not None)
    out["other_s"] = max(0.0, out["total_s"] - known)  # tokenizer, scheduler, ...
    out["kv_cache_gib"] = engine.worker.kv_cache_gib()
    out["num_gpu_blocks"] = engine.worker.num_gpu_blocks
    graphs, mixed = engine.worker.runner.graphs, engine.worker.runner.mixed_graphs
    out["cuda_graph_gib"] = (graphs.pool_bytes + (mixed.pool_bytes if mixed is not None else 0)) / 2**30 \
        if graphs is not None else None
    return out


def random_prompts(rng: np.random.Generator, num: int, length: int, vocab_size: int) -> list[list[int]]:
    return rng.integers(0, vocab_size, size=(num, length)).tolist()


@dataclass
class StepRecord:
    seconds: float
    num_outputs: int
    num_first_tokens: int  # requests that got their first token in this step
    context_lens: list[int]  # tokens attended by each request that decoded (its new one included)
    wait_s: float = 0.0  # of seconds, the time spent waiting for the GPU; the rest is host work
    num_tokens: int = 0  # new tokens of all requests (more than num_outputs with speculative decoding)
    gc_s: float = 0.0  # of seconds, the time inside garbage collections


@dataclass
class RunRecord:
    num_requests: int
    prompt_lens: list[int]
    output_len: int
    total_s: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)
    ttft_s: dict[str, float] = field(default_factory=dict)  # request id -> first token, from submission
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    peak_mem_gib: float | None = None
    jit_compiles: list[tuple[str, float]] = field(default_factory=list)  # Triton compiles in the window
    spec: SpecDecodingStats | None = None  # speculative decoding's drafts in the run (None: off)

    def spec_columns(self) -> dict:
        """The run's draft acceptance, as table columns (None with speculative decoding off)."""
        return spec_columns(self.spec)

    def decode_steps(self) -> list[StepRecord]:
        """The steps that returned tokens, none of them a prompt's first. Under async scheduling the step that
        returns the first tokens is the one that waited for the prefill (the prefill's own step only launched it)."""
        return [s for s in self.steps if s.num_outputs and not s.num_first_tokens]


def spec_columns(stats: SpecDecodingStats | None) -> dict:
    """Draft acceptance as table columns (None with speculative decoding off)."""
    return {"spec_acceptance_rate": stats.acceptance_rate if stats else None,
            "spec_mean_accepted_len": stats.mean_acceptance_length if stats else None}


def peak_memory_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / (1 << 30)


def run_requests(engine: LLMEngine, prompts: list, output_len: int, tag: str,
                 progress: bool = True, desc: str | None = None) -> RunRecord:
    """Submit all prompts at once (token-id lists, or anything engine.add_request takes; greedy,
    ignore EOS, exactly output_len tokens each) and step the engine until they finish, timing each step."""
    # DELTA outputs: each step's new token only, so timing does not include copying whole outputs.
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    device = engine.worker.device
    stats = engine.scheduler.kv.pool.stats
    queries, hits, preemptions = stats.queries, stats.hits, engine.scheduler.num_preemptions
    spec_before = dataclasses.replace(engine.scheduler.spec_stats)
    token_ids = [engine.tokenize(p)[1] for p in prompts]  # ValueError on text without a tokenizer
    for tokens in token_ids:
        check_lengths(engine.config, len(tokens), output_len)
    prompt_len = dict(zip(ids, map(len, token_ids)))
    generated = dict.fromkeys(ids, 0)
    run = RunRecord(len(prompts), list(prompt_len.values()), output_len)
    peak_memory_reset(device)
    start = time.perf_counter()
    with TritonCompileWatch() as watch, GCWatch() as collections:
        try:
            for rid, prompt in zip(ids, token_ids):
                engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            with tqdm(total=len(prompts) * output_len, desc=desc or tag, unit="tok", file=sys.stderr,
                      disable=not progress, leave=False, mininterval=0.5) as bar:
                while engine.has_unfinished_requests():
                    gc0, t0 = collections.seconds, time.perf_counter()
                    outputs = engine.step()
                    t1 = time.perf_counter()
                    first, context, num_tokens = 0, [], 0
                    for out in outputs:
                        new = len(out.outputs[0].token_ids)
                        num_tokens += new
                        generated[out.request_id] += new
                        k = generated[out.request_id]
                        if k == 1:
                            first += 1
                            run.ttft_s[out.request_id] = t1 - start
                        elif k > 1:
                            context.append(prompt_len[out.request_id] + k - 1)
                    run.steps.append(StepRecord(t1 - t0, len(outputs), first, context, engine.last_step_wait_s,
                                                num_tokens, collections.seconds - gc0))
                    bar.update(num_tokens)
        except BaseException:
            engine.abort_request(ids)
            raise
    run.total_s = time.perf_counter() - start
    run.jit_compiles = watch.compiles
    run.preemptions = engine.scheduler.num_preemptions - preemptions
    run.prefix_queries, run.prefix_hits = stats.queries - queries, stats.hits - hits
    if engine.config.speculative.enabled:
        run.spec = engine.scheduler.spec_stats.since(spec_before)
    run.peak_mem_gib = peak_memory_gib(device)
    return run


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def step_columns(steps: float, scheduled: float, seconds: float, wait_seconds: float, cpu_seconds: float,
                 prefix: str = "engine") -> dict:
    """Per engine step: the mean batch, wall ms, host ms (wall less the wait for the GPU's tokens) and the
    stepping thread's CPU ms. Where host ms exceeds CPU ms, the thread was descheduled while it had work."""
    per_step = (lambda x: x / steps * 1e3) if steps else (lambda x: None)
    return {f"{prefix}_steps": int(steps), f"{prefix}_mean_batch": scheduled / steps if steps else None,
            f"{prefix}_step_ms": per_step(seconds), f"{prefix}_host_ms": per_step(seconds - wait_seconds),
            f"{prefix}_cpu_ms": per_step(cpu_seconds)}


def stats_columns(before, after, prefix: str) -> dict:
    """step_columns of an in-process engine's SchedulerStats, taken before and after a run."""
    def delta(name):
        return getattr(after, name) - getattr(before, name)
    return step_columns(delta("num_steps"), delta("num_scheduled_requests"), delta("step_seconds"),
                        delta("step_wait_seconds"), delta("step_cpu_seconds"), prefix)
