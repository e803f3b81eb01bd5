"""`fastllm bench`: its arguments and the run of each mode; the measurements themselves live in
fastllm/bench/ (latency.py, throughput.py, serving.py, profile.py, roofline.py, ...)."""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

from fastllm.config import SERVING_DEFAULTS
from fastllm.entrypoints.cli import SPECULATIVE_FLAGS, add_engine_args, engine_fields, engine_kwargs

logger = logging.getLogger(__name__)

MODES = {
    "latency": "decode latency sweep (the default): per batch size, time to first token, time per output "
               "token, tokens/s and the share of the GPU's copy bandwidth and tensor-core rate reached",
    "throughput": "offline throughput: --num-prompts requests submitted at once (random prompts or --dataset); "
                  "requests/s and tokens/s",
    "prefix": "prefix sharing: requests that share a --shared-prefix-len prefix; time to first token, "
              "throughput and the prefix-cache hit rate",
    "startup": "seconds from LLM(...) to ready, per phase (load, compile, CUDA graphs, KV cache)",
    "serving": "requests at Poisson --request-rates to `fastllm serve` (started here unless --url): TTFT, "
               "TPOT, inter-token latency and throughput per rate",
}
DESCRIPTION = """Measure fastllm on this machine. Every mode prints a table stamped with the device, library
versions and commit; --output-json / --output-csv keep it.

modes:
{modes}

examples:
  fastllm bench --model llama-3.1-8b --load-format dummy --dtype bfloat16 --batch-sizes 1,8,32
  fastllm bench throughput --num-prompts 256 --input-len 512 --output-len 256
  fastllm bench prefix --num-prompts 64 --shared-prefix-len 1024 --input-len 128
  fastllm bench startup
  fastllm bench serving --num-prompts 200 --request-rates 4,16,inf

Prompts are random token ids of --input-len tokens, outputs --output-len tokens with EOS ignored, so
runs are comparable across models and commits. Without a GPU the engine runs on the CPU, and the
bandwidth and tensor-core columns are n/a."""
# mode -> (input_len, output_len, shared_prefix_len)
DEFAULTS = {"latency": (128, 256, 0), "throughput": (512, 256, 0), "prefix": (128, 128, 1024), "startup": (0, 0, 0),
            "serving": (128, 128, 0)}
# The flags that only some modes read, and those modes: given to another they would do nothing, so they are an
# error there. (Their parser default is None or False, the value they take when not given.)
_RUNS = ("latency", "throughput", "prefix")  # the modes that run the engine here
FLAG_MODES = {
    "batch_sizes": ("latency",), "matmul_floor": ("latency",), "plot": ("latency",),
    "input_len": (*_RUNS, "serving"), "output_len": (*_RUNS, "serving"), "progress": (*_RUNS, "serving"),
    "num_prompts": ("throughput", "prefix", "serving"), "dataset": ("throughput",),
    "shared_prefix_len": ("throughput", "prefix"), "unshared_prompts": ("throughput", "prefix"),
    "request_rates": ("serving",), "max_concurrency": ("serving",), "url": ("serving",),
    "served_model_name": ("serving",), "api_key": ("serving",), "client_processes": ("serving",),
    "no_offline": ("serving",),
    "profile": _RUNS, "profile_batch_size": _RUNS, "profile_steps": _RUNS,
    # (startup measures no ceilings: it shows those of --ceilings-from)
    "ceilings_from": (*_RUNS, "startup"), "ceilings_out": _RUNS, "no_ceilings": _RUNS,
    "nvtx": (*_RUNS, "startup"), "nvtx_layers": (*_RUNS, "startup"),  # (a served engine's process has none)
}
_TRI_STATE = {"progress"}  # --progress / --no-progress: None is "not given", False too is given
# Their defaults where a mode reads them (the help says so too); input_len, output_len and shared_prefix_len
# take the mode's (DEFAULTS).
FLAG_DEFAULTS = {"batch_sizes": "1,8,32,128,256", "num_prompts": 256, "unshared_prompts": 0,
                 "request_rates": "inf", "client_processes": 4, "profile_steps": 5}


