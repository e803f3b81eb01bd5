"""`fastllm bench [latency|throughput|prefix|startup|serving]`: argument parsing and the run; the
measurements live in fastllm/bench/ (latency.py, throughput.py, serving.py, profile.py, roofline.py, ...).

  fastllm bench --batch-sizes 1,8,32 --input-len 128 --output-len 256     decode latency sweep
  fastllm bench throughput --num-prompts 256 --input-len 512 --output-len 256
  fastllm bench prefix --num-prompts 64 --shared-prefix-len 1024 --input-len 128
  fastllm bench startup
  fastllm bench serving --num-prompts 200 --request-rates 4,16,inf    requests at a rate to `fastllm serve`
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from fastllm.entrypoints.cli import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)

MODES = ("latency", "throughput", "prefix", "startup", "serving")
# mode -> (input_len, output_len, shared_prefix_len)
DEFAULTS = {"latency": (128, 256, 0), "throughput": (512, 256, 0), "prefix": (128, 128, 1024), "startup": (0, 0, 0),
            "serving": (128, 128, 0)}


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: decode latency sweep (default), throughput, prefix, startup",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="latency", choices=MODES, help="what to measure (default: latency)")
    w = p.add_argument_group("workload")
    w.add_argument("--batch-sizes", default="1,8,32,128,256", help="latency: comma-separated batch sizes")
    w.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens (default: latency 128, throughput 512, prefix 128 after the shared prefix)")
    w.add_argument("--output-len", type=int, default=None, help="generated tokens per request, EOS ignored "
                   "(default: latency 256, throughput 256, prefix 128)")
    w.add_argument("--num-prompts", type=int, default=256, help="throughput/prefix: requests, all submitted at once")
    w.add_argument("--dataset", default=None, help='throughput: JSONL of {"prompt": ...} or {"prompt_token_ids": [...]}')
    w.add_argument("--shared-prefix-len", type=int, default=None,
                   help="throughput/prefix: tokens every prompt shares before its own input-len (prefix: 1024)")
    w.add_argument("--request-rates", default="inf", help="serving: comma-separated requests/s (Poisson arrivals); "
                   "inf sends all at once")
    w.add_argument("--max-concurrency", type=int, default=None, help="serving: most requests in flight")
    w.add_argument("--url", default=None, help="serving: a running `fastllm serve` (default: start one with the "
                   "engine arguments below)")
    w.add_argument("--served-model-name", default=None, help="serving: the model name that server answers to")
    w.add_argument("--cuda-graph-sizes", default=None,
                   help="decode batch sizes to capture, comma-separated (default: the engine's, 1..max-num-seqs); "
                        "the sweep's batch sizes are enough for a latency run and capture faster")
    w.add_argument("--matmul-floor", action="store_true",
                   help="latency: also time the step's weight matmuls alone (one CUDA graph) per batch size")
    o = p.add_argument_group("output")
    o.add_argument("--output-json", default=None, help="write the run (rows, ceilings, startup, versions) as JSON")
    o.add_argument("--output-csv", default=None, help="write the rows as CSV, stamped with device/versions/commit")
    o.add_argument("--plot", default=None, help="latency: PNG of tokens/s and %% of bandwidth vs batch size")
    o.add_argument("--ceilings-from", default=None, help="reuse a ceilings JSON instead of measuring")
    o.add_argument("--ceilings-out", default=None, help="write the measured ceilings JSON here")
    o.add_argument("--no-ceilings", action="store_true", help="do not measure ceilings (%%bw/%%tc n/a)")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    o.add_argument("-v", "--verbose", action="store_true")
    t = p.add_argument_group("profiling")
    t.add_argument("--profile", default=None, metavar="DIR",
                   help="after the run, write a torch-profiler Chrome trace of a few decode steps to DIR")
    t.add_argument("--profile-batch-size", type=int, default=None,
                   help="batch of the profiled steps (default: the largest batch size)")
    t.add_argument("--profile-steps", type=int, default=5, help="decode steps in the trace")
    t.add_argument("--nvtx", action="store_true", help="NVTX ranges on (engine phases) for Nsight Systems")
    t.add_argument("--nvtx-layers", action="store_true", help="NVTX ranges per decoder layer too (implies --nvtx)")
    add_engine_args(p)
    p.set_defaults(func=cmd_bench)

    def one_line_error(message: str):
        print(f"fastllm bench: error: {message}", file=sys.stderr)
        sys.exit(2)

    p.error = one_line_error


def parse_batch_sizes(text: str, flag: str = "--batch-sizes") -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"{flag} must be comma-separated integers >= 1, got {text!r}")
    return sizes


def bench_engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = engine_kwargs(args)
    if args.cuda_graph_sizes:
        kwargs["cuda_graph_sizes"] = parse_batch_sizes(args.cuda_graph_sizes, "--cuda-graph-sizes")
    return kwargs


def execution(engine) -> str:
    runner = engine.worker.runner
    if getattr(runner, "graphs", None) is not None:
        return f"compiled + CUDA graphs up to batch {runner.graphs.max_bs}"
    if getattr(runner, "compile_seconds", 0):
        return "compiled"
    return "eager"


def check_args(args: argparse.Namespace) -> None:
    """Fill the mode's defaults and reject bad values (ValueError: one line, exit code 2)."""
    input_len, output_len, prefix_len = DEFAULTS[args.mode]
    args.input_len = input_len if args.input_len is None else args.input_len
    args.output_len = output_len if args.output_len is None else args.output_len
    args.shared_prefix_len = prefix_len if args.shared_prefix_len is None else args.shared_prefix_len
    args.batch_sizes = parse_batch_sizes(args.batch_sizes)
    if args.mode == "startup":
        return
    for name in ("input_len", "output_len", "num_prompts", "profile_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len must be >= 0, got {args.shared_prefix_len}")
    if args.profile_batch_size is not None and args.profile_batch_size < 1:
        raise ValueError(f"--profile-batch-size must be >= 1, got {args.profile_batch_size}")
    if args.dataset and args.mode != "throughput":
        raise ValueError("--dataset is for `fastllm bench throughput`")
    if args.dataset and args.shared_prefix_len:
        raise ValueError("--dataset and --shared-prefix-len do not combine")


