"""`fastllm bench` on the CPU with the embedded stories260K (the CI smoke test), its bad-argument
handling, and the roofline math against hand-computed numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fastllm.bench import roofline
from fastllm.bench.roofline import ModelShape
from fastllm.entrypoints.cli import main

SMALL = ["--num-gpu-blocks", "64", "--no-progress"]  # a small KV pool: quick to allocate
LATENCY_COLUMNS = [
    "batch_size", "input_len", "output_len", "ttft_ms", "prefill_tok_s", "tpot_ms_mean", "tpot_ms_p50",
    "tpot_ms_p90", "tpot_ms_p99", "floor_ms", "floor_mode", "host_ms_p50", "host_frac", "tok_s_per_seq", "tok_s_total", "e2e_s",
    "e2e_output_tok_s", "steps", "decode_steps", "bytes_per_step", "flops_per_step", "achieved_gb_s", "bw_frac",
    "achieved_tflops", "tc_frac", "peak_mem_gib", "preemptions", "jit_compiles", "stalled_steps", "stalled_ms",
    "stalled_gc_ms", "spec_acceptance_rate", "spec_mean_accepted_len",
]
THROUGHPUT_COLUMNS = [
    "num_prompts", "input_len_mean", "output_len", "shared_prefix_len", "prefix_caching", "total_s", "requests_s",
    "input_tok_s", "output_tok_s", "total_tok_s", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "prefix_hit_rate",
    "steps", "prefill_steps", "prefill_steps_s", "decode_steps_s", "decode_step_ms_mean", "host_s", "peak_mem_gib",
    "preemptions", "jit_compiles", "spec_acceptance_rate", "spec_mean_accepted_len", "cascade_attention",
    "cascade_steps", "unshared_prompts", "engine_steps", "engine_mean_batch", "engine_step_ms",
    "engine_host_ms", "engine_cpu_ms",
]
STARTUP_KEYS = ["load_s", "compile_s", "cuda_graph_s", "kv_profile_s", "kv_alloc_s", "total_s", "other_s"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Two cores shared with other jobs: OpenMP spinning on both makes each step 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_json(tmp_path, capsys, argv: list[str]) -> tuple[dict, str]:
    out = tmp_path / "run.json"
    # (startup draws no progress bar: --no-progress is refused there)
    small = [a for a in SMALL if a != "--no-progress"] if argv[0] == "startup" else SMALL
    assert main(["bench", *argv, *small, "--output-json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_latency_sweep_table_json_csv_plot(tmp_path, capsys):
    csv, png = tmp_path / "run.csv", tmp_path / "run.png"
    result, stdout = run_json(tmp_path, capsys, ["--batch-sizes", "1,2", "--input-len", "8", "--output-len", "6",
                                                 "--matmul-floor", "--output-csv", str(csv), "--plot", str(png)])
    assert "fastllm bench latency: stories260K" in stdout and "[batch 2]" in stdout
    assert "tpot_ms" in stdout and "n/a" in stdout  # the table, with CPU's missing ceilings
    assert result["ceilings"] is None
    for key in ("device", "torch", "triton", "commit"):
        assert key in result["meta"]
    assert set(STARTUP_KEYS) <= result["startup"].keys()
    assert result["startup"]["compile_s"] is None and result["startup"]["cuda_graph_s"] is None  # eager on CPU
    rows = result["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert result["meta"]["dtype"] == "float32"  # the CPU runs the bfloat16 checkpoint in float32
    shape = ModelShape.from_model(None, "float32")
    for row in rows:
        assert list(row) == LATENCY_COLUMNS
        assert row["bw_frac"] is None and row["tc_frac"] is None and row["peak_mem_gib"] is None
        assert row["decode_steps"] == 5 and row["tpot_ms_mean"] > 0 and row["ttft_ms"] > 0
        assert row["floor_ms"] > 0 and row["floor_mode"] == "eager"
        assert row["host_frac"] == 1.0  # on the CPU nothing is waited for: the whole step is host work
        # decode steps attend over 9..13 tokens (8 prompt + the outputs so far): mean 11 per request
        b = row["batch_size"]
        assert row["bytes_per_step"] == pytest.approx(shape.decode_bytes([11] * b))
        assert row["flops_per_step"] == pytest.approx(shape.decode_flops([11] * b))
        assert row["tok_s_total"] == pytest.approx(b * 1e3 / row["tpot_ms_mean"])
    frame = pd.read_csv(csv)
    assert list(frame.columns[:len(LATENCY_COLUMNS)]) == LATENCY_COLUMNS
    assert {"device", "torch", "commit"} <= set(frame.columns) and len(frame) == 2
    assert frame["bw_frac"].isna().all()
    assert png.stat().st_size > 1000

    assert roofline.main([str(tmp_path / "run.json")]) == 0
    report = capsys.readouterr().out
    assert "no ceilings" in report and "measured_ms" in report


def test_throughput_and_startup(tmp_path, capsys):
    result, stdout = run_json(tmp_path, capsys, ["throughput", "--num-prompts", "4", "--input-len", "8",
                                                 "--output-len", "4"])
    [row] = result["rows"]
    assert list(row) == THROUGHPUT_COLUMNS
    assert row["num_prompts"] == 4 and row["input_len_mean"] == 8 and row["steps"] >= 4
    assert 1 <= row["engine_steps"] <= row["steps"] and 0 < row["engine_host_ms"] <= row["engine_step_ms"]
    assert row["engine_step_ms"] * row["engine_steps"] <= row["total_s"] * 1e3 and row["engine_cpu_ms"] > 0
    assert row["output_tok_s"] == pytest.approx(16 / row["total_s"])
    assert 1 <= row["prefill_steps"] < row["steps"]
    assert 0 < row["host_s"] <= row["prefill_steps_s"] + row["decode_steps_s"] <= row["total_s"]
    assert row["prefix_hit_rate"] == 0.0  # 8-token prompts fill no 16-token block
    assert "req/s" in stdout

    result, stdout = run_json(tmp_path, capsys, ["startup"])
    assert result["rows"] == [] and result["startup"]["total_s"] > 0 and "load_s" in stdout


def test_prefix_sharing_and_profile(tmp_path, capsys):
    trace_dir = tmp_path / "prof"
    result, stdout = run_json(tmp_path, capsys, ["prefix", "--num-prompts", "4", "--shared-prefix-len", "32",
                                                 "--input-len", "8", "--output-len", "4",
                                                 "--profile", str(trace_dir), "--profile-steps", "2"])
    auto, off = result["rows"]  # the same workload with cascade attention as configured, then off
    assert [auto["cascade_attention"], off["cascade_attention"]] == ["auto", "off"]
    assert auto["cascade_steps"] == off["cascade_steps"] == 0  # 4 requests on 32 tokens do not pay
    for row in (auto, off):
        assert row["shared_prefix_len"] == 32 and row["input_len_mean"] == 40
        assert 0 < row["prefix_hit_rate"] and row["decode_step_ms_mean"] > 0
    assert auto["prefix_hit_rate"] <= 0.6  # at most 3 of 4 requests find the 2 prefix blocks
    assert "mean decode step" in stdout and "ms off" in stdout
    [trace] = trace_dir.iterdir()
    assert json.loads(trace.read_text())["traceEvents"]
    assert "top CPU ops" in stdout and "forward" in stdout


def test_prefix_with_unshared_prompts(tmp_path, capsys):
    # one of the four prompts has a 32-token prefix of its own: 3 share the prefix, so at most 2 of 4 find its
    # blocks cached (3 of 4 without the option: test_prefix_sharing_and_profile)
    argv = ["prefix", "--num-prompts", "4", "--shared-prefix-len", "32", "--unshared-prompts", "1",
            "--input-len", "8", "--output-len", "4", "--no-cascade-attention"]
    result, _ = run_json(tmp_path, capsys, argv)
    [row] = result["rows"]
    assert row["unshared_prompts"] == 1 and row["input_len_mean"] == 40
    assert row["prefix_hit_rate"] <= 0.4


def test_prefix_profile_traces_cascade_steps(tmp_path, capsys):
    # the profiled requests share the workload's prefix (the first prefilled alone, the others finding its
    # blocks cached), so with cascade attention on every profiled decode step cascades
    _, stdout = run_json(tmp_path, capsys, ["prefix", "--num-prompts", "4", "--shared-prefix-len", "32",
                                            "--input-len", "8", "--output-len", "4", "--cascade-attention",
                                            "--profile", str(tmp_path / "prof"), "--profile-steps", "2"])
    assert "(2 decode steps, 2 with cascade attention)" in stdout


def test_dataset(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Once upon a time"}\n{"prompt_token_ids": [1, 5, 9]}\n')
    result, _ = run_json(tmp_path, capsys, ["throughput", "--dataset", str(data), "--output-len", "3"])
    assert result["rows"][0]["num_prompts"] == 2


@pytest.mark.parametrize("argv", [
    ["--batch-sizes", "0"],
    ["--batch-sizes", "1,x"],
    ["--model", "no-such-model"],
    ["--input-len", "500", "--output-len", "100"],  # the default model's context is 512
    ["--input-len", "abc"],
    ["--batch-sizes", "300"],  # > --max-num-seqs
    ["--cuda-graph-sizes", "8,-1"],
    ["throughput", "--dataset", "/no/such/file.jsonl"],
    ["serving", "--request-rates", "0"],
    ["serving", "--request-rates", "fast"],
    ["prefix", "--num-prompts", "4", "--unshared-prompts", "5"],
    ["prefix", "--unshared-prompts", "-1"],
    ["throughput", "--unshared-prompts", "1"],  # no shared prefix to be beside
    ["latency", "--shared-prefix-len", "8", "--unshared-prompts", "1"],
    ["serving", "--max-concurrency", "0"],  # (0 was no limit)
    ["serving", "--max-concurrency", "-1"],
    ["serving", "--url", "https://localhost:8000"],  # (the requests are plain HTTP)
    ["serving", "--url", "localhost:8000"],
])
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    try:
        code = main(["bench", *argv])
    except SystemExit as e:  # argparse-level errors
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("fastllm bench: error:"), err


@pytest.mark.parametrize("argv, flag", [
    (["--url", "http://localhost:1"], "--url"),  # latency, the default mode
    (["latency", "--num-prompts", "3"], "--num-prompts"),
    (["latency", "--shared-prefix-len", "8"], "--shared-prefix-len"),
    (["throughput", "--batch-sizes", "4"], "--batch-sizes"),
    (["prefix", "--dataset", "d.jsonl"], "--dataset"),
    (["serving", "--plot", "p.png"], "--plot"),
    (["serving", "--profile", "trace"], "--profile"),
    (["serving", "--nvtx"], "--nvtx"),
    (["startup", "--input-len", "3"], "--input-len"),
    (["throughput", "--profile-steps", "3"], "--profile-steps"),  # without --profile
    (["--no-ceilings", "--ceilings-out", "c.json"], "--no-ceilings"),
    (["startup", "--no-ceilings"], "--no-ceilings"),  # (startup measures no ceilings)
    (["serving", "--url", "http://localhost:1", "--max-num-seqs", "8"], "--max-num-seqs"),  # someone's server
])
def test_a_flag_the_mode_would_not_read_is_an_error(argv, flag, capsys):
    """A flag that does nothing in the mode given (another mode's, or a --profile setting without
    --profile) is refused by name before anything loads, not ignored."""
    code = main(["bench", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and flag in err, err


def test_serving_against_a_started_server(tmp_path, capsys, monkeypatch):
    """`fastllm bench serving` starts `fastllm serve` in a child process (its engine core in another),
    warms it up and streams requests to it from two client processes at two rates: every request
    completes, with its tokens counted and its latencies measured; the engine's mean batch and step time
    come from /metrics; then the offline engine runs the same workload and each row is compared with it.
    The server answers to --served-model-name and wants --api-key (not the environment's key: the
    requests would fail either way)."""
    from fastllm.entrypoints.openai.limits import API_KEY_ENV

    monkeypatch.setenv(API_KEY_ENV, "another-key")
    out = tmp_path / "serving.json"
    argv = ["bench", "serving", "--num-prompts", "6", "--request-rates", "40,inf", "--input-len", "8",
            "--output-len", "6", "--device", "cpu", "--client-processes", "2", "--output-json", str(out),
            "--output-csv", str(tmp_path / "s.csv"), *SMALL,
            "--served-model-name", "tiny-served", "--api-key", "bench-key"]  # both reach the started server
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [row["request_rate"] for row in result["rows"]] == [40.0, "inf"]
    offline = result["meta"]["offline"]
    assert offline["output_tok_s"] > 0
    assert offline["run_steps"] >= 6 and 0 < offline["run_host_ms"] <= offline["run_step_ms"]
    assert 0 < offline["run_cpu_ms"] and 1 <= offline["run_mean_batch"] <= 6
    for row in result["rows"]:
        assert row["completed"] == 6 and row["failed"] == 0, row["first_error"]
        assert row["output_tok_s"] == pytest.approx(6 * 6 / row["wall_s"])
        assert 0 < row["ttft_ms_p50"] <= row["e2e_ms_p99"] and row["tpot_ms_mean"] > 0
        assert row["engine_steps"] >= 6 and 1 <= row["engine_mean_batch"] <= 6 and row["engine_step_ms"] > 0
        assert 0 < row["engine_host_ms"] <= row["engine_step_ms"] and 0 < row["engine_cpu_ms"]
        assert (row["slow_steps"], row["jit_compiles"]) == (0, 0)  # (the CPU server is eager: nothing compiles)
        assert row["vs_offline"] == pytest.approx(row["output_tok_s"] / offline["output_tok_s"])
    finite = result["rows"][0]
    assert finite["offline_step_ms"] == offline["step_ms_at_batch"][str(round(finite["engine_mean_batch"]))]
    assert len(pd.read_csv(tmp_path / "s.csv")) == 2
    assert "bench-key" not in out.read_text()  # (the key went by the environment)
    stdout = capsys.readouterr().out
    assert "fastllm bench serving" in stdout and "offline engine, same workload" in stdout


ROPE = dict(rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling={}, max_position_embeddings=64)  # no bytes or FLOPs


def test_roofline_math_by_hand():
    # vocab 100, hidden 8, intermediate 16, 2 layers, 2 heads, 1 KV head, head_dim 4, untied, bf16
    s = ModelShape(100, 8, 16, 2, 2, 1, 4, **ROPE, tie_word_embeddings=False)
    # per layer: qkv 8x(2+1+1)x4 = 128, o 8x8 = 64, gate_up 8x32 = 256, down 16x8 = 128 -> 576
    assert s.layer_matmul_params == 576
    assert s.matmul_params == 2 * 576 + 800  # + lm_head
    assert s.num_params == 2 * (576 + 16) + 8 + 800 + 800  # + 2 norms/layer, final norm, embedding, lm_head
    assert s.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2
    ctx = [5, 7]
    # weights less the embedding table plus 2 gathered rows, then 12 tokens of KV
    assert s.decode_bytes(ctx) == (2792 - 800 + 2 * 8) * 2 + 32 * 12 == 4400
    assert s.decode_flops(ctx) == 2 * 1952 * 2 + 4 * 2 * 2 * 4 * 12 == 8576
    # prefill of 3 tokens: lm_head on the last only; causal pairs 1 + 2 + 3
    assert s.prefill_flops([3]) == 2 * 1152 * 3 + 2 * 800 + 4 * 2 * 2 * 4 * 6 == 8896
    tied = ModelShape(100, 8, 16, 2, 2, 1, 4, **ROPE, tie_word_embeddings=True)
    assert tied.decode_bytes(ctx) == tied.num_params * 2 + 32 * 12

    f = roofline.floor_seconds(4400, 8576, {"copy_bytes_per_s": 1000.0, "matmul_flops_per_s": 1e4})
    assert f["bound"] == "memory" and math.isclose(f["floor_s"], 4.4) and math.isclose(f["compute_s"], 0.8576)
    assert roofline.floor_seconds(4400, 8576, None)["floor_s"] is None

    run = {"rows": [{"batch_size": 2, "bytes_per_step": 4400, "flops_per_step": 8576, "tpot_ms_mean": 8800.0,
                     "floor_ms": None}]}
    [row] = roofline.report(run, {"copy_bytes_per_s": 1000.0, "matmul_flops_per_s": 1e4}).to_dict("records")
    assert row["roofline_ms"] == pytest.approx(4400) and row["roofline/measured"] == pytest.approx(0.5)


def test_roofline_counts_match_the_models():
    """The standalone math counts exactly the parameters the engine builds, for every embedded config."""
    from fastllm.config import ASSETS
    from fastllm.models.registry import build_model

    for config in sorted((ASSETS / "configs").glob("*/config.json")) + [ASSETS / "stories260K" / "config.json"]:
        cfg = json.loads(config.read_text())
        with torch.device("meta"):
            model = build_model(cfg)
        assert ModelShape.from_hf_config(cfg).num_params == sum(p.numel() for p in model.parameters()), config
    assert ModelShape.from_model("llama-3.1-8b").kv_bytes_per_token == 128 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_ceilings_floor_and_profile(tmp_path, capsys):
    """On a GPU: ceilings measured and reusable, every column filled (but the draft model's), the
    matmul chain as a CUDA graph, kernels in the profile. About a minute (two engine starts); run it
    before long GPU benchmarks."""
    ceilings = tmp_path / "ceilings.json"
    result, stdout = run_json(tmp_path, capsys, ["--batch-sizes", "1,4", "--cuda-graph-sizes", "1,2,4",
                                                 "--input-len", "16", "--output-len", "8",
                                                 "--matmul-floor", "--ceilings-out", str(ceilings),
                                                 "--profile", str(tmp_path / "prof"), "--profile-steps", "2"])
    assert json.loads(ceilings.read_text())["copy_bytes_per_s"] > 1e11
    spec = ["spec_acceptance_rate", "spec_mean_accepted_len"]  # filled only with a draft model
    for row in result["rows"]:
        assert all(row[c] is not None for c in LATENCY_COLUMNS if c not in spec), row
        assert all(row[c] is None for c in spec), row
        assert row["floor_mode"] == "cuda-graph" and 0 < row["bw_frac"] < 1.5
    assert "kernels by device time" in stdout
    result, _ = run_json(tmp_path, capsys, ["--batch-sizes", "2", "--input-len", "16", "--output-len", "4",
                                            "--enforce-eager", "--ceilings-from", str(ceilings)])
    assert result["ceilings"]["source"] == str(ceilings) and result["rows"][0]["bw_frac"] is not None


def test_triton_compile_watch_counts_and_restores_the_hook():
    """The benchmarks count Triton compiles in their timed window through Triton's post-compile hook:
    the watch records each call, hands it on to a hook that was already set, and puts that one back."""
    knobs = getattr(pytest.importorskip("triton"), "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    from fastllm.compile.jit_watch import TritonCompileWatch

    class Fn:
        name = "_some_kernel"

    seen = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: seen.append(kwargs["fn"].name)
    try:
        outer = knobs.runtime.jit_post_compile_hook
        with TritonCompileWatch() as watch:
            knobs.runtime.jit_post_compile_hook(key="k", fn=Fn())
        assert [name for name, _ in watch.compiles] == ["_some_kernel"] and seen == ["_some_kernel"]
        assert knobs.runtime.jit_post_compile_hook is outer
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_throughput_with_a_draft_model_reports_acceptance(tmp_path, capsys):
    result, _ = run_json(tmp_path, capsys, ["throughput", "--num-prompts", "3", "--input-len", "8", "--output-len",
                                            "12", "--speculative-model", "llama2xs-279K",
                                            "--num-speculative-tokens", "3"])
    [row] = result["rows"]
    assert 0 <= row["spec_acceptance_rate"] <= 1 and 1 <= row["spec_mean_accepted_len"] <= 4
    assert row["output_tok_s"] == pytest.approx(36 / row["total_s"])


def _benchmark_script(name: str):
    """benchmarks/<name>.py as a module (name may hold a folder: "kernels/bench_x")."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spec_decode_script():
    return _benchmark_script("bench_spec_decode")


@pytest.mark.parametrize("script, argv, flag", [
    ("bench_parallel", ["throughput", "--batch-sizes", "4", "--tensor-parallel-size", "2"], "--batch-sizes"),
    ("bench_parallel", ["latency", "--num-prompts", "4", "--tensor-parallel-size", "2"], "--num-prompts"),
    ("bench_fp8", ["--profile-batch-size", "4"], "--profile-batch-size"),  # without --profile
])
def test_benchmark_scripts_refuse_flags_their_run_would_not_read(script, argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        _benchmark_script(script).main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_persistent_decoder_benchmark_checks_its_bound_then_says_it_needs_a_gpu(monkeypatch, capsys):
    """Its forward is captured with the engine's attention bound (--bound), which must exceed every context;
    without a GPU it stops at once, saying why."""
    script = _benchmark_script("kernels/bench_persistent_decoder")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        script.main(["--contexts", "128,2056"])
    assert e.value.code == 2 and "--bound 2056 must exceed every context" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        script.main(["--contexts", "128,2055"])
    assert e.value.code == 2 and "it needs a GPU" in capsys.readouterr().err


def test_mixed_steps_benchmark_says_it_needs_a_gpu(monkeypatch, capsys):
    """Without a GPU it stops at once, saying why, rather than at the engine's refusal of an argument the
    user never gave (mixed_cuda_graph_max_tokens, its default)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        _benchmark_script("bench_mixed_steps").main([])
    assert e.value.code == 2 and "it needs a GPU" in capsys.readouterr().err


def test_spec_decode_benchmark_script(tmp_path, capsys):
    module = _spec_decode_script()
    out = tmp_path / "spec.json"
    assert module.main(["--batch-sizes", "1,2", "--output-len", "16", "--device", "cpu", "--dtype", "float32",
                        "--min-requests", "2", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    # batches one after another until 2 requests ran, for plain decode and speculation alike
    assert [r["batches"] for r in rows] == [result["baseline"][str(b)]["batches"] for b in (1, 2)] == [2, 1]
    for r in rows:
        # drafts were accepted: fewer steps than plain decode for the same tokens
        assert r["steps"] < result["baseline"][str(r["batch_size"])]["steps"]
        assert 0 < r["spec_acceptance_rate"] <= 1 and r["speedup"] > 0 and r["acceptance"] == "measured"
        # plain decode's batches never drain (every request ends at the same step); a speculative batch of
        # one is always full; the full steps' speedup is timed over the same kind of steps as the plain one
        assert result["baseline"][str(r["batch_size"])]["full_batch_steps"] == 1.0
        assert 0 < r["full_batch_steps"] <= 1 and r["full_batch_speedup"] > 0
    assert rows[0]["full_batch_steps"] == 1.0
    assert rows[0]["full_batch_speedup"] == pytest.approx(rows[0]["speedup"])
    # which path ran the draft's rounds, in the JSON and under the table (the CPU: the forward)
    assert {r["draft_rounds"] for r in rows} == {"forward (FASTLLM_PERSISTENT_DRAFT is not 1 (opt-in))"}
    out = capsys.readouterr().out
    assert "spec_mean_accepted_len" in out and "the draft's one-token rounds ran through the forward" in out


@pytest.mark.parametrize("argv", [["--draft", "none"], ["--draft", "none", "--draft-quantization", "fp8"]])
def test_spec_decode_benchmark_refuses_a_run_with_nothing_to_compare(argv, capsys):
    """No draft and no n-gram rows would time plain decode alone, every speculative flag unused."""
    with pytest.raises(SystemExit) as e:
        _spec_decode_script().main([*argv, "--device", "cpu"])
    assert e.value.code == 2 and "--draft" in capsys.readouterr().err


def test_a_speculative_profile_traces_speculative_steps(tmp_path):
    """profile_decode sizes its requests for a speculative engine's k + 1 tokens a step, so every warm-up
    and profiled step verifies drafts; sized at a token a step, the stories pair (~3.75 tokens a verify)
    ended them in the warm-up and the trace held empty steps."""
    import dataclasses

    from fastllm.bench.profile import STEPS, WARMUP_STEPS, profile_decode
    from tests.conftest import DRAFT, cached_llm

    engine = cached_llm(speculative_config={"model": DRAFT, "num_speculative_tokens": 4}).engine
    before = dataclasses.replace(engine.scheduler.spec_stats)
    profile_decode(engine, 1, 16, str(tmp_path))
    assert engine.scheduler.spec_stats.since(before).num_drafts >= WARMUP_STEPS + STEPS
    assert not engine.has_unfinished_requests()  # the profile aborted its requests and drained the engine
    engine.check_kv_pool_whole()


def test_decode_steps_leave_out_the_prefill():
    """Neither the prefill's launch (no tokens back) nor the step that waited for the prefill (the first tokens)
    counts as decode."""
    from fastllm.bench.runner import RunRecord, StepRecord

    run = RunRecord(2, [32, 32], 4)
    run.steps = [StepRecord(0.008, 0, 0, [], num_tokens=0), StepRecord(0.100, 2, 2, [33, 33], num_tokens=2),
                 StepRecord(0.004, 2, 0, [34, 34], num_tokens=2), StepRecord(0.004, 2, 0, [35, 35], num_tokens=6)]
    assert run.decode_steps() == run.steps[2:]


def test_latency_rows_count_stalled_steps():
    """A decode step over twice the median is a stall (a collection, a compile): the row counts them and
    the time they add, and its printed line says so; a steady run has none and says nothing."""
    from fastllm.bench.latency import latency_row
    from fastllm.bench.report import row_line
    from fastllm.bench.roofline import ModelShape
    from fastllm.bench.runner import RunRecord, StepRecord

    shape = ModelShape.from_model(None)

    def row(seconds: list[float], gc_s: list[float] | None = None) -> dict:
        run = RunRecord(2, [32, 32], len(seconds) + 1, total_s=sum(seconds))
        run.steps = [StepRecord(s, 2, 0, [33 + i, 33 + i], num_tokens=2, gc_s=g)
                     for i, (s, g) in enumerate(zip(seconds, gc_s or [0.0] * len(seconds)))]
        return latency_row(run, 2, 32, shape, None)

    steady = row([0.004, 0.0041, 0.0039, 0.0079, 0.004])
    assert steady["stalled_steps"] == 0 and "stalled" not in row_line("latency", steady)
    # the median is 4.05 ms: 99.95 + 4.45 ms beyond it; a collection took 97 ms of the first stall, and one of
    # 1 ms in a steady step is no stall's
    stalled = row([0.004, 0.0041, 0.0039, 0.104, 0.004, 0.0085], gc_s=[0.0, 0.001, 0.0, 0.097, 0.0, 0.0])
    assert stalled["stalled_steps"] == 2 and stalled["stalled_ms"] == pytest.approx(104.4)
    assert stalled["stalled_gc_ms"] == pytest.approx(97.0)
    assert "[2 decode steps stalled: 104.4 ms beyond the median; 97.0 ms of garbage collection in them]" \
        in row_line("latency", stalled)
    del stalled["stalled_gc_ms"]  # a row saved before the column: no GC part
    assert "[2 decode steps stalled: 104.4 ms beyond the median]" in row_line("latency", stalled)


def test_gc_watch_times_the_collections_in_its_window():
    import gc

    from fastllm.bench.gc_watch import GCWatch

    with GCWatch() as watch:
        garbage = [[i] for i in range(100_000)]
        gc.collect()
    del garbage
    before = watch.seconds
    gc.collect()  # after the window: not counted
    assert before > 0 and watch.seconds == before


def test_spec_decode_benchmark_seed_sets_the_synthetic_draws(tmp_path):
    """--seed: the same seed draws the same synthetic acceptances, another seed others (without it every process
    draws torch's default sequence)."""
    module = _spec_decode_script()

    def accepted(seed: int) -> float:
        out = tmp_path / f"spec{seed}.json"
        module.main(["--batch-sizes", "2", "--output-len", "16", "--device", "cpu", "--dtype", "float32",
                     "--min-requests", "2", "--synthetic-acceptance", "0.5", "--seed", str(seed),
                     "--output-json", str(out)])
        result = json.loads(out.read_text())
        assert result["meta"]["seed"] == seed
        return result["rows"][0]["spec_acceptance_rate"]

    first = accepted(1)
    assert accepted(1) == first and accepted(2) != first


def test_arrivals_offer_the_rate_asked_for():
    from fastllm.bench import serving

    for seed in range(4):
        offsets = serving.arrival_offsets(1000, 32.0, seed)
        gaps = np.diff(offsets)
        assert offsets[0] == 0 and (gaps > 0).all() and len(set(gaps.round(9))) > 900  # random gaps
        assert abs(999 / offsets[-1] - 32.0) < 1e-9  # yet exactly 32/s over the run
    assert serving.arrival_offsets(5, float("inf"), 0) == [0.0] * 5
    assert serving.arrival_offsets(1, 8.0, 0) == [0.0]


def test_kernel_tuner_dry_run_times_and_checks_its_candidates_on_the_cpu():
    """tune.py --dry-run: the CPU, Triton's interpreter (chosen before kbench imports Triton), tiny cases;
    every candidate's output is checked against the reference (a wrong one prints BAD=, a failure ERR=)."""
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "tune.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), "--dry-run", "--only", "decode,kv", "--cases", "B1_ctx300,T37"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = run.stdout[run.stdout.index("SUMMARY"):]
    assert "kv_write T37" in summary and "decode   B1_ctx300" in summary
    assert "BAD=" not in summary and "ERR=" not in summary
