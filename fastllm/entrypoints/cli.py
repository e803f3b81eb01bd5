"""The `fastllm` command: generate | serve | bench. Argument parsing only; the work is elsewhere.

Every engine argument is a flag of every command, built from the config dataclasses' fields (name,
type, default, help text and choices: fastllm/config.py), so a new config field is a flag everywhere
and no default is written twice. Errors from the library are reworded into flags (cli_language).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
import typing

from fastllm.config import (
    SERVING_DEFAULTS,
    CacheConfig,
    CompileConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, CompileConfig, EngineConfig)
# Speculative decoding's engine arguments, which build a SpeculativeConfig (EngineConfig.from_kwargs): vLLM's
# speculative_config, whose keys are SpeculativeConfig's fields, and two shorthands. None: not given.
SPECULATIVE_FLAGS = {
    "speculative_config": (str, "speculative decoding as JSON (vLLM's speculative_config), with the keys {keys}: "
                                "e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": 3}}'"),
    "speculative_model": (str, "draft model sharing the target's vocabulary, e.g. llama2xs-279K (shorthand for "
                               "speculative_config's model)"),
    "num_speculative_tokens": (int, "draft tokens a step (shorthand; 4 when a method or model is given)"),
}

# generate's sampling flags: name -> (help, the command's own default where SamplingParams' does not fit a CLI)
SAMPLING_FLAGS = {
    "max_tokens": ("tokens to generate per prompt", 256),
    "temperature": ("0 is greedy", 0.0),
    "top_p": ("nucleus sampling: the smallest set of tokens whose probability reaches it", None),
    "top_k": ("sample from the k likeliest tokens (0: all)", None),
    "min_p": ("drop tokens less likely than min_p times the likeliest", None),
    "repetition_penalty": ("divides positive / multiplies negative logits of seen tokens", None),
    "presence_penalty": ("subtracted once from the logit of every generated token", None),
    "frequency_penalty": ("subtracted from a generated token's logit per occurrence", None),
    "min_tokens": ("tokens generated before EOS may end the output", None),
    "ignore_eos": ("keep generating after EOS", None),
}


def engine_fields() -> list[dataclasses.Field]:
    """The config fields that are engine arguments (those with help text), in config order."""
    return [f for config in ENGINE_CONFIGS for f in dataclasses.fields(config) if f.metadata.get("help")]


def speculative_keys() -> list[str]:
    """The keys --speculative-config takes (synthetic_acceptance_rate is for benchmarks only)."""
    return [f.name for f in dataclasses.fields(SpeculativeConfig) if f.name != "synthetic_acceptance_rate"]


def _field_type(config: type, field: dataclasses.Field):
    """The type a flag parses: the field's, without None."""
    hint = typing.get_type_hints(config)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and typing.get_origin(hint) is not tuple else hint


def int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 1 (a flag's type)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {text!r}")
    return values


def _help(text: str, default) -> str:
    text = text.replace("%", "%%")
    return text if "(default" in text else f"{text} (default: {default})"


def add_engine_args(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """One flag per engine argument, with its default shown in --help; defaults: the command's own, by name
    (config.SERVING_DEFAULTS; their help text names them)."""
    group = parser.add_argument_group("engine arguments (keywords of LLM(...))")
    for config in ENGINE_CONFIGS:
        for field in (f for f in dataclasses.fields(config) if f.metadata.get("help")):
            flag, kind = "--" + field.name.replace("_", "-"), _field_type(config, field)
            default = (defaults or {}).get(field.name, field.default)
            help_text = _help(field.metadata["help"], default)
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            else:
                parse = int_list if typing.get_origin(kind) is tuple else kind
                group.add_argument(flag, type=parse, default=default, help=help_text,
                                   choices=field.metadata.get("choices"))
    for name, (kind, help_text) in SPECULATIVE_FLAGS.items():
        help_text = help_text.format(keys=", ".join(speculative_keys()))
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=_help(help_text, "none"))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments of parsed flags (model apart: LLM(model, **kwargs))."""
    kwargs = {f.name: getattr(args, f.name) for f in engine_fields() if f.name != "model"}
    return {**kwargs, **{name: getattr(args, name) for name in SPECULATIVE_FLAGS}}


def sampling_defaults() -> dict:
    """Each sampling flag's default: SAMPLING_FLAGS' where it sets one, else SamplingParams'."""
    from fastllm.sampling_params import SamplingParams

    library = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    return {name: library[name] if default is None else default
            for name, (_, default) in SAMPLING_FLAGS.items()}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    for name, default in sampling_defaults().items():
        help_text = SAMPLING_FLAGS[name][0]
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=_help(help_text, default))
        else:
            group.add_argument(flag, type=type(default), default=default, help=_help(help_text, default))
    group.add_argument("--sampling-seed", type=int, default=None, help=_help("seed of the random draws", None))
    group.add_argument("--beam-width", type=int, default=None,
                       help="beam search with this many beams instead of sampling (prints the best beam)")
    group.add_argument("--length-penalty", type=float, default=None,
                       help=_help("beam search: scores are logprob sums / length ** length_penalty", 1.0))


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return {**{name: getattr(args, name) for name in SAMPLING_FLAGS}, "seed": args.sampling_seed}


