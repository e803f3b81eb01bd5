"""The `fastllm` command: generate | bench | serve. Argument parsing only; the work is elsewhere."""

from __future__ import annotations

import argparse
import logging
import sys

ENGINE_ARGS = {
    # flag: (type, default, help)
    "dtype": (str, "auto", "auto | float32 | float16 | bfloat16"),
    "load_format": (str, "auto", "auto | safetensors | dummy (random weights of the config)"),
    "max_model_len": (int, None, "context length (default: the model's)"),
    "block_size": (int, 16, "tokens per KV block"),
    "gpu_memory_utilization": (float, 0.9, "fraction of GPU memory the engine may use"),
    "max_num_seqs": (int, None, "most requests in one step (default: 512 on GPUs of 70 GiB or more, else 256)"),
    "max_num_batched_tokens": (int, 8192, "token budget of one step"),
    "num_gpu_blocks": (int, None, "KV blocks (overrides the profiling run)"),
    "preemption_mode": (str, "recompute", "recompute | swap"),
    "seed": (int, 0, "seed for dummy weights and unseeded sampling"),
    "device": (str, "auto", "auto | cpu | cuda"),
    "speculative_model": (str, None, "draft model for speculative decoding (a directory or embedded name, "
                          "e.g. llama2xs-279K for the default model)"),
    "num_speculative_tokens": (int, 0, "draft tokens per step (default 4 with --speculative-model)"),
    "tensor_parallel_size": (int, 1, "GPUs each layer is split over (one worker process each; under "
                             "torchrun, the ranks torchrun started)"),
    "pipeline_parallel_size": (int, 1, "pipeline stages the layers are split into, of "
                               "--tensor-parallel-size GPUs each"),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model directory or embedded config name "
                        "(default: the embedded TinyStories stories260K)")
    for name, (kind, default, help_text) in ENGINE_ARGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=help_text)
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    parser.add_argument("--no-cascade-attention", action="store_true",
                        help="read shared prefixes once per request (default: once per group where it pays)")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile, no CUDA graphs")


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {name: getattr(args, name) for name in ENGINE_ARGS}
    kwargs["enable_prefix_caching"] = not args.no_prefix_caching
    kwargs["cascade_attention"] = False if args.no_cascade_attention else None
    kwargs["enforce_eager"] = args.enforce_eager
    return kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    from fastllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    outputs = llm.generate(args.prompts or ["Once upon a time"], params, use_tqdm=False)
    for output in outputs:
        print((output.prompt or "") + output.outputs[0].text)
        print()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from fastllm.entrypoints.openai.server import run_server

    run_server(engine_kwargs(args), args.model, args.host, args.port, args.served_model_name, args.chat_template)
    return 0


def main(argv: list[str] | None = None) -> int:
    from fastllm.cache import keep_bytecode

    bytecode_prefix = keep_bytecode()  # before anything imports torch
    parser = argparse.ArgumentParser(prog="fastllm", description="fastllm: an LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from prompts")
    gen.add_argument("prompts", nargs="*", help='prompts (default: "Once upon a time")')
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("-v", "--verbose", action="store_true")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    from fastllm.entrypoints.bench import add_bench_parser
    add_bench_parser(sub)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: the "
                       "model directory's name)")
    serve.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one "
                       "(default: the tokenizer's)")
    serve.add_argument("-v", "--verbose", action="store_true")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if bytecode_prefix:
        logging.getLogger("fastllm").info("PYTHONDONTWRITEBYTECODE is set: Python's bytecode is kept under "
                                          "%s (FASTLLM_BYTECODE_CACHE=0 leaves it off)", bytecode_prefix)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"fastllm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
