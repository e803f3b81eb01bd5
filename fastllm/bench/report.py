"""Bench results: one dict per run, {"benchmark", "meta", "ceilings", "startup", "model", "rows"},
printed as a pandas table and written as JSON, CSV (rows, each stamped with device, versions and
commit) and a plot. Missing values are None in Python, null in JSON, empty in CSV, "n/a" on screen.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

# column -> (header, scale) for the screen; the files keep every column, unscaled.
DISPLAY = {
    "latency": {
        "batch_size": ("bs", 1), "ttft_ms": ("ttft_ms", 1), "tpot_ms_mean": ("tpot_ms", 1),
        "tpot_ms_p50": ("p50", 1), "tpot_ms_p90": ("p90", 1), "tpot_ms_p99": ("p99", 1),
        "floor_ms": ("floor_ms", 1), "host_ms_p50": ("host_ms", 1), "host_frac": ("%host", 100),
        "tok_s_per_seq": ("tok/s/seq", 1), "tok_s_total": ("tok/s", 1),
        "achieved_gb_s": ("GB/s", 1), "bw_frac": ("%bw", 100), "achieved_tflops": ("TFLOP/s", 1),
        "tc_frac": ("%tc", 100), "peak_mem_gib": ("peak_GiB", 1), "jit_compiles": ("jit", 1),
        "stalled_steps": ("stalls", 1),
    },
    "throughput": {
        "num_prompts": ("prompts", 1), "input_len_mean": ("in", 1), "output_len": ("out", 1),
        "shared_prefix_len": ("prefix", 1), "prefix_caching": ("caching", 1), "total_s": ("total_s", 1), "requests_s": ("req/s", 1),
        "input_tok_s": ("in_tok/s", 1), "output_tok_s": ("out_tok/s", 1), "ttft_ms_mean": ("ttft_ms", 1),
        "ttft_ms_p99": ("ttft_p99", 1), "prefix_hit_rate": ("%hit", 100), "peak_mem_gib": ("peak_GiB", 1),
        "steps": ("steps", 1), "prefill_steps": ("pf_steps", 1), "prefill_steps_s": ("pf_steps_s", 1),
        "decode_steps_s": ("dec_steps_s", 1), "host_s": ("host_s", 1), "jit_compiles": ("jit", 1),
    },
    "startup": {
        "load_s": ("load_s", 1), "compile_s": ("compile_s", 1), "cuda_graph_s": ("graphs_s", 1),
        "warm_up_s": ("warm_up_s", 1),
        "kv_profile_s": ("kv_profile_s", 1), "kv_alloc_s": ("kv_alloc_s", 1), "other_s": ("other_s", 1),
        "total_s": ("total_s", 1), "kv_cache_gib": ("kv_GiB", 1), "cuda_graph_gib": ("graphs_GiB", 1),
    },
}
DISPLAY["prefix"] = {**DISPLAY["throughput"], "cascade_attention": ("cascade", 1), "cascade_steps": ("casc_steps", 1),
                     "decode_step_ms_mean": ("dec_step_ms", 1)}
DISPLAY["serving"] = {
    "request_rate": ("rate", 1), "completed": ("done", 1), "failed": ("failed", 1),
    "req_s": ("req/s", 1), "delivered_req_s": ("deliv_req/s", 1), "output_tok_s": ("out_tok/s", 1),
    "vs_offline": ("%offline", 100), "ttft_ms_mean": ("ttft_ms", 1), "ttft_ms_p99": ("ttft_p99", 1),
    "tpot_ms_mean": ("tpot_ms", 1), "itl_ms_p99": ("itl_p99", 1), "itl_p99_over_tpot": ("itl99/tpot", 1),
    "engine_mean_batch": ("batch", 1), "engine_step_ms": ("step_ms", 1), "engine_host_ms": ("host_ms", 1),
    "engine_cpu_ms": ("cpu_ms", 1), "offline_step_ms": ("off_step_ms", 1),
    "tpot_vs_offline_step": ("tpot/off_step", 1), "merged_chunk_frac": ("%merged", 100),
    "slow_steps": ("slow_steps", 1), "jit_compiles": ("compiles", 1),
}
STAMP = ("device", "torch", "triton", "commit")


def clean(value):
    """NaN/inf -> None, numpy scalars -> Python, recursively: what JSON can hold."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def header(result: dict) -> str:
    m, c = result["meta"], result.get("ceilings")
    lines = [f"fastllm bench {result['benchmark']}: {m['model']} ({m['dtype']}, {m['load_format']} weights, "
             f"{m.get('execution', 'eager')}) "
             f"on {m['device']} | torch {m['torch']} | triton {m['triton'] or 'n/a'} | commit {m['commit']}"]
    if c:
        lines.append(f"ceilings: copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s (read+write), bf16 matmul "
                     f"{c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s ({c.get('source', 'measured')})")
    elif result["benchmark"] != "serving":  # the server process owns the device
        lines.append("ceilings: n/a (CPU run or --no-ceilings): %bw and %tc are n/a")
    s = result.get("startup")
    if s:
        def fmt(key):
            return "n/a" if s.get(key) is None else f"{s[key]:.2f} s"
        graph_mem = f" ({s['cuda_graph_gib']:.2f} GiB)" if s.get("cuda_graph_gib") is not None else ""
        lines.append(f"startup {fmt('total_s')}: load {fmt('load_s')}, compile {fmt('compile_s')}, "
                     f"cuda graphs {fmt('cuda_graph_s')}{graph_mem}, warm-up {fmt('warm_up_s')}, KV profile {fmt('kv_profile_s')}, "
                     f"KV alloc {fmt('kv_alloc_s')} ({s['kv_cache_gib']:.2f} GiB), other {fmt('other_s')}")
    return "\n".join(lines)


