"""Beam search's cost per generated position against plain decoding of as many sequences, in one run:
beam width W at batch 1 against a batch-W greedy decode (ignore EOS), same prompt length, same engine.

    python benchmarks/bench_beam_search.py --model llama-3.1-8b --load-format dummy --dtype bfloat16

Each side runs twice, to --short and to --long generated tokens; the cost of a position is the
difference of the two wall times over the difference of the lengths, so the prompt, the first step
and the search's bookkeeping at the ends cancel out. Both sides are warmed up first (CUDA graphs,
the sampler's logprob path, Triton autotuning), repeated --repeats times, the median kept. The target
(issue #25): beam search costs at most 1.15x the decode step per position.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity

from fastllm import BeamSearchParams, SamplingParams
from fastllm.bench import ceilings, profile
from fastllm.bench.runner import random_prompts
from fastllm.engine.llm_engine import LLMEngine
from fastllm.entrypoints.process_setup import prepare_gc_for_serving
from fastllm.tracing import enable_nvtx

TARGET = 1.15


def timed(engine: LLMEngine, prompt: list[int], width: int, num_tokens: int,
          beam: bool) -> tuple[float, float]:
    """Wall seconds from submitting to the last output (width greedy requests, or one beam search), and the
    host's share: the steps' time less their waits for the GPU."""
    tag = f"{'beam' if beam else 'decode'}-{num_tokens}-{time.perf_counter_ns()}"
    start = time.perf_counter()
    if beam:
        engine.add_beam_search(tag, {"prompt_token_ids": prompt}, BeamSearchParams(width, num_tokens, ignore_eos=True))
    else:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        for i in range(width):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    waits = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        waits += engine.last_step_wait_s
    wall = time.perf_counter() - start
    return wall, wall - waits


def per_position_ms(engine, prompt, width, short, long, beam, repeats) -> tuple[float, float]:
    """Median milliseconds per generated position: wall, and host (wall less the GPU waits)."""
    costs, hosts = [], []
    for _ in range(repeats):
        (t_short, h_short), (t_long, h_long) = (timed(engine, prompt, width, n, beam) for n in (short, long))
        costs.append((t_long - t_short) / (long - short) * 1e3)
        hosts.append((h_long - h_short) / (long - short) * 1e3)
    return statistics.median(costs), statistics.median(hosts)


def profile_beam_steps(engine: LLMEngine, prompt: list[int], width: int, out_dir: str,
                       steps: int = 8) -> dict:
    """A torch-profiler trace of `steps` beam-search positions (after the prompt and two positions, outside
    it): the kernels of a beam step (its sampler's too) and where its host time goes."""
    enable_nvtx()
    on_gpu = engine.worker.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    params = BeamSearchParams(width, steps + 8, ignore_eos=True)
    engine.add_beam_search("profile", {"prompt_token_ids": prompt}, params)
    for _ in range(3):
        engine.step()
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"beam_step{i}"):
                engine.step()
    engine.abort_request("profile")
    while engine.has_unfinished_requests():
        engine.step()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    trace = Path(out_dir) / f"beam_w{width}_{engine.worker.device.type}.trace.json"
    prof.export_chrome_trace(str(trace))
    return {"trace": str(trace), "top": profile.top_ops(prof, on_gpu), "on_gpu": on_gpu, "steps": steps,
            "ranges": profile.range_table(prof, steps, on_gpu),
            "host": profile.top_ops(prof, on_gpu=False) if on_gpu else None,
            **profile.device_tables(trace, steps, on_gpu)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--short", type=int, default=32, help="generated tokens of the short runs")
    p.add_argument("--long", type=int, default=160, help="generated tokens of the long runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--beam-run-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="beam_run_ahead (the engine's default); --no-beam-run-ahead: the synchronous beam steps")
    p.add_argument("--output-json", default=None)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timings, record a few beam steps with the torch profiler into DIR")
    args = p.parse_args(argv)
    width = args.beam_width
    graphs = {"cuda_graph_sizes": [1, 2, 4, 8, 16]} if torch.cuda.is_available() else {}  # (GPUs' only)
    engine = LLMEngine.from_kwargs(args.model, load_format=args.load_format, dtype=args.dtype,
                                   max_model_len=args.max_model_len, beam_run_ahead=args.beam_run_ahead,
                                   **graphs)
    prepare_gc_for_serving()  # the garbage collector as `fastllm bench` and the server set it
    vocab = engine.vocab_size
    prompt = random_prompts(np.random.default_rng(0), 1, args.input_len, vocab)[0]
    for beam in (False, True):  # warm up: graphs replayed, sampler paths and kernels compiled
        timed(engine, prompt, width, 8, beam)
    decode, decode_host = per_position_ms(engine, prompt, width, args.short, args.long, False, args.repeats)
    beams, beam_host = per_position_ms(engine, prompt, width, args.short, args.long, True, args.repeats)
    engine.check_kv_pool_whole()
    ratio = beams / decode
    meta = {**ceilings.environment(engine.worker.device), "model": args.model, "dtype": args.dtype,
            "load_format": args.load_format, "input_len": args.input_len, "beam_run_ahead": args.beam_run_ahead}
    print(f"beam search width {width} vs batch-{width} greedy decode: {args.model} ({args.load_format}, {args.dtype}) "
          f"on {meta['device']}, commit {meta.get('commit')}, prompt {args.input_len} tokens")
    print(f"  batch-{width} decode step:        {decode:.3f} ms per position (host, not waiting for the GPU: "
          f"{decode_host:.3f} ms, overlapped)")
    overlap = "steps run ahead, overlapped" if args.beam_run_ahead else "synchronous steps, all of it between steps"
    print(f"  beam search, width {width}:       {beams:.3f} ms per position (host: {beam_host:.3f} ms, {overlap})")
    print(f"  ratio: {ratio:.3f} (target <= {TARGET}) -> {'PASS' if ratio <= TARGET else 'FAIL'}")
    if args.profile:
        profile.print_profile(profile_beam_steps(engine, prompt, width, args.profile))
        engine.check_kv_pool_whole()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "beam_search", "meta": meta, "decode_ms": decode, "beam_ms": beams,
                       "decode_host_ms": decode_host, "beam_host_ms": beam_host, "ratio": ratio,
                       "target": TARGET}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