def add_bench_parser(subparsers) -> None:
    modes = "\n".join(textwrap.fill(text, 100, initial_indent=f"  {name:<11} ", subsequent_indent=" " * 14)
                      for name, text in MODES.items())
    p = subparsers.add_parser("bench", help=f"benchmarks: {', '.join(MODES)} (latency is the default)",
                              description=DESCRIPTION.format(modes=modes),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="latency", choices=list(MODES), help="what to measure (default: latency)")
    w = p.add_argument_group("workload")
    w.add_argument("--batch-sizes", default=None,
                   help="latency: comma-separated batch sizes (default: 1,8,32,128,256)")
    w.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens (default: latency 128, throughput 512, prefix 128 after the shared prefix)")
    w.add_argument("--output-len", type=int, default=None, help="generated tokens per request, EOS ignored "
                   "(default: latency 256, throughput 256, prefix 128)")
    w.add_argument("--num-prompts", type=int, default=None,
                   help="throughput/prefix: requests, all submitted at once; serving: requests a rate "
                   "(default: 256)")
    w.add_argument("--dataset", default=None, help='throughput: JSONL of {"prompt": ...} or {"prompt_token_ids": [...]}')
    w.add_argument("--shared-prefix-len", type=int, default=None,
                   help="throughput/prefix: tokens every prompt shares before its own input-len (prefix: 1024)")
    w.add_argument("--unshared-prompts", type=int, default=None,
                   help="throughput/prefix: of the --num-prompts, how many have a prefix of their own (same "
                   "length) instead of the shared one: requests beside the group (default: 0)")
    w.add_argument("--request-rates", default=None,
                   help="serving: comma-separated requests/s, Poisson arrivals; inf: all at once "
                   "(default: inf)")
    w.add_argument("--max-concurrency", type=int, default=None, help="serving: most requests in flight")
    w.add_argument("--url", default=None, help="serving: a running `fastllm serve` (default: start one with the "
                   "engine arguments below)")
    w.add_argument("--served-model-name", default=None,
                   help="serving: the model name the server answers to (a server started here is given it)")
    w.add_argument("--api-key", default=None,
                   help="serving: the Bearer key the requests send (default: $FASTLLM_API_KEY); a server "
                   "started here is given it")
    w.add_argument("--client-processes", type=int, default=None,
                   help="serving: processes sending the requests (each its own event loop)")
    w.add_argument("--no-offline", action="store_true", help="serving: skip the offline engine's run on the "
                   "same workload (skipped anyway with --url)")
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
    t.add_argument("--profile-steps", type=int, default=None, help="decode steps in the trace (default: 5)")
    t.add_argument("--nvtx", action="store_true", help="NVTX ranges on (engine phases) for Nsight Systems")
    t.add_argument("--nvtx-layers", action="store_true", help="NVTX ranges per decoder layer too (implies --nvtx)")
    add_engine_args(p, dict.fromkeys(SERVING_DEFAULTS))  # (None: the mode's, fill_engine_defaults)
    p.set_defaults(func=cmd_bench, fill_defaults=fill_engine_defaults)

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


def execution(engine) -> str:
    runner = engine.worker.runner
    if getattr(runner, "graphs", None) is not None:
        mixed = getattr(runner, "mixed_graphs", None)
        return f"compiled + CUDA graphs up to batch {runner.graphs.max_bs}" \
            + (f" (mixed steps up to {mixed.max_tokens} tokens)" if mixed is not None else "")
    if getattr(runner, "compile_seconds", 0):
        return "compiled"
    return "eager"


def fill_engine_defaults(args: argparse.Namespace) -> None:
    """The engine arguments left unset (SERVING_DEFAULTS'): serve's in serving mode, which measures `fastllm
    serve`, else the library's."""
    library = {f.name: f.default for f in engine_fields()}
    for name, serving in SERVING_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, serving if args.mode == "serving" else library[name])