BEAM_SEARCH_FLAGS = ("max_tokens", "ignore_eos", "temperature")  # the sampling flags BeamSearchParams has
DRAWS = ("top_p", "top_k", "min_p")  # what shapes sampling's draws: nothing under greedy decoding


def check_generate_flags(args: argparse.Namespace, params) -> None:
    """Refuse the flags that would change nothing, before the model loads: sampling's under beam search,
    --length-penalty without it, and the draws' settings (and their seed) under greedy decoding (params: the
    SamplingParams or BeamSearchParams the flags made)."""
    changed = [name for name, default in sampling_defaults().items() if getattr(args, name) != default]
    changed += ["sampling_seed"] if args.sampling_seed is not None else []
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    if args.beam_width is not None:  # (BeamSearchParams)
        for name in changed:
            if name not in BEAM_SEARCH_FLAGS:
                raise ValueError(f"{flag(name)} does not apply to beam search: --beam-width takes "
                                 f"--max-tokens, --ignore-eos and --length-penalty")
        return
    if args.length_penalty is not None:
        raise ValueError("--length-penalty scores beam search's beams: give --beam-width too")
    if not args.beam_run_ahead:
        raise ValueError("--no-beam-run-ahead changes how beam searches run: give --beam-width too")
    if params.greedy:
        for name in changed:
            if name in (*DRAWS, "sampling_seed"):
                raise ValueError(f"{flag(name)} does nothing under greedy decoding (--temperature "
                                 f"{args.temperature:g})")


def cli_language(message: str, names: typing.Iterable[str]) -> str:
    """A library error in the command line's words: load_format="dummy" -> --load-format dummy,
    max_model_len -> --max-model-len, SamplingParams.top_p -> --top-p (BeamSearchParams' too). A one-word
    name (model, dtype) is only a flag where it starts the message or is given a value, not in prose."""
    if "sampling_seed" in names:  # (the command's --seed is the engine's; SamplingParams' is --sampling-seed)
        message = message.replace("SamplingParams.seed", "SamplingParams.sampling_seed")
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    pattern = re.compile(rf"(^|\b(?:SamplingParams|BeamSearchParams)\.|\b)({alternatives})\b"
                         rf"(=(['\"]?)([^'\"\s,;)]*)\4)?")

    def flag(m: re.Match) -> str:
        lead, name, assigned, value = m.group(1), m.group(2), m.group(3), m.group(5)
        if "_" not in name and not assigned and m.start() > 0 and not lead.endswith("Params."):
            return m.group(0)
        text = "--" + name.replace("_", "-")
        return text + (f" {value}" if assigned else "")

    return pattern.sub(flag, message)


def flag_names(parser: argparse.ArgumentParser) -> set[str]:
    """The dests of a parser's --flags (and its subcommands'), for cli_language."""
    names = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names |= flag_names(sub)
        elif any(s.startswith("--") for s in action.option_strings):
            names.add(action.dest)
    return names


