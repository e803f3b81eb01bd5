"""FP8 weights against bf16 in one run (issue #26): decode latency and offline throughput of the same
model, one engine of each built and torn down in turn.

    python benchmarks/bench_fp8.py --output-json fp8.json          # Llama-3.1-8B, random weights

Each engine (compiled, CUDA graphs, the engine's defaults otherwise) runs
- decode latency (`fastllm bench latency`'s sweep): batches of 1, 32 and 256 random 128-token prompts,
  256 greedy tokens each (EOS ignored), each batch after a warm-up batch of its size; tokens/s of the
  steps in which every request decodes;
- offline throughput (`fastllm bench throughput`'s run): 3,000 requests x 128 in / 128 out after its
  warm-up; output tokens/s.
A third engine has FP8 weights and an FP8 KV cache (kv_cache_dtype="fp8"; --no-fp8-kv leaves it out);
--fp8-lm-head adds one with lm_head in FP8 too (quantize_lm_head), set against the plain FP8 engine.
--profile DIR adds a profile of a few decode steps of each engine (batch --profile-batch-size), by kernel.
Each engine runs in a process of its own.
The last lines set FP8 against bf16 and the issue's targets: batch 1 >= 300 tok/s, batch 32 >= 1.6x,
batch 256 >= 1.4x (FP8 weights); throughput >= 1.4x with FP8 weights and the FP8 KV cache together.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from fastllm.bench import ceilings
from fastllm.bench.latency import run_latency
from fastllm.bench.profile import print_profile, profile_decode
from fastllm.bench.report import stall_note
from fastllm.bench.roofline import ModelShape
from fastllm.bench.throughput import make_prompts, run_throughput
from fastllm.engine.llm_engine import LLMEngine
from fastllm.entrypoints.process_setup import prepare_gc_for_serving

TARGETS = {1: ("tok/s", 300.0), 32: ("x bf16", 1.6), 256: ("x bf16", 1.4)}
THROUGHPUT_TARGET = 1.4


def measure(args, name: str, quantization: str | None, kv_cache_dtype: str = "auto",
            quantize_lm_head: bool = False) -> dict:
    engine = LLMEngine.from_kwargs(args.model, load_format=args.load_format, dtype="bfloat16",
                                   max_model_len=args.max_model_len, quantization=quantization,
                                   kv_cache_dtype=kv_cache_dtype, quantize_lm_head=quantize_lm_head)
    prepare_gc_for_serving()  # the garbage collector as `fastllm bench` and the server set it
    try:
        fp8 = engine.worker.runner.model.args.fp8
        shape = ModelShape.from_hf_config(engine.config.model.hf_config, "bfloat16", fp8)
        print(f"{name}: {engine.worker.num_gpu_blocks} KV blocks ({engine.worker.kv_cache_gib():.1f} GiB), "
              f"weights {shape.weight_bytes / 2**30:.2f} GiB, startup {engine.startup_seconds:.1f} s",
              flush=True)
        latency = run_latency(engine, args.batch_sizes, args.input_len, args.output_len, None, shape,
                              progress=False)
        for row in latency:
            print(f"  {name} batch {row['batch_size']:>3}: {row['tok_s_total']:,.1f} tok/s, step "
                  f"{row['tpot_ms_mean']:.2f} ms (Triton compiles while timed: {row['jit_compiles']})"
                  + stall_note(row), flush=True)
        prompts = make_prompts(engine, args.num_prompts, args.throughput_len)
        throughput = run_throughput(engine, prompts, args.throughput_len, progress=False)
        print(f"  {name} throughput {args.num_prompts} x {args.throughput_len}/{args.throughput_len}: "
              f"{throughput['output_tok_s']:,.0f} output tok/s", flush=True)
        if args.profile:  # where one decode step's time goes, by kernel (after the timed runs)
            print_profile(profile_decode(engine, args.profile_batch_size, args.input_len, f"{args.profile}/{name}"))
        engine.check_kv_pool_whole()
        return {"num_gpu_blocks": engine.worker.num_gpu_blocks, "kv_cache_gib": engine.worker.kv_cache_gib(),
                "weight_gib": shape.weight_bytes / 2**30, "latency": latency, "throughput": throughput}
    finally:
        engine.shutdown()


def measure_alone(args, name: str, quantization: str | None, kv_cache_dtype: str,
                  quantize_lm_head: bool = False) -> dict:
    """measure() in a process of its own: each engine sizes its KV pool on an empty GPU, whatever the last one
    left in this process's caches. (In one process the next engine once found no room: measure() then held
    the runner in a local through its teardown, so its gc.collect and empty_cache ran before the 122.6 GiB of
    a Llama-3.1-8B engine were freed.)"""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, args, name, quantization, kv_cache_dtype, quantize_lm_head).result()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 32, 256])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=3000)
    p.add_argument("--throughput-len", type=int, default=128,
                   help="prompt and output tokens of the throughput run")
    p.add_argument("--no-fp8-kv", action="store_true", help="no engine with an FP8 KV cache")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="one more engine: FP8 weights with lm_head in FP8 too (quantize_lm_head)")
    p.add_argument("--profile", metavar="DIR", help="after each engine's runs, a torch-profiler trace of a few "
                   "decode steps to DIR/<engine> and its top kernels (fastllm bench --profile's)")
    p.add_argument("--profile-batch-size", type=int, default=None,
                   help="batch of the profiled steps (default 32)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.profile_batch_size is not None and not args.profile:
        p.error("--profile-batch-size sets what --profile traces: give --profile DIR too")
    args.profile_batch_size = 32 if args.profile_batch_size is None else args.profile_batch_size
    engines = [("bf16", None, "auto", False), ("fp8", "fp8", "auto", False)]
    engines += [] if args.no_fp8_kv else [("fp8+kv", "fp8", "fp8", False)]
    engines += [("fp8+lm_head", "fp8", "auto", True)] if args.fp8_lm_head else []
    results = {engine[0]: measure_alone(args, *engine) for engine in engines}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = {**ceilings.environment(device), "model": args.model, "load_format": args.load_format,
            "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts}
    print(f"\nFP8 weights against bf16: {args.model} ({args.load_format}) on {meta['device']}, "
          f"commit {meta['commit']}")
    print(f"KV blocks: {results['bf16']['num_gpu_blocks']} -> {results['fp8']['num_gpu_blocks']}; weights "
          f"{results['bf16']['weight_gib']:.2f} -> {results['fp8']['weight_gib']:.2f} GiB")
    print("| batch | bf16 tok/s | fp8 tok/s | fp8 / bf16 | target |")
    print("|---:|---:|---:|---:|---|")
    for base, fp8 in zip(results["bf16"]["latency"], results["fp8"]["latency"]):
        b, ratio = base["batch_size"], fp8["tok_s_total"] / base["tok_s_total"]
        unit, bound = TARGETS.get(b, (None, None))
        got = fp8["tok_s_total"] if unit == "tok/s" else ratio
        verdict = "" if unit is None else f"{'met' if got >= bound else 'MISSED'} (>= {bound} {unit})"
        print(f"| {b} | {base['tok_s_total']:,.1f} | {fp8['tok_s_total']:,.1f} | {ratio:.2f}x | {verdict} |")
    base, fp8 = results["bf16"]["throughput"]["output_tok_s"], results["fp8"]["throughput"]["output_tok_s"]
    n = args.throughput_len
    print(f"| throughput {args.num_prompts} x {n}/{n} | {base:,.0f} | {fp8:,.0f} | {fp8 / base:.2f}x | "
          f"(FP8 weights alone) |")
    if "fp8+kv" in results:
        both = results["fp8+kv"]["throughput"]["output_tok_s"]
        verdict = "met" if both / base >= THROUGHPUT_TARGET else "MISSED"
        print(f"| throughput, FP8 weights + FP8 KV cache ({results['fp8+kv']['num_gpu_blocks']} KV blocks) | "
              f"{base:,.0f} | {both:,.0f} | {both / base:.2f}x | {verdict} (>= {THROUGHPUT_TARGET}x) |")
    if "fp8+lm_head" in results:
        rows = zip(results["bf16"]["latency"], results["fp8"]["latency"], results["fp8+lm_head"]["latency"])
        print("\n| batch | fp8 tok/s | fp8 + FP8 lm_head tok/s | x fp8 | x bf16 |\n|---:|---:|---:|---:|---:|")
        for base, fp8, head in rows:
            print(f"| {base['batch_size']} | {fp8['tok_s_total']:,.1f} | {head['tok_s_total']:,.1f} | "
                  f"{head['tok_s_total'] / fp8['tok_s_total']:.2f}x | {head['tok_s_total'] / base['tok_s_total']:.2f}x |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "fp8", "meta": meta, "results": results}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
