"""Run every kernel micro-benchmark once, without pytest, and print one table (+ CSV).

    python benchmarks/kernels/run_all.py --out kernels.csv [--only paged_decode_attention,rotary]

Each benchmark module is imported and run on its own: a failure is printed, recorded as an error row,
and the rest still run. Rows: kernel, case, impl ('triton' = ours, the others torch baselines), ms
(steady state, kbench.steady_ms; ms_do_bench beside it), GB/s and its fraction of the measured copy
bandwidth, TFLOP/s and its fraction of the measured bf16 matmul rate for prefill, and
speedup_vs_torch_best on our rows. Every row also carries the GPU, versions and commit.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

MODULES = [  # cheap ones first, so a slow compile at the end cannot hide everything else
    "bench_kv_cache_write",
    "bench_paged_decode_attention",
    "bench_cascade_attention",
    "bench_prefill_attention",
    "bench_fused_add_rms_norm",
    "bench_rotary",
    "bench_rotary_kv_cache_write",
    "bench_silu_and_mul",
    "bench_fp8_linear",
]


def _environment() -> dict:
    import torch
    import triton

    from fastllm.bench.ceilings import git_commit  # FASTLLM_COMMIT when set, as the engine benchmarks

    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "commit": git_commit()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="CSV path for the results table")
    parser.add_argument("--only", default="", help="comma-separated suffixes, e.g. rotary,silu_and_mul")
    args = parser.parse_args()

    import pandas as pd
    import torch

    if not torch.cuda.is_available():
        print("run_all.py: no CUDA GPU; kernel benchmarks are GPU-only")
        return 1
    import kbench

    env = _environment()
    copy_bw, copy_how = kbench.copy_bandwidth()
    matmul = kbench.matmul_tflops()
    print(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | commit {env['commit']} | "
          f"copy bandwidth {copy_bw:.0f} GB/s (read + write; {copy_how}) | bf16 matmul {matmul:.0f} TFLOP/s",
          flush=True)

    wanted = [m for m in MODULES if not args.only or any(m.endswith(o) for o in args.only.split(","))]
    rows, failed, notes, start = [], [], [], time.time()
    for name in wanted:
        t0 = time.time()
        try:
            module_rows = importlib.import_module(name).run()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            module_rows = [{"kernel": name.removeprefix("bench_"), "case": "*", "impl": "triton",
                            "error": f"{type(e).__name__}: {e}"[:200]}]
        errors = [r for r in module_rows if r.get("error")]
        for r in errors:  # ours failing is a failure; a baseline torch cannot run is a note
            what = f"{r['kernel']}/{r['case']}/{r['impl']}: {r['error']}"
            (failed if r["impl"] == "triton" else notes).append(what)
        rows += module_rows
        print(f"  {name}: {len(module_rows)} rows, {len(errors)} errors, {time.time() - t0:.1f} s",
              flush=True)
        torch.cuda.empty_cache()

    table = pd.DataFrame(rows)
    for key, value in env.items():
        table[key] = value
    table["copy_bw_GB/s"] = round(copy_bw, 1)
    table["matmul_TFLOP/s"] = round(matmul, 1)
    columns = ["kernel", "case", "impl", "ms", "ms_do_bench", "GB/s", "frac_copy_bw", "TFLOP/s",
               "frac_matmul", "speedup_vs_torch_best", "num_splits", "timing", "rel_err_vs_fp32",
               "rel_err_ours_vs_this"]
    shown = [c for c in columns if c in table.columns]
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(table[table.get("error", pd.Series(index=table.index, dtype=object)).isna()][shown]
              .to_string(index=False))
    if notes:
        print("\nbaselines that could not run:\n  " + "\n  ".join(notes))
    if failed:
        print("\nFAILED (ours):\n  " + "\n  ".join(failed))
    if args.out:
        table.to_csv(args.out, index=False)
        print(f"wrote {args.out}")
    print(f"total {time.time() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