def check_batch_sizes(args: argparse.Namespace, max_num_seqs: int) -> None:
    too_big = [b for b in args.batch_sizes + [args.profile_batch_size or 1] if b > max_num_seqs]
    if too_big:
        raise ValueError(f"batch size {max(too_big)} exceeds --max-num-seqs {max_num_seqs}")


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from fastllm.bench import ceilings as ceil
    from fastllm.bench import report
    from fastllm.bench.roofline import ModelShape
    from fastllm.bench.runner import build_config, check_lengths, startup_breakdown
    from fastllm.engine.llm_engine import LLMEngine
    from fastllm.tracing import enable_nvtx
    from fastllm.worker.worker import select_device

    check_args(args)
    if args.nvtx or args.nvtx_layers:
        enable_nvtx(layers=args.nvtx_layers)
    config = build_config(args.model, bench_engine_kwargs(args))
    if args.mode != "startup" and not args.dataset:
        check_lengths(config, args.shared_prefix_len + args.input_len, args.output_len)
    dataset = None
    if args.dataset:
        from fastllm.bench.throughput import load_dataset

        dataset = load_dataset(args.dataset, args.num_prompts)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    if args.mode == "serving":
        return cmd_serving(args, config)
    device = select_device(config, 0)
    config = config.for_device(device)  # max_num_seqs decided for the device, before anything loads
    if args.mode == "latency":
        check_batch_sizes(args, config.scheduler.max_num_seqs)

    ceilings = None
    if args.ceilings_from:
        ceilings = {**ceil.load_ceilings(args.ceilings_from, device), "source": args.ceilings_from}
    elif device.type == "cuda" and not args.no_ceilings and args.mode != "startup":
        ceilings = {**ceil.measure_ceilings(device), "source": "measured"}
    if args.ceilings_out:
        if ceilings is None:
            logger.warning("no ceilings to write to %s (no GPU, or --no-ceilings)", args.ceilings_out)
        else:
            ceil.save_ceilings(ceilings, args.ceilings_out)

    engine = LLMEngine(config)
    dtype = str(engine.worker.runner.dtype).replace("torch.", "")
    shape = ModelShape.from_hf_config(config.model.hf_config, dtype)
    actual = sum(p.numel() for p in engine.worker.runner.model.parameters())  # rank 0's shard
    if config.parallel.world_size == 1 and actual != shape.num_params:
        logger.warning("roofline counts %d parameters, the model has %d: bytes/FLOPs are off", shape.num_params, actual)
    meta = {
        **ceil.environment(device),
        "model": Path(config.model.model).name, "model_path": config.model.model, "dtype": dtype,
        "load_format": config.model.load_format, "enforce_eager": config.compile.enforce_eager,
        "mode": args.mode, "input_len": args.input_len, "output_len": args.output_len,
        "batch_sizes": args.batch_sizes if args.mode == "latency" else None,
        "num_prompts": args.num_prompts if args.mode in ("throughput", "prefix") else None,
        "shared_prefix_len": args.shared_prefix_len, "dataset": args.dataset,
        "engine_args": bench_engine_kwargs(args), "max_model_len": config.model.max_model_len,
        "execution": execution(engine),
        "nvtx": args.nvtx or args.nvtx_layers,
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }
    result = {"benchmark": args.mode, "meta": meta, "ceilings": ceilings, "startup": startup_breakdown(engine),
              "model": shape.summary(), "rows": []}
    print(report.header(result), flush=True)

    def save() -> None:
        if args.output_json:
            report.write_json(result, args.output_json)
        if args.output_csv:
            report.write_csv(result, args.output_csv)

    def on_row(row: dict) -> None:
        result["rows"].append(row)
        print(report.row_line(args.mode, row), flush=True)
        save()

    profile_bs, profile_len = args.profile_batch_size, args.input_len
    if args.mode == "latency":
        from fastllm.bench.latency import run_latency

        run_latency(engine, args.batch_sizes, args.input_len, args.output_len, ceilings, shape, seed=config.model.seed,
                    matmul_floor=args.matmul_floor, progress=progress, on_row=on_row)
        profile_bs = profile_bs or max(args.batch_sizes)
    elif args.mode in ("throughput", "prefix"):
        from fastllm.bench.throughput import make_prompts, run_prefix, run_throughput

        prompts = dataset or make_prompts(engine, args.num_prompts, args.input_len, args.shared_prefix_len,
                                          seed=config.model.seed)
        if args.mode == "prefix":  # with cascade attention as configured, then off: both rows
            for row in run_prefix(engine, prompts, args.output_len, args.shared_prefix_len, progress,
                                  warmup_len=min(args.input_len, 512)):
                on_row(row)
            print(report.cascade_summary(result["rows"]), flush=True)
        else:
            on_row(run_throughput(engine, prompts, args.output_len, args.shared_prefix_len, progress,
                                  warmup_len=min(args.input_len, 512)))
        profile_bs = profile_bs or min(args.num_prompts, config.scheduler.max_num_seqs)
        profile_len = args.shared_prefix_len + args.input_len
    else:
        save()
    print(report.table(result), flush=True)
    save()
    if args.plot:
        if args.mode == "latency":
            report.plot_latency(result, args.plot)
        else:
            logger.warning("--plot draws the latency sweep only; nothing plotted for %s", args.mode)
    if args.profile and args.mode != "startup":
        from fastllm.bench.profile import print_profile, profile_decode

        print_profile(profile_decode(engine, profile_bs, profile_len, args.profile, args.profile_steps,
                                     layers=args.nvtx_layers))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    engine.shutdown()
    return 0


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rates must be comma-separated numbers > 0 (or inf), got {text!r}")
    return rates