def format_frame(df: pd.DataFrame) -> str:
    """4 significant digits (whole numbers from 1000 up), "n/a" for missing values."""
    shown = df.astype(object).where(df.notna(), "n/a")
    for col in shown.columns:
        shown[col] = [(f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}") if isinstance(v, float) else v
                      for v in shown[col]]
    with pd.option_context("display.width", 250, "display.max_columns", None):
        return shown.to_string(index=False)


def table(result: dict) -> str:
    columns = DISPLAY[result["benchmark"]]
    rows = result["rows"] if result["benchmark"] != "startup" else [result["startup"]]
    return format_frame(pd.DataFrame([{header: (r.get(col) if r.get(col) is None or scale == 1 else r[col] * scale)
                                       for col, (header, scale) in columns.items()} for r in rows]))


def stall_note(row: dict) -> str:
    """" [N decode steps stalled: X ms beyond the median; Y ms of garbage collection in them]" for a latency
    row with stalls (rows saved before the GC column lack its part), else ""."""
    if not row.get("stalled_steps"):
        return ""
    gc_ms = row.get("stalled_gc_ms")
    collections = "" if gc_ms is None else f"; {gc_ms:.1f} ms of garbage collection in them"
    return (f" [{row['stalled_steps']} decode steps stalled: {row['stalled_ms']:.1f} ms beyond the median"
            f"{collections}]")


