"""Time fp8_gemm's launch configs against torch._scaled_mm at a model's projection shapes (GPU, sm_90).

    python benchmarks/kernels/tune_fp8_gemm.py                      # Llama-3.1-8B, 64-512 rows
    python benchmarks/kernels/tune_fp8_gemm.py --rows 256 --shapes gate_up

Per projection (qkv, o, gate_up, down) and row count: torch._scaled_mm as fp8_linear calls it, and every
config of fastllm/kernels/fp8_gemm.py, each timed as a CUDA-graph replay over enough e4m3 weight copies
(>= 400 MB) that no weight stays in L2, divided by the number of copies; the best config's largest error
against _scaled_mm's output (both bf16, summed as fp8_linear sums bf16 outputs: fast_accum; fp16 outputs
run the same configs promoted). The last lines are the _TUNED entries where the best beat _scaled_mm by 3%
or more. Results also go to $OUT/fp8_gemm.jsonl (or /tmp), one JSON line each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_skinny_linear import graph_us, model_shapes

from fastllm.kernels import fp8_gemm
from fastllm.kernels.fp8_linear import _scaled_mm, fast_accum
from fastllm.kernels.fp8_quantize import quantize_fp8_per_token

WIN = 0.97  # a config replaces _scaled_mm at 97% of its time or less


def configs() -> list[fp8_gemm.GemmConfig]:
    """Tiles whose pipeline fits in shared memory (stages x (BM + BN) x BK bytes, plus the output tile), with
    a warpgroup (4 warps) for 64 rows and two for more."""
    out = []
    for bm, bn, bk, warps, stages in itertools.product([64, 128, 256], [64, 128, 256], [128, 256], [4, 8],
                                                       [3, 4]):
        smem = stages * (bm + bn) * bk + bm * bn * 2
        if smem <= 220 * 1024 and (warps == 4) == (bm == 64) and bm * bn <= 128 * 256:
            out.append(fp8_gemm.GemmConfig(bm, bn, bk, warps, stages))
    return out


def sweep_shape(name: str, n: int, k: int, rows_list: list[int], out) -> list[str]:
    """Time _scaled_mm and every config at each row count; the _TUNED lines of the configs that win."""
    copies = max(2, (400 << 20) // (n * k))
    weights = [(torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
               for _ in range(copies)]
    scale = torch.rand(n, device="cuda") * 1e-3 + 1e-4
    wins = []
    fast = fast_accum(torch.bfloat16)
    for rows in rows_list:
        x_q, x_scale = quantize_fp8_per_token(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))

        def scaled_mm(x_q=x_q, x_scale=x_scale):
            return [_scaled_mm(x_q, x_scale, w, scale, None, torch.bfloat16, fast_accum=fast)
                    for w in weights]

        def gemm(cfg, x_q=x_q, x_scale=x_scale):
            return [fp8_gemm.launch(x_q, x_scale, w, scale, None, torch.bfloat16, cfg, fast_accum=fast)
                    for w in weights]

        ref = scaled_mm()[0].float()
        base = graph_us(scaled_mm, copies)
        timed = []
        for cfg in configs():
            try:
                got = gemm(cfg)[0].float()
                us = graph_us(lambda cfg=cfg: gemm(cfg), copies)
            except (RuntimeError, triton.runtime.errors.OutOfResources) as e:  # shared memory, registers
                print(f"  {name} {rows} {tuple(cfg)}: {type(e).__name__}", file=sys.stderr)
                continue
            timed.append((us, cfg, ((got - ref).abs().max() / ref.abs().max()).item()))
        timed.sort(key=lambda t: t[0])
        us, cfg, err = timed[0]
        row = {"shape": name, "n": n, "k": k, "rows": rows, "scaled_mm_us": base, "best_us": us,
               "best": list(cfg), "best_err": err, "top5": [[t[0], list(t[1])] for t in timed[:5]]}
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()
        if us <= WIN * base:
            wins.append(f"({fp8_gemm.row_bucket(rows)}, {n}, {k}): GemmConfig{tuple(cfg)},  "
                        f"# {name}: {us:.1f} us against _scaled_mm's {base:.1f}")
    return wins


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--rows", default="64,128,256,512")
    p.add_argument("--shapes", default="qkv,o,gate_up,down")
    args = p.parse_args()
    shapes, _ = model_shapes(args.model)
    rows_list = [int(r) for r in args.rows.split(",")]
    wins = []
    with open(Path(os.environ.get("OUT", "/tmp")) / "fp8_gemm.jsonl", "w") as out:
        for name in args.shapes.split(","):
            wins += sweep_shape(name, *shapes[name], rows_list, out)
            torch.cuda.empty_cache()
    print("\n_TUNED entries (best <= 97% of _scaled_mm):")
    print("\n".join(wins) or "(none)")


if __name__ == "__main__":
    main()
