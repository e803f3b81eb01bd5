"""A torch-profiler trace of a few decode steps, and where their time goes.

The engine's NVTX/record_function ranges (schedule, prepare_inputs, forward, sample, update,
detokenize; layerN with layers=True) are switched on, B requests are prefilled and warmed up
outside the profiler, then `steps` pure decode steps are recorded to a Chrome trace
(chrome://tracing or https://ui.perfetto.dev). The summary: top kernels by device time (top CPU
ops on a CPU run), the time of each engine range per step and, on a GPU, the step's timeline: the span
of its kernels, the time some kernel ran (busy; kernels that overlap, as PDL's and side streams' do,
count once), how much of that the attention kernels account for (what a step would save with
attention free), and the kernels by launch grid (one projection a grid for the weight-streaming kernels).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from fastllm.bench.throughput import make_prompts
from fastllm.engine.llm_engine import LLMEngine
from fastllm.sampling_params import RequestOutputKind, SamplingParams
from fastllm.tracing import enable_nvtx

# forward_graph: a decode step replayed from a CUDA graph; forward: eager or compiled.
RANGES = ("schedule", "prepare_inputs", "forward", "forward_graph", "sample", "wait_tokens", "update", "detokenize")
WARMUP_STEPS = 3
STEPS = 5  # profiled decode steps, by default
# The modules of the attention layer's kernels (K/V writes included: a cascade step writes apart from them)
ATTENTION_MODULES = ("cascade_attention", "paged_decode_attention", "prefill_attention",
                     "prefill_attention_hopper", "merge_attn_states", "rotary_kv_cache_write",
                     "kv_cache_write")


def _get(evt, *names) -> float:
    for name in names:
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _on_cpu(evt) -> bool:
    return getattr(evt, "device_type", torch.autograd.DeviceType.CPU) == torch.autograd.DeviceType.CPU


def _is_range(evt) -> bool:
    """An engine/NVTX range or our step marker (CPU side, or its GPU-side user annotation)."""
    return bool(getattr(evt, "is_user_annotation", False)) or evt.key in RANGES \
        or re.fullmatch(r"layer\d+|(decode|beam)_step\d+|ProfilerStep#\d+", evt.key) is not None


def _device_us(evt) -> float:
    return _get(evt, "self_device_time_total", "self_cuda_time_total")


def top_ops(prof, on_gpu: bool, limit: int = 15) -> pd.DataFrame:
    """Kernels by total device time (GPU) or operators by self CPU time (CPU)."""
    events = [e for e in prof.key_averages() if not _is_range(e)]
    if on_gpu:
        rows = [(e.key, e.count, _device_us(e)) for e in events if not _on_cpu(e) and _device_us(e) > 0]
        if not rows:  # older profilers put kernel time on the launching ops only
            rows = [(e.key, e.count, _device_us(e)) for e in events if _device_us(e) > 0]
    else:
        rows = [(e.key, e.count, _get(e, "self_cpu_time_total")) for e in events]
    total = sum(us for _, _, us in rows) or 1.0
    rows.sort(key=lambda r: -r[2])
    kind = "kernel" if on_gpu else "op"
    return pd.DataFrame([{kind: _short(name), "calls": count,
                          "total_ms": us / 1e3, "avg_us": us / max(count, 1), "pct": 100 * us / total}
                         for name, count, us in rows[:limit]])


def _short(name: str) -> str:
    return name if len(name) <= 70 else name[:67] + "..."


def range_table(prof, steps: int, on_gpu: bool) -> pd.DataFrame:
    """Per engine range: CPU ms per step and (GPU) the device time of kernels launched inside it."""
    cpu, gpu = {}, {}
    for e in prof.key_averages():
        if e.key in RANGES:
            (cpu if _on_cpu(e) else gpu)[e.key] = e
    rows = []
    for name in RANGES:
        if name not in cpu:
            continue
        row = {"range": name, "cpu_ms_per_step": _get(cpu[name], "cpu_time_total") / 1e3 / steps}
        if on_gpu:  # the range's span on the GPU timeline when the profiler records one, else its kernels' sum
            span = gpu.get(name, cpu[name])
            row["device_ms_per_step"] = _get(span, "device_time_total", "cuda_time_total") / 1e3 / steps
        rows.append(row)
    return pd.DataFrame(rows)


def profile_decode(engine: LLMEngine, batch_size: int, input_len: int, out_dir: str, steps: int = STEPS,
                   layers: bool = False, seed: int = 1, shared_prefix_len: int = 0,
                   unshared: int = 0) -> dict:
    """Record `steps` decode steps of batch_size requests to out_dir; returns the paths and tables.
    shared_prefix_len: the prompts start with the same that many tokens (`bench prefix`'s workload); their
    requests share its blocks in the prefix cache (the groups of cascade attention, where its cost model
    takes them). unshared: that many prompts have a prefix of their own (make_prompts). The requests last
    as many steps as a speculative engine's k + 1 tokens a step take, so none finishes in the trace."""
    enable_nvtx(layers=layers)
    device = engine.worker.device
    on_gpu = device.type == "cuda"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(engine, batch_size, input_len - shared_prefix_len, shared_prefix_len, seed,
                           unshared)
    # Early requests decode while later ones still prefill (chunked): leave them room to keep going.
    prefill_steps = -(-batch_size * input_len // engine.config.scheduler.max_num_batched_tokens)
    tokens_per_step = 1 + engine.config.speculative.lookahead  # (a verify gives up to k + 1)
    max_tokens = min(prefill_steps + (WARMUP_STEPS + steps + 2) * tokens_per_step,
                     engine.config.model.max_model_len - input_len)
    if max_tokens < prefill_steps + WARMUP_STEPS + steps + 1:
        raise ValueError(f"--input-len {input_len} leaves no room for {steps} profiled decode steps")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"profile-{i}" for i in range(batch_size)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    cascade = engine.worker.runner.cascade
    try:
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        have_first: set[str] = set()
        while len(have_first) < batch_size:  # prefill, outside the trace
            have_first.update(o.request_id for o in engine.step())
        for _ in range(WARMUP_STEPS):
            engine.step()
        cascaded = cascade.num_planned
        with profile(activities=activities, record_shapes=False) as prof:
            for i in range(steps):
                with torch.profiler.record_function(f"decode_step{i}"):
                    engine.step()
        cascaded = cascade.num_planned - cascaded
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests():  # the step still in flight (async scheduling)
            engine.step()
    trace = out / f"decode_bs{batch_size}_{device.type}.trace.json"
    prof.export_chrome_trace(str(trace))
    return {"trace": str(trace), "top": top_ops(prof, on_gpu), "ranges": range_table(prof, steps, on_gpu),
            "host": top_ops(prof, on_gpu=False) if on_gpu else None, "on_gpu": on_gpu, "steps": steps,
            "cascade_steps": cascaded, **device_tables(trace, steps, on_gpu)}


def device_tables(trace: Path, steps: int, on_gpu: bool) -> dict:
    """A GPU profile's timeline and kernels by grid (print_profile's "timeline" and "grids"); None on a
    CPU."""
    if not on_gpu:
        return {"timeline": None, "grids": None}
    events = device_events(trace)
    return {"timeline": gpu_timeline(events, steps), "grids": kernels_by_grid(events, steps)}


def attention_kernel_names() -> set[str]:
    """The names of the attention layer's Triton kernels, as a trace shows them."""
    from triton.runtime.jit import KernelInterface  # (JITFunction, or the interpreter's stand-in)

    names = set()
    for module in ATTENTION_MODULES:
        for name, value in vars(importlib.import_module(f"fastllm.kernels.{module}")).items():
            if isinstance(value, KernelInterface) and name.endswith("_kernel"):
                names.add(name)
    return names


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def device_events(trace: Path) -> list[dict]:
    """A Chrome trace's GPU events: kernels, copies and memsets."""
    return [e for e in json.loads(Path(trace).read_text())["traceEvents"]
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def gpu_timeline(events: list[dict], steps: int) -> dict | None:
    """ms a step on the GPU timeline of a trace's device_events: span (first kernel's start to last one's
    end), busy (the union of kernels and copies), attention (the union of the attention kernels); None
    without kernels."""
    device = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events]
    if not device:
        return None
    attention = attention_kernel_names()
    per_step = 1e3 * steps  # us in the trace
    return {"span_ms": (max(e for _, e, _ in device) - min(s for s, _, _ in device)) / per_step,
            "busy_ms": _union_us([(s, e) for s, e, _ in device]) / per_step,
            "attention_ms": _union_us([(s, e) for s, e, name in device if name in attention]) / per_step}


def kernels_by_grid(events: list[dict], steps: int, limit: int = 20) -> pd.DataFrame:
    """A trace's kernels by name and launch grid, by device time (calls and ms a step, us a call). The grid
    tells one kernel's shapes apart: the weight-streaming projections launch a grid a weight (qkv, o,
    gate_up, down, lm_head), so the step's time is split by projection."""
    groups: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e["cat"] == "kernel":
            grid = "x".join(str(g) for g in e.get("args", {}).get("grid", ())) or "?"
            groups.setdefault((e["name"], grid), []).append(e["dur"])
    rows = sorted(groups.items(), key=lambda item: -sum(item[1]))[:limit]
    return pd.DataFrame([{"kernel": _short(name), "grid": grid, "calls_per_step": len(durs) / steps,
                          "us_per_call": sum(durs) / len(durs), "ms_per_step": sum(durs) / steps / 1e3}
                         for (name, grid), durs in rows])


def print_profile(result: dict, file=None) -> None:
    file = file or sys.stdout  # (looked up per call: a default would keep the stdout of import time)
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.max_colwidth", 80,
                           "display.float_format", "{:.3f}".format):
        cascade = result.get("cascade_steps")  # (profile_decode's; beam search's profile has none)
        steps = f"{result['steps']} decode steps"
        if cascade is not None:
            steps += f", {cascade} with cascade attention"
        print(f"\nprofile trace: {result['trace']} ({steps})", file=file)
        what = "kernels by device time" if result["on_gpu"] else "CPU ops by self time (no GPU)"
        print(f"top {what}:", file=file)
        print(result["top"].to_string(index=False), file=file)
        if result.get("host") is not None:  # on a GPU run, where the host's time goes (CUDA API calls included)
            print(f"top host ops by self CPU time ({result['steps']} steps):", file=file)
            print(result["host"].to_string(index=False), file=file)
        if len(result["ranges"]):
            print("engine ranges per decode step:", file=file)
            print(result["ranges"].to_string(index=False), file=file)
        if result.get("grids") is not None and len(result["grids"]):
            print("kernels by launch grid, per decode step:", file=file)
            print(result["grids"].to_string(index=False), file=file)
        if result.get("timeline"):
            t = result["timeline"]
            rest = t["busy_ms"] - t["attention_ms"]
            print(f"GPU timeline per decode step: span {t['span_ms']:.3f} ms, busy {t['busy_ms']:.3f} ms "
                  f"(attention kernels {t['attention_ms']:.3f} ms, the rest {rest:.3f})", file=file)
    file.flush()
