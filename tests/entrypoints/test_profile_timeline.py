"""The GPU timeline of a profile trace (bench/profile.py): overlapping kernels count once, copies count as
busy, gaps do not, and the attention layer's kernels are told apart by name."""

from __future__ import annotations

import json

import pytest

import pandas as pd

from fastllm.bench.profile import (attention_kernel_names, device_events, gpu_timeline, kernels_by_grid,
                                   print_profile)


def kernel(name: str, ts: float, dur: float, cat: str = "kernel", grid: list[int] | None = None) -> dict:
    event = {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur}
    if grid is not None:
        event["args"] = {"grid": grid, "block": [128, 1, 1]}
    return event


def test_overlaps_count_once_and_gaps_not_at_all(tmp_path):
    events = [
        kernel("nvjet_gemm", 0, 100),
        kernel("_cascade_prefix_kernel", 100, 30),  # the suffix kernel starts beside it (PDL)
        kernel("_decode_split_kernel", 110, 40),
        kernel("Memcpy HtoD (Pinned -> Device)", 200, 10, cat="gpu_memcpy"),  # after a 50 us gap
        kernel("nvjet_gemm", 1000, 100),  # the second step, after an idle 790 us
        {"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ph": "X", "ts": 5, "dur": 3},  # host: not counted
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = gpu_timeline(device_events(trace), steps=2)
    assert got == pytest.approx({"span_ms": 1100 / 2e3, "busy_ms": (100 + 50 + 10 + 100) / 2e3,
                                 "attention_ms": 50 / 2e3})


def test_no_kernels_no_timeline(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [{"name": "aten::mm", "cat": "cpu_op", "ts": 0, "dur": 5}]}))
    assert gpu_timeline(device_events(trace), steps=1) is None


def test_attention_kernels_are_the_attention_layers():
    names = attention_kernel_names()
    assert {"_decode_split_kernel", "_cascade_prefix_kernel", "_prefill_kernel", "_merge_kernel",
            "_rotary_kv_write_kernel"} <= names
    assert not names & {"_rms_norm_kernel", "_silu_and_mul_kernel", "_argmax_part_kernel"}


@pytest.mark.parametrize("cascade_steps", [None, 3])
def test_print_profile_takes_profiles_without_cascade_steps(cascade_steps, capsys):
    """bench_beam_search.py's profile has no cascade count (printing it raised a KeyError)."""
    result = {"trace": "t.json", "top": pd.DataFrame([{"op": "aten::mm", "calls": 2, "total_ms": 1.0}]),
              "ranges": pd.DataFrame(), "on_gpu": False, "steps": 5, "host": None}
    if cascade_steps is not None:
        result["cascade_steps"] = cascade_steps
    print_profile(result)
    want = "(5 decode steps)" if cascade_steps is None else "(5 decode steps, 3 with cascade attention)"
    assert f"profile trace: t.json {want}" in capsys.readouterr().out


def test_kernels_by_grid_split_one_kernel_by_its_launch_grids(tmp_path):
    """Per decode step, by device time: the weight-streaming kernel's qkv (96 programs) and o (64) grids
    apart, a copy left out, a kernel without a grid named "?"."""
    events = [kernel("_fp8_skinny_linear_kernel", 10 * i, d, grid=g)
              for i, (g, d) in enumerate([([96, 1, 1], 9.0), ([64, 1, 1], 7.0)] * 4)]
    events += [kernel("nvjet_gemm", 100, 30), kernel("Memcpy HtoD", 200, 50, cat="gpu_memcpy")]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = kernels_by_grid(device_events(trace), steps=2)
    assert got.to_dict("records") == [
        {"kernel": "_fp8_skinny_linear_kernel", "grid": "96x1x1", "calls_per_step": 2.0, "us_per_call": 9.0,
         "ms_per_step": pytest.approx(0.018)},
        {"kernel": "nvjet_gemm", "grid": "?", "calls_per_step": 0.5, "us_per_call": 30.0,
         "ms_per_step": pytest.approx(0.015)},
        {"kernel": "_fp8_skinny_linear_kernel", "grid": "64x1x1", "calls_per_step": 2.0, "us_per_call": 7.0,
         "ms_per_step": pytest.approx(0.014)},
    ]
