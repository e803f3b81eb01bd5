"""The `fastllm` command: every engine argument is a flag of every command with the config's default,
values reach the EngineConfig, errors are worded as flags, tokenizer-less models take token ids,
and the help pages say what users need."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import socket

import pytest

from fastllm import LLM
from fastllm.config import SERVING_DEFAULTS, EngineConfig
from fastllm.entrypoints.cli import ENGINE_CONFIGS, build_parser, engine_fields, engine_kwargs, main
from tests.conftest import STORIES

COMMANDS = ["generate", "serve", "bench"]
NOT_ARGUMENTS = {"hf_config", "model", "cache", "scheduler", "parallel", "compile", "speculative"}


def subparser(command: str):
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return parser, action.choices[command]


def parse(command: str, *argv: str) -> argparse.Namespace:
    """A command's flags as it reads them (bench fills its mode's defaults first, as cmd_bench does)."""
    from fastllm.entrypoints.bench import check_args

    args = build_parser().parse_args([command, *argv])
    if command == "bench":
        check_args(args)
    return args


def test_every_config_field_is_an_engine_argument():
    """A new config field without help text (so without a flag) fails here."""
    names = {f.name for c in ENGINE_CONFIGS for f in dataclasses.fields(c)}
    assert {f.name for f in engine_fields()} == names - NOT_ARGUMENTS | {"model"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_argument_is_a_flag_with_its_default(command):
    """The library's default, but serve's (config.SERVING_DEFAULTS, which their help names) for `serve`."""
    _, sub = subparser(command)
    args = parse(command)
    own = SERVING_DEFAULTS if command == "serve" else {}
    page = sub.format_help()
    flags = {s: a for a in sub._actions for s in a.option_strings}
    for field in engine_fields():
        flag = "--" + field.name.replace("_", "-")
        assert getattr(args, field.name) == own.get(field.name, field.default), field.name
        assert flag in flags and f"\n  {flag}" in page, flag
        shown = argparse.HelpFormatter("fastllm")._expand_help(flags[flag])
        assert "(default:" in shown, f"{flag} shows no default"
        if field.default is not None and "(default:" not in field.metadata["help"]:
            assert shown.endswith(f"(default: {field.default})"), flag
    for name, value in SERVING_DEFAULTS.items():
        assert f"serve and bench serving: {value}" in field_help(name)
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    assert config == EngineConfig.from_kwargs(None, **own)  # the flags' defaults are the library's (or serve's)


def field_help(name: str) -> str:
    return next(f.metadata["help"] for f in engine_fields() if f.name == name)


@pytest.mark.parametrize("mode", ["latency", "throughput", "prefix", "startup", "serving"])
def test_bench_takes_serve_defaults_in_serving_mode_only(mode):
    from fastllm.entrypoints.bench import serve_args

    library = {f.name: f.default for f in engine_fields()}
    args = parse("bench", mode)
    for name, value in SERVING_DEFAULTS.items():
        assert getattr(args, name) == (value if mode == "serving" else library[name])
        given = parse("bench", mode, "--" + name.replace("_", "-"), str(library[name]))
        assert getattr(given, name) == library[name]  # given: kept, and passed on to the server
        if mode == "serving":
            assert "--" + name.replace("_", "-") not in serve_args(args)
            assert serve_args(given)[serve_args(given).index("--" + name.replace("_", "-")) + 1] == str(library[name])


@pytest.mark.parametrize("command", COMMANDS)
def test_flag_values_reach_the_engine_config(command):
    args = parse(command, "--block-size", "8", "--no-enable-prefix-caching", "--cuda-graph-sizes", "1,2,4",
                 "--preemption-mode", "swap", "--no-async-scheduling",
                 "--max-num-seqs", "7", "--dtype", "float32", "--gpu-memory-utilization", "0.5")
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    assert config.cache.block_size == 8 and not config.cache.enable_prefix_caching
    assert config.compile.cuda_graph_sizes == (1, 2, 4) and not config.compile.enforce_eager
    eager = parse(command, "--enforce-eager")
    assert EngineConfig.from_kwargs(eager.model, **engine_kwargs(eager)).compile.enforce_eager
    assert config.scheduler.preemption_mode == "swap" and not config.scheduler.async_scheduling
    assert config.scheduler.max_num_seqs == 7 and config.model.dtype == "float32"
    assert config.cache.gpu_memory_utilization == 0.5


def test_sampling_flags_of_generate_show_their_defaults():
    _, sub = subparser("generate")
    flags = {s: a for a in sub._actions for s in a.option_strings}
    for flag, default in (("--max-tokens", 256), ("--temperature", 0.0), ("--top-p", 1.0), ("--top-k", 0),
                          ("--min-p", 0.0), ("--repetition-penalty", 1.0), ("--sampling-seed", None)):
        assert flags[flag].default == default
        assert argparse.HelpFormatter("fastllm")._expand_help(flags[flag]).endswith(f"(default: {default})"), flag


def test_help_lists_every_bench_mode(capsys):
    from fastllm.entrypoints.bench import MODES

    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    bench = capsys.readouterr().out
    for mode in MODES:
        assert mode in top
        assert f"\n  {mode} " in bench  # described, one per line
    assert "examples:" in bench and '"""' not in bench