def check_args(args: argparse.Namespace) -> None:
    """Reject flags the mode would not read, fill the mode's defaults and reject bad values (ValueError: one
    line, exit code 2)."""
    for name, modes in FLAG_MODES.items():
        value = getattr(args, name)
        given = value is not None if name in _TRI_STATE else value not in (None, False)
        if given and args.mode not in modes:
            raise ValueError(f"--{name.replace('_', '-')} is for `fastllm bench {' / '.join(modes)}`, "
                             f"not {args.mode}")
    for name in ("profile_batch_size", "profile_steps"):
        if getattr(args, name) is not None and not args.profile:
            raise ValueError(f"--{name.replace('_', '-')} sets what --profile traces: give --profile DIR too")
    if args.no_ceilings and (args.ceilings_from or args.ceilings_out):
        raise ValueError("--no-ceilings and --ceilings-from / --ceilings-out do not combine")
    for name, default in FLAG_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    fill_engine_defaults(args)
    if args.url:  # (serving: the server is running already, configured by whoever started it)
        for name in engine_args_set(args):
            if name not in URL_WORKLOAD_ARGS:
                raise ValueError(f"--{name.replace('_', '-')} configures the server `fastllm bench serving` "
                                 f"starts; with --url it is running already")
    input_len, output_len, prefix_len = DEFAULTS[args.mode]
    args.input_len = input_len if args.input_len is None else args.input_len
    args.output_len = output_len if args.output_len is None else args.output_len
    args.shared_prefix_len = prefix_len if args.shared_prefix_len is None else args.shared_prefix_len
    args.batch_sizes = parse_batch_sizes(args.batch_sizes)  # (read in latency only)
    if args.mode == "startup":
        return
    for name in ("input_len", "output_len", "num_prompts", "profile_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len must be >= 0, got {args.shared_prefix_len}")
    if args.profile_batch_size is not None and args.profile_batch_size < 1:
        raise ValueError(f"--profile-batch-size must be >= 1, got {args.profile_batch_size}")
    if args.client_processes < 1:
        raise ValueError(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (leave it out for no limit), "
                         f"got {args.max_concurrency}")
    if args.url and not (urlsplit(args.url).scheme == "http" and urlsplit(args.url).hostname):
        raise ValueError(f"--url must be an http:// address (the requests go over plain HTTP), "
                         f"got {args.url!r}")
    if args.dataset and args.shared_prefix_len:
        raise ValueError("--dataset and --shared-prefix-len do not combine")
    if args.unshared_prompts and not args.shared_prefix_len:
        raise ValueError("--unshared-prompts needs a --shared-prefix-len (a prefix to be beside)")
    if not 0 <= args.unshared_prompts <= args.num_prompts:
        raise ValueError(f"--unshared-prompts must be in [0, --num-prompts], got {args.unshared_prompts}")
    for name in ("output_json", "output_csv", "plot", "ceilings_out"):  # (written after the whole run)
        directory = Path(getattr(args, name) or ".").parent
        if not directory.is_dir():
            raise ValueError(f"--{name.replace('_', '-')}: no directory {str(directory)!r} to write into")


def check_batch_sizes(args: argparse.Namespace, max_num_seqs: int) -> None:
    too_big = [b for b in args.batch_sizes + [args.profile_batch_size or 1] if b > max_num_seqs]
    if too_big:
        raise ValueError(f"batch size {max(too_big)} exceeds --max-num-seqs {max_num_seqs}")


def cmd_bench(args: argparse.Namespace) -> int:
    """Check the arguments, build the engine, run the mode, then the table, files, plot and profile."""
    from fastllm.bench.runner import build_config, check_lengths
    from fastllm.engine.llm_engine import LLMEngine
    from fastllm.entrypoints.process_setup import prepare_gc_for_serving
    from fastllm.tracing import enable_nvtx
    from fastllm.worker.worker import select_device

    check_args(args)
    if args.nvtx or args.nvtx_layers:
        enable_nvtx(layers=args.nvtx_layers)
    config = build_config(args.model, engine_kwargs(args))
    if args.mode != "startup" and not args.dataset:
        check_lengths(config, args.shared_prefix_len + args.input_len, args.output_len)
    dataset = None
    if args.dataset:
        from fastllm.bench.throughput import load_dataset

        dataset = load_dataset(args.dataset, args.num_prompts)
    if args.mode == "serving":
        return cmd_serving(args, config)
    device = select_device(config, 0)
    config = config.for_device(device)  # max_num_seqs decided for the device, before anything loads
    if args.mode == "latency":
        check_batch_sizes(args, config.scheduler.max_num_seqs)
    ceilings = bench_ceilings(args, device)
    engine = LLMEngine(config)
    prepare_gc_for_serving()
    result, shape = new_result(args, engine, device, ceilings)
    profile_at = run_mode(args, engine, result, shape, dataset)
    finish(args, engine, result, profile_at)
    return 0


def bench_ceilings(args: argparse.Namespace, device) -> dict | None:
    """The GPU's copy bandwidth and matmul rate: measured, read from --ceilings-from, or none (CPU)."""
    from fastllm.bench import ceilings as ceil

    ceilings = None
    if args.ceilings_from:
        ceilings = {**ceil.load_ceilings(args.ceilings_from, device), "source": args.ceilings_from}
    elif device.type == "cuda" and not args.no_ceilings and args.mode != "startup":
        ceilings = {**ceil.measure_ceilings(device), "source": "measured"}
    if args.ceilings_out:  # (check_args refuses it with --no-ceilings)
        if ceilings is None:
            raise ValueError(f"--ceilings-out: the {device.type} has no ceilings to measure or write")
        ceil.save_ceilings(ceilings, args.ceilings_out)
    return ceilings