def row_line(benchmark: str, row: dict) -> str:
    """One line per finished row, printed (and flushed) as the run goes."""
    def f(key, spec=".2f", scale=1.0):
        v = row.get(key)
        return "n/a" if v is None else format(v * scale, spec)
    # Kernels compiled inside the timed window put their JIT time in the numbers: say so on the line.
    jit = f" [{row['jit_compiles']} Triton compiles in the timed window]" if row.get("jit_compiles") else ""
    if benchmark == "latency":
        return (f"[batch {row['batch_size']}] ttft {f('ttft_ms')} ms, tpot {f('tpot_ms_mean')} ms "
                f"(p50 {f('tpot_ms_p50')}, p99 {f('tpot_ms_p99')}), floor {f('floor_ms')} ms, "
                f"{f('tok_s_total', '.1f')} tok/s, {f('achieved_gb_s', '.1f')} GB/s ({f('bw_frac', '.1f', 100)}% bw), "
                f"{f('achieved_tflops', '.2f')} TFLOP/s ({f('tc_frac', '.1f', 100)}% tc), peak {f('peak_mem_gib')} GiB"
                + jit + stall_note(row))
    if benchmark == "serving":
        return (f"[rate {row['request_rate']}/s, {row['completed']}/{row['num_prompts']} done] "
                f"{f('req_s')} req/s ({f('delivered_req_s')} first to last completion), "
                f"{f('output_tok_s', '.1f')} out tok/s, ttft {f('ttft_ms_mean')} ms (p99 {f('ttft_ms_p99')}), "
                f"tpot {f('tpot_ms_mean')} ms (p99 {f('tpot_ms_p99')}), itl p99 {f('itl_ms_p99')} ms, "
                f"engine batch {f('engine_mean_batch', '.1f')} step {f('engine_step_ms')} ms (host "
                f"{f('engine_host_ms')}, cpu {f('engine_cpu_ms')}), {row.get('slow_steps', 0)} steps over 1 s"
                + (f" [{row['jit_compiles']} kernels or graphs compiled in the timed window]"
                   if row.get("jit_compiles") else ""))
    return (f"[{row['num_prompts']} prompts] {f('total_s')} s, {f('requests_s')} req/s, "
            f"{f('output_tok_s', '.1f')} out tok/s, ttft {f('ttft_ms_mean')} ms, hit rate {f('prefix_hit_rate', '.1f', 100)}%"
            + jit)


def cascade_summary(rows: list[dict]) -> str:
    """`bench prefix`'s comparison: the mean decode step with cascade attention against the step without."""
    on = next((r for r in rows if r.get("cascade_attention") != "off"), None)
    off = next((r for r in rows if r.get("cascade_attention") == "off"), None)
    if on is None or off is None or not on.get("decode_step_ms_mean") or not off.get("decode_step_ms_mean"):
        return "cascade attention: no comparison (it is off in this run)"
    ratio = on["decode_step_ms_mean"] / off["decode_step_ms_mean"]
    return (f"cascade attention ({on['cascade_attention']}, {on['cascade_steps']} steps cascaded): mean decode step "
            f"{on['decode_step_ms_mean']:.2f} ms against {off['decode_step_ms_mean']:.2f} ms off ({ratio:.2f}x)")


def write_json(result: dict, path: str) -> None:
    Path(path).write_text(json.dumps(clean(result), indent=2, allow_nan=False) + "\n")


def write_csv(result: dict, path: str) -> None:
    rows = result["rows"] if result["benchmark"] != "startup" else [result["startup"]]
    stamp = {"benchmark": result["benchmark"], "model": result["meta"]["model"],
             **{k: result["meta"].get(k) for k in STAMP}}
    pd.DataFrame([{**clean(r), **stamp} for r in rows]).to_csv(path, index=False)


def load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def plot_latency(result: dict, path: str) -> None:
    """Total decode tokens/s and % of the copy bandwidth against batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("tok_s_total") is not None]
    bs = [r["batch_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(bs, [r["tok_s_total"] for r in rows], "o-", color="tab:blue", label="tokens/s (decode, total)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s", color="tab:blue")
    ax.set_xticks(bs, [str(b) for b in bs])
    if any(r.get("bw_frac") is not None for r in rows):
        ax2 = ax.twinx()
        ax2.plot(bs, [100 * r["bw_frac"] if r.get("bw_frac") is not None else float("nan") for r in rows],
                 "s--", color="tab:red", label="% of copy bandwidth")
        ax2.set_ylabel("% of measured copy bandwidth", color="tab:red")
        ax2.set_ylim(0, 100)
    m = result["meta"]
    ax.set_title(f"{Path(m['model']).name} {m['dtype']}, {m['input_len']} in / {m['output_len']} out\n"
                 f"{m['device']} | torch {m['torch']} | commit {m['commit']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