def test_errors_speak_the_callers_language(capsys, tmp_path):
    model = tmp_path / "no-weights"
    model.mkdir()
    shutil.copy(f"{STORIES}/config.json", model)
    assert main(["generate", "--model", str(model), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--load-format dummy" in err and "load_format" not in err
    with pytest.raises(ValueError, match='load_format="dummy"'):
        LLM(str(model), device="cpu")
    assert main(["generate", "--max-model-len", "100000", "--device", "cpu"]) == 2
    assert "--max-model-len must be in [1, 512]" in capsys.readouterr().err
    assert main(["generate", "--top-p", "2", "--device", "cpu", "--num-gpu-blocks", "64"]) == 2
    assert "--top-p must be" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["--length-penalty", "2"], "--length-penalty"),  # without --beam-width
    (["--beam-width", "2", "--top-k", "5"], "--top-k"),
    (["--beam-width", "2", "--repetition-penalty", "1.2"], "--repetition-penalty"),
    (["--beam-width", "2", "--sampling-seed", "3"], "--sampling-seed"),
    (["--beam-width", "2", "--temperature", "0.5"], "--temperature"),  # (BeamSearchParams': beams are greedy)
    (["--beam-width", "0"], "--beam-width"),  # (was taken for no beam search)
    (["--top-p", "0.5"], "--top-p"),  # greedy, the default temperature
    (["--temperature", "0", "--min-p", "0.2"], "--min-p"),
    (["--sampling-seed", "7"], "--sampling-seed"),
    (["--no-beam-run-ahead"], "--no-beam-run-ahead"),  # without --beam-width
])
def test_generate_refuses_flags_that_would_change_nothing(argv, flag, capsys):
    """Sampling's flags under beam search, --length-penalty without it and the draws' settings under greedy
    decoding are refused by name before the model loads (each was ignored)."""
    assert main(["generate", "Once", "--max-tokens", "2", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "Params." not in err, err


def test_generate_takes_the_flags_its_mode_reads(capsys):
    for argv in (["--beam-width", "2", "--length-penalty", "0.5", "--ignore-eos"],
                 ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--sampling-seed", "1"],
                 ["--repetition-penalty", "1.3", "--min-tokens", "1"]):  # (greedy with penalties: they apply)
        assert main(["generate", "Once", "--max-tokens", "2", "--device", "cpu", "--num-gpu-blocks", "64",
                     *argv]) == 0, argv
        assert capsys.readouterr().out.startswith("Once")


@pytest.mark.parametrize("port", ["-1", "65536", "70000"])
def test_serve_refuses_a_port_out_of_range(port, capsys):
    assert main(["serve", "--port", port, "--device", "cpu"]) == 2
    assert f"--port must be in [0, 65535] (0: any free port), got {port}" in capsys.readouterr().err


@pytest.mark.parametrize("level", ["warning", "error", "critical"])
def test_serve_refuses_disable_log_requests_where_no_access_line_shows(level, capsys):
    """uvicorn logs its access lines at info: below that level the flag would change nothing."""
    assert main(["serve", "--disable-log-requests", "--uvicorn-log-level", level, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"--disable-log-requests: --uvicorn-log-level {level} shows no access-log lines" in err


def test_serve_refuses_a_chat_template_for_a_model_without_a_tokenizer(capsys, tmp_path):
    """It would format messages for a tokenizer that is not there: refused before the engine starts."""
    model = tmp_path / "tiny"
    model.mkdir()
    shutil.copy(f"{STORIES}/config.json", model)
    assert main(["serve", "--model", str(model), "--load-format", "dummy", "--device", "cpu",
                 "--chat-template", "{{ messages }}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--chat-template formats chat messages" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--api-key", ""], "--api-key is empty"),  # (it served with no key)
    (["--chat-template", "/no/such/template.jinja"], "--chat-template is neither a file nor a Jinja"),
    (["--chat-template", "{% if"], "--chat-template does not compile"),  # (every chat request failed)
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization sizes the KV pool"),  # (was: tracebacks)
    (["--host", "256.0.0.1"], "--host 256.0.0.1 is not an address to listen on"),  # (was: exit 3 at bind)
    *[(["--shutdown-timeout", t], f"--shutdown-timeout must be a finite number of seconds >= 0, got {t}")
      for t in ("-1.0", "nan", "inf")],
])
def test_serve_refuses_bad_arguments_before_its_engine_starts(argv, message, capsys):
    assert main(["serve", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_serve_refuses_a_port_in_use_before_its_engine_starts(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"fastllm serve: error: --port {port}: cannot listen on 127.0.0.1:{port} "
                   "(Address already in use)")


def test_serve_reads_a_chat_template_file_and_compiles_it(tmp_path):
    from fastllm.entrypoints.openai.server import read_chat_template

    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages }}") == "{{ messages }}" and read_chat_template(None) is None


@pytest.mark.parametrize("argv, message", [
    (["latency", "--output-json", "/no/such/dir/x.json"], "--output-json: no directory"),  # (after the run)
    (["latency", "--output-csv", "/no/such/dir/x.csv"], "--output-csv: no directory"),
    (["latency", "--plot", "/no/such/dir/x.png"], "--plot: no directory"),
    (["startup", "--no-progress"], "--progress is for"),  # (False was taken for "not given")
    (["latency", "--ceilings-out", "/tmp/ceilings.json"], "--ceilings-out: the cpu has no"),  # (it warned)
    (["serving", "--gpu-memory-utilization", "0.5", "--no-offline"], "--gpu-memory-utilization sizes"),
])
def test_bench_refuses_bad_arguments_before_it_runs(argv, message, capsys):
    small = ["--input-len", "4", "--output-len", "4", "--batch-sizes", "1"] if argv[0] == "latency" else []
    assert main(["bench", *argv, "--device", "cpu", *small]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_errors_name_the_flag_given(capsys):
    """generate's --seed is the engine's; a bad --sampling-seed is named as such. On the CPU the KV pool
    is sized by --cpu-kv-cache-gib, which a pool too small names."""
    assert main(["generate", "--temperature", "1", "--sampling-seed", str(2**70), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--sampling-seed must be" in err and "--seed " not in err, err
    assert main(["generate", "--cpu-kv-cache-gib", "1e-9", "--device", "cpu"]) == 2
    assert "raise --cpu-kv-cache-gib" in capsys.readouterr().err


@pytest.mark.parametrize("spec, field", [
    ({"method": "ngram", "prompt_lookup_min": True}, "prompt_lookup_min"),  # (a bool taken for 1)
    ({"method": "ngram", "prompt_lookup_max": True, "prompt_lookup_min": 1}, "prompt_lookup_max"),
    ({"adaptive": False}, "adaptive"),  # (no method: it did nothing)
    ({"method": None, "adaptive": "no"}, "adaptive"),
])
def test_speculative_config_refuses_values_that_would_do_nothing_or_are_not_ints(spec, field):
    with pytest.raises(ValueError, match=f"speculative_config.{field} "):
        EngineConfig.from_kwargs(None, speculative_config=spec)


def test_a_model_without_a_tokenizer_takes_token_ids(capsys, tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    shutil.copy(f"{STORIES}/config.json", model)
    common = ["generate", "--model", str(model), "--load-format", "dummy", "--device", "cpu", "--max-tokens", "3",
              "--num-gpu-blocks", "64"]
    assert main([*common, "Once upon a time"]) == 2
    assert "--prompt-token-ids 1,2,3" in capsys.readouterr().err
    assert main(common) == 2
    assert "--prompt-token-ids" in capsys.readouterr().err
    assert main([*common, "--prompt-token-ids", "1,5,9", "--prompt-token-ids", "1,7"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert len(lines) == 2 and lines[0].startswith("[1, 5, 9, ") and len(eval(lines[1])) == 2 + 3


def test_generate_prints_text_and_beam_search(capsys):
    assert main(["generate", "Once upon a time", "--max-tokens", "8", "--device", "cpu",
                 "--num-gpu-blocks", "64"]) == 0
    greedy = capsys.readouterr().out.strip()
    assert greedy.startswith("Once upon a time") and len(greedy) > len("Once upon a time")
    assert main(["generate", "Once upon a time", "--max-tokens", "8", "--device", "cpu", "--num-gpu-blocks", "64",
                 "--beam-width", "3"]) == 0
    assert capsys.readouterr().out.strip().startswith("Once upon a time")


@pytest.mark.parametrize("command", COMMANDS)
def test_speculative_decoding_flags(command):
    """SpeculativeConfig's fields are the keys of --speculative-config (its help names each), beside the
    --speculative-model / --num-speculative-tokens shorthands; none is given by default."""
    from fastllm.config import SpeculativeConfig
    from fastllm.entrypoints.cli import SPECULATIVE_FLAGS

    _, sub = subparser(command)
    args = parse(command)
    assert all(getattr(args, name) is None for name in SPECULATIVE_FLAGS)
    flags = {s: a for a in sub._actions for s in a.option_strings}
    shown = argparse.HelpFormatter("fastllm")._expand_help(flags["--speculative-config"])
    keys = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {"synthetic_acceptance_rate"}
    assert all(key in shown for key in keys) and shown.endswith("(default: none)")
    args = parse(command, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    spec = EngineConfig.from_kwargs(args.model, **engine_kwargs(args)).speculative
    assert spec.method == "ngram" and spec.num_speculative_tokens == 3
    args = parse(command, "--speculative-model", "llama2xs-279K", "--num-speculative-tokens", "2")
    spec = EngineConfig.from_kwargs(args.model, **engine_kwargs(args)).speculative
    assert spec.method == "draft_model" and spec.num_speculative_tokens == 2