def new_result(args: argparse.Namespace, engine, device, ceilings: dict | None):
    """The run's record before its rows (the stamp, the engine's startup, the model), and the model's shape."""
    from fastllm.bench import ceilings as ceil
    from fastllm.bench.roofline import ModelShape
    from fastllm.bench.runner import startup_breakdown

    config = engine.config
    dtype = str(engine.worker.runner.dtype).replace("torch.", "")
    shape = ModelShape.from_hf_config(config.model.hf_config, dtype, engine.worker.runner.model.args.fp8)
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
        "engine_args": engine_kwargs(args), "max_model_len": config.model.max_model_len,
        "execution": execution(engine),
        "nvtx": args.nvtx or args.nvtx_layers,
        "args": {k: v for k, v in vars(args).items() if not callable(v)},
    }
    return {"benchmark": args.mode, "meta": meta, "ceilings": ceilings, "startup": startup_breakdown(engine),
            "model": shape.summary(), "rows": []}, shape


def save(args: argparse.Namespace, result: dict) -> None:
    from fastllm.bench import report

    if args.output_json:
        report.write_json(result, args.output_json)
    if args.output_csv:
        report.write_csv(result, args.output_csv)


def run_mode(args: argparse.Namespace, engine, result: dict, shape, dataset) -> dict:
    """Run the mode's measurements, printing and saving each row as it comes; returns the batch size, prompt
    length and shared prefix a --profile trace would use (profile_decode's keywords)."""
    from fastllm.bench import report

    print(report.header(result), flush=True)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    config = engine.config

    def on_row(row: dict) -> None:
        result["rows"].append(row)
        print(report.row_line(args.mode, row), flush=True)
        save(args, result)

    if args.mode == "latency":
        from fastllm.bench.latency import run_latency

        run_latency(engine, args.batch_sizes, args.input_len, args.output_len, result["ceilings"], shape,
                    seed=config.model.seed, matmul_floor=args.matmul_floor, progress=progress, on_row=on_row)
        return dict(batch_size=args.profile_batch_size or max(args.batch_sizes), input_len=args.input_len)
    if args.mode in ("throughput", "prefix"):
        from fastllm.bench.throughput import make_prompts, run_prefix, run_throughput

        unshared = args.unshared_prompts
        prompts = dataset or make_prompts(engine, args.num_prompts, args.input_len, args.shared_prefix_len,
                                          seed=config.model.seed, unshared=unshared)
        if args.mode == "prefix":  # with cascade attention as configured, then off: both rows
            for row in run_prefix(engine, prompts, args.output_len, args.shared_prefix_len, progress,
                                  warmup_len=min(args.input_len, 512), unshared=unshared):
                on_row(row)
            print(report.cascade_summary(result["rows"]), flush=True)
        else:
            on_row(run_throughput(engine, prompts, args.output_len, args.shared_prefix_len, progress,
                                  warmup_len=min(args.input_len, 512), unshared=unshared))
        batch = args.profile_batch_size or min(args.num_prompts, config.scheduler.max_num_seqs)
        return dict(batch_size=batch, input_len=args.shared_prefix_len + args.input_len,
                    shared_prefix_len=args.shared_prefix_len, unshared=min(unshared, batch))
    return dict(batch_size=args.profile_batch_size or 1, input_len=args.input_len)


def finish(args: argparse.Namespace, engine, result: dict, profile_at: dict) -> None:
    """The table, the files, the plot and the --profile trace."""
    import torch

    from fastllm.bench import report

    print(report.table(result), flush=True)
    save(args, result)
    if args.plot:  # (latency's only: check_args)
        report.plot_latency(result, args.plot)
    if args.profile and args.mode != "startup":
        from fastllm.bench.profile import print_profile, profile_decode

        print_profile(profile_decode(engine, out_dir=args.profile, steps=args.profile_steps,
                                     layers=args.nvtx_layers, **profile_at))
    if engine.worker.device.type == "cuda":
        torch.cuda.synchronize(engine.worker.device)
    engine.shutdown()


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rates must be comma-separated numbers > 0 (or inf), got {text!r}")
    return rates


