"""Offline throughput: every request submitted at once, EOS ignored, the engine stepped until done.

Prompts are random token ids of input_len, a JSONL dataset ({"prompt": ...} or
{"prompt_token_ids": [...]} per line), or, with a shared prefix of P tokens, the same P random
tokens followed by input_len distinct ones per request (the prefix-caching workload).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np

from fastllm.bench.runner import RunRecord, percentile, random_prompts, run_requests, stats_columns
from fastllm.engine.llm_engine import LLMEngine


def load_dataset(path: str, num_prompts: int) -> list:
    prompts = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                entry = json.loads(line)
                if not isinstance(entry, dict) or not ({"prompt", "prompt_token_ids"} & entry.keys()):
                    raise ValueError(f"line {number}: expected {{\"prompt\": ...}} or {{\"prompt_token_ids\": [...]}}")
                prompts.append({"prompt_token_ids": entry["prompt_token_ids"]} if "prompt_token_ids" in entry
                               else entry["prompt"])
                if len(prompts) == num_prompts:
                    break
    except OSError as e:
        raise ValueError(f"cannot read dataset {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset {Path(path).name} is not JSONL: {e}") from None
    if not prompts:
        raise ValueError(f"dataset {path} has no prompts")
    return prompts


def make_prompts(engine: LLMEngine, num_prompts: int, input_len: int, shared_prefix_len: int = 0,
                 seed: int = 0, unshared: int = 0) -> list[list[int]]:
    """Random prompts of shared_prefix_len + input_len tokens, all starting with the same shared_prefix_len
    but the last `unshared`, whose prefixes are their own (requests beside the group, sharing nothing)."""
    rng = np.random.default_rng(seed)
    prefix = random_prompts(rng, 1, shared_prefix_len, engine.vocab_size)[0] if shared_prefix_len else []
    vocab = engine.vocab_size
    shared = [prefix + suffix for suffix in random_prompts(rng, num_prompts - unshared, input_len, vocab)]
    return shared + (random_prompts(rng, unshared, shared_prefix_len + input_len, vocab) if unshared else [])


def throughput_row(run: RunRecord, shared_prefix_len: int, prefix_caching: bool) -> dict:
    ttft = [t * 1e3 for t in run.ttft_s.values()]
    input_tokens = sum(run.prompt_lens)
    output_tokens = run.num_requests * run.output_len
    return {
        "num_prompts": run.num_requests,
        "input_len_mean": input_tokens / run.num_requests,
        "output_len": run.output_len,
        "shared_prefix_len": shared_prefix_len,
        "prefix_caching": prefix_caching,
        "total_s": run.total_s,
        "requests_s": run.num_requests / run.total_s,
        "input_tok_s": input_tokens / run.total_s,
        "output_tok_s": output_tokens / run.total_s,
        "total_tok_s": (input_tokens + output_tokens) / run.total_s,
        "ttft_ms_mean": float(np.mean(ttft)) if ttft else None,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "prefix_hit_rate": run.prefix_hits / run.prefix_queries if run.prefix_queries else (0.0 if prefix_caching else None),
        "steps": len(run.steps),
        # Where the time went: step() calls that returned some request's first token against the
        # rest, and the host's share (a step's time minus its wait for the GPU). With async
        # scheduling a call returns the previous step's tokens, so its time is mostly that step's
        # GPU time: the first group is the steps that finished a prompt. Prefill chunks that do not
        # finish one (prompts longer than the token budget) fall in the second group.
        "prefill_steps": sum(1 for s in run.steps if s.num_first_tokens),
        "prefill_steps_s": sum(s.seconds for s in run.steps if s.num_first_tokens),
        "decode_steps_s": sum(s.seconds for s in run.steps if not s.num_first_tokens),
        "decode_step_ms_mean": _mean_ms([s.seconds for s in run.steps if not s.num_first_tokens]),
        "host_s": sum(s.seconds - s.wait_s for s in run.steps),
        "peak_mem_gib": run.peak_mem_gib,
        "preemptions": run.preemptions,
        "jit_compiles": len(run.jit_compiles),  # Triton variants compiled in the timed window (should be 0)
        **run.spec_columns(),
    }


def _mean_ms(seconds: list[float]) -> float | None:
    return 1e3 * sum(seconds) / len(seconds) if seconds else None


def run_throughput(engine: LLMEngine, prompts: list, output_len: int, shared_prefix_len: int = 0,
                   progress: bool = True, warmup_len: int = 16, unshared: int = 0) -> dict:
    # Warm-up on prompts that share nothing with the measured ones: short ones, then a slice of the
    # workload at its prompt length (full prefill chunks, mixed steps, decode batches), and with a shared
    # prefix as many requests as run at once on another prefix (cascade attention's kernels, and its CUDA
    # graphs, captured at each batch size's first cascade step), so Triton's and cuBLAS's first-use work at
    # those sizes is not counted in the measured time.
    warm_output = 4
    max_len = engine.config.model.max_model_len - warm_output
    full_len = max(len(engine.tokenize(p)[1]) for p in prompts)
    warm = make_prompts(engine, min(8, len(prompts)), max(1, min(warmup_len, max_len)), seed=12345)
    warm += make_prompts(engine, min(32, len(prompts)), max(1, min(full_len, max_len)), seed=54321)
    run_requests(engine, warm, warm_output, "warmup", progress=False)
    if shared_prefix_len and full_len <= max_len:  # (on their own: their decode batch is the workload's)
        size = min(len(prompts), engine.config.scheduler.max_num_seqs)
        group = make_prompts(engine, size, full_len - shared_prefix_len, shared_prefix_len, seed=777,
                             unshared=min(unshared, size))
        run_requests(engine, group, warm_output, "warmup-shared", progress=False)
    cascade = engine.worker.runner.cascade
    cascaded = cascade.num_planned
    before = msgspec.structs.replace(engine.stats)  # (a copy: the engine updates its own)
    run = run_requests(engine, prompts, output_len, "req", progress=progress, desc="requests")
    row = throughput_row(run, shared_prefix_len, engine.config.cache.enable_prefix_caching)
    row["cascade_attention"] = {None: "auto", True: "on", False: "off"}[cascade.mode]
    row["cascade_steps"] = cascade.num_planned - cascaded
    row["unshared_prompts"] = unshared
    row.update(stats_columns(before, engine.stats, "engine"))  # the step's host and CPU time
    return row


def run_prefix(engine: LLMEngine, prompts: list, output_len: int, shared_prefix_len: int, progress: bool = True,
               warmup_len: int = 16, unshared: int = 0) -> list[dict]:
    """The prefix-sharing workload twice in the same engine: with cascade attention as configured, then off
    (unless it is off already); one row each, so their mean decode steps compare directly."""
    cascade = engine.worker.runner.cascade
    configured = cascade.mode
    rows = []
    try:
        for mode in [configured, False] if configured is not False else [False]:
            cascade.mode = mode
            rows.append(run_throughput(engine, prompts, output_len, shared_prefix_len, progress, warmup_len,
                                       unshared))
    finally:
        cascade.mode = configured
    return rows