def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated token ids, got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from fastllm import LLM, BeamSearchParams, SamplingParams
    from fastllm.entrypoints.process_setup import prepare_gc_for_serving

    if args.beam_width is not None:  # (each checks its values before the model loads)
        params = BeamSearchParams(args.beam_width, args.max_tokens, ignore_eos=args.ignore_eos,
                                  temperature=args.temperature,
                                  length_penalty=1.0 if args.length_penalty is None else args.length_penalty)
    else:
        params = SamplingParams(**sampling_kwargs(args))
    check_generate_flags(args, params)
    llm = LLM(args.model, **engine_kwargs(args))
    prepare_gc_for_serving()
    tokenizer = llm.get_tokenizer()
    if tokenizer is None and args.prompts:
        raise ValueError("this model has no tokenizer: give the prompts as token ids (--prompt-token-ids 1,2,3; "
                         "repeat the flag for more prompts)")
    prompts = args.prompts + [{"prompt_token_ids": ids} for ids in args.prompt_token_ids or []]
    if not prompts:
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: prompt it with --prompt-token-ids 1,2,3")
        prompts = ["Once upon a time"]
    if isinstance(params, BeamSearchParams):
        for out in llm.beam_search(prompts, params):
            best = out.sequences[0]
            print(best.text if best.text is not None else best.tokens, end="\n\n")
        return 0
    for out in llm.generate(prompts, params, use_tqdm=False):
        if tokenizer is None:
            print(out.prompt_token_ids + out.outputs[0].token_ids, end="\n\n")
        else:
            print((out.prompt or "") + out.outputs[0].text, end="\n\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from fastllm.entrypoints.openai.limits import ServerLimits
    from fastllm.entrypoints.openai.server import run_server

    limits = ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})
    if not 0 <= args.port <= 65535:  # (uvicorn took 70000 and said it ran there, where no socket binds)
        raise ValueError(f"--port must be in [0, 65535] (0: any free port), got {args.port}")
    if args.disable_log_requests and args.uvicorn_log_level not in ("info", "debug"):  # (access lines: info)
        raise ValueError(f"--disable-log-requests: --uvicorn-log-level {args.uvicorn_log_level} shows no "
                         "access-log lines already")
    return run_server(engine_kwargs(args), args.model, args.host, args.port, args.served_model_name,
                      args.chat_template, args.api_key, limits, log_requests=not args.disable_log_requests,
                      uvicorn_log_level=args.uvicorn_log_level, shutdown_timeout=args.shutdown_timeout)


def add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from prompts",
                         description="Generate text from prompts, greedy unless --temperature says otherwise.")
    gen.add_argument("prompts", nargs="*", help='prompts (default: "Once upon a time")')
    gen.add_argument("--prompt-token-ids", action="append", type=token_ids, metavar="IDS",
                     help="a prompt as comma-separated token ids, for models without a tokenizer (repeatable)")
    gen.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def add_serve_parser(sub) -> None:
    from dataclasses import fields

    from fastllm.entrypoints.openai.limits import API_KEY_ENV, SHUTDOWN_TIMEOUT_S, ServerLimits
    from fastllm.entrypoints.openai.limits import HELP as LIMITS_HELP

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                           description="An OpenAI-compatible HTTP server for one model.")
    serve.add_argument("--host", default="127.0.0.1", help=_help("address to listen on", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=8000, help=_help("port to listen on", 8000))
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: the "
                       "model directory's name)")
    serve.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one "
                       "(default: the tokenizer's)")
    serve.add_argument("--api-key", default=None, help="require this key as a Bearer token on /v1/* "
                       f"(default: ${API_KEY_ENV}; none: open)")
    for limit in fields(ServerLimits):
        serve.add_argument("--" + limit.name.replace("_", "-"), type=int, default=limit.default,
                           help=_help(LIMITS_HELP[limit.name], limit.default))
    serve.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                       help=_help("on SIGTERM or Ctrl-C, seconds open requests may run on before "
                                  "they are ended with a 503", SHUTDOWN_TIMEOUT_S))
    serve.add_argument("--disable-log-requests", action="store_true", help="no access-log line per request")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's log level")
    serve.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    add_engine_args(serve, SERVING_DEFAULTS)
    serve.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    from fastllm.entrypoints.bench import add_bench_parser

    parser = argparse.ArgumentParser(prog="fastllm", description="fastllm: an LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from fastllm.compile_cache import keep_bytecode

    bytecode_prefix = keep_bytecode()  # before anything imports torch
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "fill_defaults"):  # a command whose defaults depend on its other flags (bench's mode)
        args.fill_defaults(args)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if bytecode_prefix:
        logging.getLogger("fastllm").info("PYTHONDONTWRITEBYTECODE is set: Python's bytecode is kept under "
                                          "%s (FASTLLM_BYTECODE_CACHE=0 leaves it off)", bytecode_prefix)
    try:
        from fastllm.entrypoints.process_setup import read_gc_threshold, set_cpu_threads

        read_gc_threshold()  # a malformed FASTLLM_GC_THRESHOLD fails before anything loads
        set_cpu_threads(EngineConfig.from_kwargs(args.model, **engine_kwargs(args)))
        return args.func(args)
    except ValueError as e:
        print(f"fastllm {args.command}: error: {cli_language(str(e), flag_names(parser))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