def engine_args_set(args: argparse.Namespace) -> list[str]:
    """The engine arguments (speculative flags too) this run sets away from `fastllm serve`'s defaults."""
    names = [f.name for f in engine_fields()
             if getattr(args, f.name) != SERVING_DEFAULTS.get(f.name, f.default)]
    return names + [name for name in SPECULATIVE_FLAGS if getattr(args, name) is not None]


# The engine arguments a serving run against --url still reads: the workload's (the model's vocabulary and
# name, the prompts' seed: they are token ids, no tokenizer) and its length check.
URL_WORKLOAD_ARGS = ("model", "seed", "max_model_len")


def serve_args(args: argparse.Namespace) -> list[str]:
    """The `fastllm serve` flags that give the server this run's engine arguments (those not at serve's
    default), and no access log."""
    out = []
    for name in engine_args_set(args):
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    if args.served_model_name:  # (the API key goes by the environment: not into the results' engine_args)
        out += ["--served-model-name", args.served_model_name]
    return out + ["--uvicorn-log-level", "warning"]  # (no access-log line per request either)


def cmd_serving(args: argparse.Namespace, config) -> int:
    """Requests at each rate to a `fastllm serve` (started here unless --url), one row per rate; then,
    once the server is gone, the offline engine on the same workload (unless --no-offline)."""
    import socket

    import numpy as np

    from fastllm.bench import ceilings as ceil
    from fastllm.bench import report, serving
    from fastllm.bench.runner import random_prompts
    from fastllm.entrypoints.openai.server import resolve_api_key, served_name
    from fastllm.worker.worker import select_device

    rates = parse_rates(args.request_rates)
    offline = not args.no_offline and not args.url  # a server of someone else's holds the GPU
    model_name = args.served_model_name or served_name(args.model)
    api_key = resolve_api_key(args.api_key)  # what the requests send, and a server started here wants
    vocab = config.model.hf_config["vocab_size"]
    device = select_device(config, 0)
    if not args.url:  # (the server started here checks them too, in its own process)
        config.check_device_args(device.type)
    meta = {**ceil.environment(device), "model": model_name,
            "model_path": config.model.model,
            "dtype": config.model.dtype, "load_format": config.model.load_format, "mode": "serving",
            "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
            "request_rates": rates, "url": args.url, "engine_args": serve_args(args),
            "client_processes": args.client_processes,
            "execution": "fastllm serve, streamed /v1/completions"}
    result = {"benchmark": "serving", "meta": meta, "ceilings": None, "startup": None, "rows": []}
    # Each rate its own prompts (no prefix-cache hits across rates); the offline run takes the last rate's.
    prompts = [random_prompts(np.random.default_rng(config.model.seed + i), args.num_prompts, args.input_len,
                              vocab) for i in range(len(rates))]

    def save() -> None:
        if args.output_json:
            report.write_json(result, args.output_json)

    def run(url: str) -> None:
        print(report.header(result), flush=True)
        warm = random_prompts(np.random.default_rng(12345), min(args.num_prompts, 64), args.input_len, vocab)
        serving.warm_up(url, model_name, warm, args.client_processes, api_key)
        for i, rate in enumerate(rates):
            row = serving.serving_row(url, model_name, prompts[i], args.output_len, rate,
                                      config.model.seed + i, args.max_concurrency, args.client_processes,
                                      api_key)
            result["rows"].append(row)
            print(report.row_line("serving", row), flush=True)
            save()

    if args.url:
        run(args.url.rstrip("/"))
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with serving.ServerProcess(serve_args(args), port, api_key) as server:
            run(server.url)
    if offline:
        batches = [round(r["engine_mean_batch"]) for r in result["rows"]
                   if r.get("engine_mean_batch") and r["request_rate"] != "inf"]
        progress = sys.stderr.isatty() if args.progress is None else args.progress
        reference = serving.offline_reference(config, prompts[-1], args.output_len, batches, progress)
        meta["offline"] = reference
        result["rows"] = [serving.compare_with_offline(r, reference) for r in result["rows"]]
        print(f"offline engine, same workload: {reference['output_tok_s']:.1f} out tok/s, "
              f"{reference['requests_s']:.2f} req/s; {reference['run_steps']} steps, batch "
              f"{reference['run_mean_batch']:.1f}, step {reference['run_step_ms']:.2f} ms (host "
              f"{reference['run_host_ms']:.2f}, cpu {reference['run_cpu_ms']:.2f})", flush=True)
    print(report.table(result), flush=True)
    save()
    if args.output_csv:
        report.write_csv(result, args.output_csv)
    return 0
