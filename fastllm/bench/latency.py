"""Decode latency sweep: for each batch size B, B random prompts of input_len tokens, output_len
greedy tokens each (EOS ignored), every engine step timed.

TTFT is the time until every request has its first token (the prefill steps, chunked when
B x input_len exceeds the token budget). Decode steps are the steps where all B requests decode
one token each; time per output token (TPOT) and the bytes/FLOPs rates come from them only. With
speculative decoding a decode step gives each request its accepted draft tokens too: TPOT is then
the time of a step, and tokens/s counts every token the decode steps gave.
Before each measured batch a short warm-up batch of fresh prompts runs (Triton JIT, cuBLAS
heuristics), so the first measured step is not a compile.
"""

from __future__ import annotations

import logging

import numpy as np

from fastllm.bench.matmul_floor import matmul_floor_ms
from fastllm.bench.roofline import ModelShape
from fastllm.bench.runner import RunRecord, percentile, random_prompts, run_requests
from fastllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

WARMUP_OUTPUT_LEN = 4
# A decode step over this many times the median is a stall (a garbage collection, a compile, the host
# descheduled): steady state has none, so rows count them and the time they add.
STALL_FACTOR = 2.0


def latency_row(run: RunRecord, batch_size: int, input_len: int, shape: ModelShape,
                ceilings: dict | None, tensor_parallel_size: int = 1) -> dict:
    """tensor_parallel_size: each rank reads (and computes) its share, so bytes, FLOPs and their rates
    are per GPU."""
    decode = [s for s in run.steps if s.num_outputs == batch_size and s.num_first_tokens == 0
              and len(s.context_lens) == batch_size]
    times = [s.seconds for s in decode]
    host = [s.seconds - s.wait_s for s in decode]  # the step minus its wait for the GPU
    ttft = max(run.ttft_s.values()) if len(run.ttft_s) == batch_size else None
    tpot = float(np.mean(times)) if times else None
    median = percentile(times, 50)
    stalled = [s for s in decode if s.seconds > STALL_FACTOR * median] if times else []
    # Tokens per second from the decode steps' tokens: B a step, more under speculative decoding.
    tok_s = sum(s.num_tokens for s in decode) / sum(times) if times else None
    decode_s = sum(times)
    num_bytes = [shape.decode_bytes(s.context_lens) / tensor_parallel_size for s in decode]
    flops = [shape.decode_flops(s.context_lens) / tensor_parallel_size for s in decode]
    bytes_per_s = sum(num_bytes) / decode_s if decode else None
    flops_per_s = sum(flops) / decode_s if decode else None
    copy_bw = (ceilings or {}).get("copy_bytes_per_s")
    mm_rate = (ceilings or {}).get("matmul_flops_per_s")
    ms = lambda s: None if s is None else s * 1e3  # noqa: E731
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": run.output_len,
        "ttft_ms": ms(ttft),
        "prefill_tok_s": batch_size * input_len / ttft if ttft else None,
        "tpot_ms_mean": ms(tpot),
        "tpot_ms_p50": ms(median),
        "tpot_ms_p90": ms(percentile(times, 90)),
        "tpot_ms_p99": ms(percentile(times, 99)),
        "floor_ms": None,
        "floor_mode": None,
        "host_ms_p50": ms(percentile(host, 50)),
        "host_frac": float(np.median(host)) / median if times else None,
        "tok_s_per_seq": tok_s / batch_size if tok_s else None,
        "tok_s_total": tok_s,
        "e2e_s": run.total_s,
        "e2e_output_tok_s": batch_size * run.output_len / run.total_s,
        "steps": len(run.steps),
        "decode_steps": len(decode),
        "bytes_per_step": float(np.mean(num_bytes)) if decode else None,
        "flops_per_step": float(np.mean(flops)) if decode else None,
        "achieved_gb_s": bytes_per_s / 1e9 if bytes_per_s else None,
        "bw_frac": bytes_per_s / copy_bw if bytes_per_s and copy_bw else None,
        "achieved_tflops": flops_per_s / 1e12 if flops_per_s else None,
        "tc_frac": flops_per_s / mm_rate if flops_per_s and mm_rate else None,
        "peak_mem_gib": run.peak_mem_gib,
        "preemptions": run.preemptions,
        "jit_compiles": len(run.jit_compiles),  # Triton variants compiled in the timed window (should be 0)
        "stalled_steps": len(stalled),  # decode steps over STALL_FACTOR x the median (should be 0)
        "stalled_ms": sum(s.seconds - median for s in stalled) * 1e3,  # beyond the median, in all
        "stalled_gc_ms": sum(s.gc_s for s in stalled) * 1e3,  # of which in garbage collections
        **run.spec_columns(),
    }


def run_latency(engine: LLMEngine, batch_sizes: list[int], input_len: int, output_len: int,
                ceilings: dict | None, shape: ModelShape, seed: int = 0, matmul_floor: bool = False,
                progress: bool = True, on_row=None) -> list[dict]:
    """One row per batch size; on_row(row) is called as each finishes (partial results survive a timeout)."""
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    block_size = engine.config.cache.block_size
    usable_tokens = (engine.worker.num_gpu_blocks - 1) * block_size
    rows = []
    for batch_size in batch_sizes:
        per_request = -(-(input_len + output_len) // block_size) * block_size
        if batch_size * per_request > usable_tokens:
            logger.warning("batch %d needs %d KV tokens, the cache holds %d: expect preemptions",
                           batch_size, batch_size * per_request, usable_tokens)
        run_requests(engine, random_prompts(rng, batch_size, input_len, vocab), min(WARMUP_OUTPUT_LEN, output_len),
                     f"warmup{batch_size}", progress=False)
        run = run_requests(engine, random_prompts(rng, batch_size, input_len, vocab), output_len, f"bs{batch_size}",
                           progress=progress, desc=f"batch {batch_size}")
        row = latency_row(run, batch_size, input_len, shape, ceilings,
                          tensor_parallel_size=engine.config.parallel.tensor_parallel_size)
        if matmul_floor:
            row["floor_ms"], row["floor_mode"] = matmul_floor_ms(engine.worker.runner.model, batch_size)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