def serve_args(args: argparse.Namespace) -> list[str]:
    """The `fastllm serve` flags that give the server this run's engine arguments."""
    from fastllm.entrypoints.cli import ENGINE_ARGS

    out = ["--model", args.model] if args.model else []
    for name, (_, default, _) in ENGINE_ARGS.items():
        value = getattr(args, name)
        if value is not None and value != default:
            out += ["--" + name.replace("_", "-"), str(value)]
    out += ["--no-prefix-caching"] if args.no_prefix_caching else []
    out += ["--no-cascade-attention"] if args.no_cascade_attention else []
    out += ["--enforce-eager"] if args.enforce_eager else []
    return out


def cmd_serving(args: argparse.Namespace, config) -> int:
    """Requests at each rate to a `fastllm serve` (started here unless --url), one row per rate."""
    import asyncio
    import socket

    from fastllm.bench import ceilings as ceil
    from fastllm.bench import report
    import numpy as np

    from fastllm.bench.runner import random_prompts
    from fastllm.bench.serving import ServerProcess, run_load, summarize
    from fastllm.entrypoints.openai.server import served_name
    from fastllm.worker.worker import select_device

    rates = parse_rates(args.request_rates)
    if args.cuda_graph_sizes:
        logger.warning("--cuda-graph-sizes is not passed to the server: it captures its default sizes")
    model_name = args.served_model_name or served_name(args.model)
    vocab = config.model.hf_config["vocab_size"]
    meta = {**ceil.environment(select_device(config, 0)), "model": model_name, "model_path": config.model.model,
            "dtype": config.model.dtype, "load_format": config.model.load_format, "mode": "serving",
            "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
            "request_rates": rates, "url": args.url, "engine_args": serve_args(args),
            "execution": "fastllm serve, streamed /v1/completions"}
    result = {"benchmark": "serving", "meta": meta, "ceilings": None, "startup": None, "rows": []}

    def run(url: str) -> None:
        print(report.header(result), flush=True)
        warm = random_prompts(np.random.default_rng(1), 2, min(args.input_len, 16), vocab)
        asyncio.run(run_load(url, model_name, warm, 4, float("inf")))  # first-use compiles, connections
        for i, rate in enumerate(rates):
            prompts = random_prompts(np.random.default_rng(config.model.seed + i), args.num_prompts, args.input_len,
                                     vocab)
            records, wall = asyncio.run(run_load(url, model_name, prompts, args.output_len, rate,
                                                 seed=config.model.seed + i, max_concurrency=args.max_concurrency))
            row = summarize(records, wall, rate, args.input_len, args.output_len)
            result["rows"].append(row)
            print(report.row_line("serving", row), flush=True)
            if args.output_json:
                report.write_json(result, args.output_json)

    if args.url:
        run(args.url.rstrip("/"))
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with ServerProcess(serve_args(args), port) as server:
            run(server.url)
    print(report.table(result), flush=True)
    if args.output_json:
        report.write_json(result, args.output_json)
    if args.output_csv:
        report.write_csv(result, args.output_csv)
    return 0
