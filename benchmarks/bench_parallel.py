"""Tensor and pipeline parallelism against one GPU, both in one run.

    python benchmarks/bench_parallel.py latency --model llama-3.1-8b --tensor-parallel-size 2 \\
        --batch-sizes 1,64
    python benchmarks/bench_parallel.py latency --model llama-3.1-70b --tensor-parallel-size 4 \\
        --batch-sizes 1 --no-baseline
    python benchmarks/bench_parallel.py throughput --model llama-3.1-8b --pipeline-parallel-size 2 \\
        --num-prompts 3000 --input-len 128 --output-len 128

Random (dummy) weights in bf16 unless --load-format/--dtype say otherwise; other flags are engine
arguments, as `fastllm bench` takes them. The baseline is the same engine on one GPU (--no-baseline
skips it: a model that does not fit one GPU).

latency: the decode sweep of `fastllm bench latency` (128 in / 256 out by default), per batch size the
tokens/s of one GPU and of the split engine and their ratio; for the split engine its decode step
against its weight floor (the weights one rank reads over the copy bandwidth measured in this run)
and the all-reduce time per step: the all-reduces of one decode step (two per layer and the
embedding's) times one all-reduce of [batch, hidden], timed on the engine's own ranks and path.
throughput: offline throughput (`fastllm bench throughput`: every request at once, EOS ignored),
output tokens/s of one GPU and of the split engine, and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import sys

import pandas as pd
import torch

from fastllm.bench import ceilings, report
from fastllm.bench.latency import run_latency
from fastllm.bench.roofline import ModelShape
from fastllm.bench.throughput import make_prompts, run_throughput
from fastllm.config import EngineConfig
from fastllm.engine.llm_engine import LLMEngine
from fastllm.entrypoints.bench import parse_batch_sizes
from fastllm.entrypoints.cli import add_engine_args, engine_kwargs
from fastllm.entrypoints.process_setup import prepare_gc_for_serving


def on_gpu(args: argparse.Namespace) -> bool:
    return torch.cuda.is_available() and args.device != "cpu"


def build(args: argparse.Namespace, tp: int, pp: int) -> LLMEngine:
    kwargs = engine_kwargs(args) | {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    if args.batch_sizes and args.mode == "latency" and not kwargs.get("enforce_eager") and on_gpu(args):
        kwargs["cuda_graph_sizes"] = parse_batch_sizes(args.batch_sizes)
    engine = LLMEngine(EngineConfig.from_kwargs(args.model, **kwargs))
    prepare_gc_for_serving()  # the garbage collector as `fastllm bench` and the server set it
    return engine


def release(engine: LLMEngine) -> None:
    engine.shutdown()
    del engine
    gc.unfreeze()  # (build froze its startup objects: the next engine needs their memory)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def latency_rows(engine: LLMEngine, args, shape: ModelShape, ceil: dict) -> list[dict]:
    return run_latency(engine, parse_batch_sizes(args.batch_sizes), args.input_len, args.output_len, ceil,
                       shape, progress=False)


def all_reduce_ms_per_step(engine: LLMEngine, shape: ModelShape, batch_size: int) -> float | None:
    """One decode step's all-reduces: two per layer and the embedding's, each [batch, hidden]."""
    if engine.config.parallel.tensor_parallel_size == 1:
        return None
    one = engine.executor.measure_all_reduce([batch_size * shape.hidden_size * shape.dtype_bytes])[0]
    return one * (2 * shape.num_layers + 1)


def run_latency_comparison(args, shape: ModelShape, ceil: dict | None) -> pd.DataFrame:
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    base = {}
    if not args.no_baseline:
        engine = build(args, 1, 1)
        base = {r["batch_size"]: r for r in latency_rows(engine, args, shape, ceil)}
        release(engine)
    engine = build(args, tp, pp)
    rows = []
    for r in latency_rows(engine, args, shape, ceil):
        bs = r["batch_size"]
        floor_ms = shape.decode_weight_bytes(bs) / tp / ceil["copy_bytes_per_s"] * 1e3 if ceil else None
        ar_ms = all_reduce_ms_per_step(engine, shape, bs)
        one = base.get(bs, {}).get("tok_s_total")
        step_ms = r["tpot_ms_mean"]
        rows.append({"batch_size": bs, "tp": tp, "pp": pp, "tok_s_1gpu": one, "tok_s": r["tok_s_total"],
                     "speedup": r["tok_s_total"] / one if one else None, "tpot_ms": step_ms,
                     "weight_floor_ms": floor_ms, "floor_frac": floor_ms / step_ms if floor_ms else None,
                     "allreduce_ms_step": ar_ms, "allreduce_frac": ar_ms / step_ms if ar_ms else None,
                     "host_ms_p50": r["host_ms_p50"], "jit_compiles": r["jit_compiles"]})
    release(engine)
    return pd.DataFrame(rows)


def run_throughput_comparison(args) -> pd.DataFrame:
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    results = {}
    for name, (t, p) in (("1gpu", (1, 1)), ("split", (tp, pp))):
        if name == "1gpu" and args.no_baseline:
            continue
        engine = build(args, t, p)
        prompts = make_prompts(engine, args.num_prompts, args.input_len, seed=0)
        results[name] = run_throughput(engine, prompts, args.output_len, progress=False)
        release(engine)
    one = results.get("1gpu", {}).get("output_tok_s")
    split = results["split"]
    return pd.DataFrame([{
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len, "tp": tp,
        "pp": pp, "out_tok_s_1gpu": one, "out_tok_s": split["output_tok_s"],
        "ratio": split["output_tok_s"] / one if one else None, "total_s": split["total_s"],
        "preemptions": split["preemptions"], "jit_compiles": split["jit_compiles"]}])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["latency", "throughput"])
    p.add_argument("--batch-sizes", default=None, help="latency: comma-separated batch sizes (default: 1,64)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=None, help="default: latency 256, throughput 128")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="throughput: requests, submitted at once (default: 3000)")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-GPU engine")
    p.add_argument("--output-csv", default=None)
    add_engine_args(p)
    p.set_defaults(load_format="dummy", dtype="bfloat16", max_model_len=4096)
    args = p.parse_args(argv)
    for flag, value, mode in (("--batch-sizes", args.batch_sizes, "latency"),
                              ("--num-prompts", args.num_prompts, "throughput")):
        if value is not None and args.mode != mode:
            p.error(f"{flag} is for {mode} (this run is {args.mode})")
    args.batch_sizes = "1,64" if args.batch_sizes is None else args.batch_sizes
    args.num_prompts = 3000 if args.num_prompts is None else args.num_prompts
    args.output_len = args.output_len or (256 if args.mode == "latency" else 128)
    if args.tensor_parallel_size * args.pipeline_parallel_size == 1:
        p.error("give --tensor-parallel-size or --pipeline-parallel-size above 1")
    device = torch.device("cuda", 0) if on_gpu(args) else torch.device("cpu")
    ceil = ceilings.measure_ceilings(device) if on_gpu(args) else None  # the CPU: a dry run, no floor
    shape = ModelShape.from_model(args.model, args.dtype)
    if args.mode == "latency":
        frame = run_latency_comparison(args, shape, ceil)
    else:
        frame = run_throughput_comparison(args)
    env = ceilings.environment(device)
    copy = f"copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s" if ceil else "no ceilings (CPU)"
    print(f"{args.mode}: {args.model or 'stories260K'} ({args.dtype}, {args.load_format} weights) on "
          f"{env['device']} | torch {env['torch']} | commit {env['commit']} | {copy}")
    print(report.format_frame(frame))
    if args.output_csv:
        stamp = {k: env[k] for k in ("device", "torch", "commit")}
        frame.assign(**stamp).to_csv(args.output_csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
