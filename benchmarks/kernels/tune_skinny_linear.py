"""Time skinny_linear's launch configs against cuBLAS at a model's projection shapes (GPU only).

    python benchmarks/kernels/tune_skinny_linear.py shapes [--rows 1,8]   # per projection, every config
    python benchmarks/kernels/tune_skinny_linear.py shapes --model qwen3-0.6b  # another model's shapes
    python benchmarks/kernels/tune_skinny_linear.py chain  [--rows 1,8]   # a decode step's projections
    python benchmarks/kernels/tune_skinny_linear.py shapes --fp8          # fp8_skinny_linear's configs
    python benchmarks/kernels/tune_skinny_linear.py chain --fp8           # the step with e4m3 projections
    python benchmarks/kernels/tune_skinny_linear.py shapes --split-k 1,2,4  # K split over 1, 2, 4 programs
    python benchmarks/kernels/tune_skinny_linear.py shapes --shapes o,down  # only these projections
    python benchmarks/kernels/tune_skinny_linear.py shapes --gated        # gate_up, the SiLU in its epilogue

Results go to $OUT/skinny_<phase>.jsonl (or /tmp), one JSON line each, as they are measured.

shapes: per shape (qkv, o, gate_up, down, lm_head) and row count, cuBLAS F.linear, the table's config and
  every config of the kernel, timed as a CUDA-graph replay over enough weight copies (>= 400 MB) that no
  weight stays in L2, divided by the number of copies. fastllm/kernels/skinny_linear.py holds the results
  and the table.
  --fp8: the e4m3 weight-streaming kernel (fp8_skinny_linear.py) over e4m3 weights, its configs with twice
  the BLOCK_K (the same bytes a load as bf16's), against cuBLAS bf16 and torch._scaled_mm.
  --gated: gate_up as a gated launch (silu(gate) * up in the epilogue), the table's gated config and every
  config of the sweep (unsplit), against cuBLAS and the projection's own config, each with the SiLU kernel
  after it; skinny_linear._GATED_TUNED holds the results.
chain: the 32 layers' projections of one decode step with their norms and SiLU (attention left out) and
  the final norm + lm_head, as one CUDA graph: our norm / SiLU kernels with cuBLAS against the same with
  skinny_linear (configs from --table, a shapes run's jsonl, else choose_config), with and without PDL
  early triggers (FASTLLM_PDL=trigger: all our kernels) and the L2 weight prefetch (CHAIN_VARIANTS).
  The fused columns: the unfolded model's fused ops (add_rms_norm_linear and add_rms_norm_gated_linear:
  the norm in the loads of the projection after it where they fuse, the SiLU in gate_up's epilogue), plain
  PDL and triggers; the folded columns: the model's ops with its norms folded (qkv and gate/up scaled by 1 /
  rms, o and down adding the residual stream in their epilogues: no norm or add launches).
  --fp8: e4m3 projections (the quantizing norms and SiLU before them, o's input quantized by its own
  launch above one row, as the FP8 model runs them) and the bf16 lm_head; no cuBLAS column.
  --max-stages N caps every config's pipeline stages, to test whether shared memory kept the next
  projection's programs (early under PDL triggers, to prefetch) from starting beside the current one (an
  Llama-3.1-8B e4m3 program at 32 rows takes 96-120 KB of an SM's 228 KB with 4-5 stages): at 4 and 3
  stages every variant was slower and prefetching still lost (docs/fp8.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastllm.config import resolve_model_path  # noqa: E402
from fastllm.kernels import fp8_skinny_linear, pdl  # noqa: E402
from fastllm.kernels.fp8_quantize import quantize_fp8_per_token  # noqa: E402
from fastllm.kernels import skinny_linear as S  # noqa: E402
from fastllm.kernels.fused_add_rms_norm import fused_add_rms_norm, fused_add_rms_norm_fp8  # noqa: E402
from fastllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_fp8  # noqa: E402

DT = torch.bfloat16
EPS = 1e-5


def model_shapes(model: str) -> tuple[dict[str, tuple[int, int]], int]:
    """(N, K) of each projection of a model (a directory or embedded name), and its layer count."""
    config = json.loads((Path(resolve_model_path(model)) / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * config["intermediate_size"], hidden),
            "down": (hidden, config["intermediate_size"]), "lm_head": (config["vocab_size"], hidden)}, \
        config["num_hidden_layers"]


def graph_us(fn, per_replay: int) -> float:
    """Median of 7 replays of a CUDA graph of fn, in us per `per_replay`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_replay)
    return sorted(times)[3]


def configs(rows: int, element_size: int = 2, splits: tuple[int, ...] = (1,)) -> list[S.Config]:
    """The sweep, BLOCK_K in elements scaled to the same bytes a load as bf16's, each at every split of K;
    the bf16 kernel's dot also swapped where BLOCK_N reaches a wgmma's M (the e4m3 kernel swaps by its output
    dtype)."""
    widen = 2 // element_size
    dot = [S.Config(bn, bk * widen, w, st, True) for bn, bk, w, st in
           itertools.product([16, 32, 64, 128], [128, 256, 512], [4, 8], [3, 4, 5]) if bn * bk <= 32768]
    if element_size == 2 and rows > 1:
        dot += [cfg._replace(swap_ab=True) for cfg in dot if cfg.block_n >= 64]
    fma = [S.Config(bn, bk * widen, w, st, False) for bn, bk, w, st in
           itertools.product([8, 16, 32], [512, 1024], [4, 8], [2, 3]) if bn * bk * rows <= 16384]
    return [cfg._replace(split_k=split) for cfg in dot + (fma if rows <= 2 else []) for split in splits]


def emit(out, row: dict) -> None:
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()


def run_shapes(shapes: dict, rows_list: list[int], out, fp8: bool = False,
               splits: tuple[int, ...] = (1,), gated: bool = False) -> None:
    for name, (n, k) in shapes.items():
        nbytes = 1 if fp8 else 2
        copies = max(2, (400 << 20) // (n * k * nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=DT) * k ** -0.5 for _ in range(copies)]
        if fp8:  # e4m3 weights with per-channel scales; bf16 cuBLAS times its own copies
            scales = [w.abs().amax(dim=1).float().clamp(min=1e-12) / 448 for w in weights]
            quantized = [(w / s[:, None].to(DT)).to(torch.float8_e4m3fn) for w, s in zip(weights, scales)]
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=DT)
            act = silu_and_mul if gated else (lambda y: y)  # (the SiLU kernel after the unfused projections)
            row = {"shape": name, "rows": rows, "fp8": fp8, "gated": gated,
                   "cublas_us": graph_us(lambda: [act(F.linear(x, w)) for w in weights], copies)}
            if fp8:
                def scaled_mm():
                    q, x_scale = quantize_fp8_per_token(x)
                    return [torch._scaled_mm(q, w.t(), scale_a=x_scale, scale_b=s.view(1, -1), out_dtype=DT)
                            for w, s in zip(quantized, scales)]
                row["scaled_mm_us"] = graph_us(scaled_mm, copies)
            if not fp8:  # the table's choice, the sweep's baseline (gated: the pair's too)
                chosen = S.gated_config(rows, n // 2, k) if gated else S.choose_config(rows, n, k)
                run = lambda: [S.launch(x, w, config=chosen, gated=gated) for w in weights]  # noqa: E731
                row["chosen_us"] = graph_us(run, copies)
                row["chosen_cfg"] = list(chosen)
                if gated:
                    pair = S.choose_config(rows, n, k)
                    run = lambda: [act(S.launch(x, w, config=pair)) for w in weights]  # noqa: E731
                    row["pair_us"] = graph_us(run, copies)
            timed = []
            for cfg in configs(rows, nbytes, splits):
                if fp8:
                    run = lambda: [fp8_skinny_linear.launch(x, q, s, config=cfg) for q, s in zip(quantized, scales)]  # noqa: E731
                else:
                    run = lambda: [S.launch(x, w, config=cfg, gated=gated) for w in weights]  # noqa: E731
                try:
                    timed.append((graph_us(run, copies), cfg))
                except Exception as e:  # out of shared memory / registers: skip the config
                    print(f"skip {name} {rows} {cfg}: {type(e).__name__}", file=sys.stderr)
            timed.sort(key=lambda t: t[0])
            row["best_us"], row["best_cfg"] = timed[0][0], list(timed[0][1])
            row["top5"] = [(round(t, 2), list(c)) for t, c in timed[:5]]
            emit(out, row)
        weights = quantized = scales = None  # free before the next shape
        torch.cuda.empty_cache()


# chain's variants: (PDL early triggers, the share of each program's K prefetched into L2 before the PDL wait)
CHAIN_VARIANTS = ((False, 0.0), (False, 1.0), (True, 0.0), (True, 0.25), (True, 0.5), (True, 1.0))


def run_chain(shapes: dict, num_layers: int, rows_list: list[int], table: dict, out, fp8: bool = False,
              max_stages: int | None = None) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=DT, generator=g) * 0.02  # noqa: E731
    layers = [{name: rand(*shapes[name]) for name in ("qkv", "o", "gate_up", "down")} for _ in range(num_layers)]
    if fp8:  # e4m3 weights with per-channel scales, as (weight, scale)
        for layer in layers:
            for name, w in layer.items():
                scale = w.abs().amax(dim=1).float().clamp(min=1e-12) / 448
                layer[name] = ((w / scale[:, None].to(DT)).to(torch.float8_e4m3fn), scale)
    hidden_size, q_size = shapes["o"]
    lm_head, nw = rand(*shapes["lm_head"]), torch.ones(hidden_size, device="cuda", dtype=DT)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def capped(cfg: S.Config) -> S.Config:  # --max-stages: less shared memory a program
        return cfg._replace(num_stages=min(cfg.num_stages, max_stages)) if max_stages else cfg

    act = silu_and_mul_fp8 if fp8 else silu_and_mul  # FP8: (x_q, x_scale), as add_norm

    def add_norm(h, res):  # FP8: ((x_q, x_scale), residual), quantized for the projection after it
        if fp8:
            q, scale, res = fused_add_rms_norm_fp8(h, res, nw, EPS)
            return (q, scale), res
        return fused_add_rms_norm(h, res, nw, EPS)

    def fused_step(layers, hidden):
        """step() through the model's fused ops: the norm in the loads of the projection after it where they
        fuse (skinny_linear._fuses), else apart, as in step(); the SiLU in gate_up's epilogue."""
        h, res = hidden, hidden
        for layer in layers:
            qkv, res = S.add_rms_norm_linear(h, res, nw, EPS, layer["qkv"], None)
            h = S.launch(qkv[:, :q_size].contiguous(), layer["o"])
            act, res = S.add_rms_norm_gated_linear(h, res, nw, EPS, layer["gate_up"])
            h = S.linear(act, layer["down"], None)
        S.launch(fused_add_rms_norm(h, res, nw, EPS)[0], lm_head)  # as the model: the lm_head unfused

    def folded_step(layers, hidden):
        """step() as a model with folded norms runs it: qkv and gate/up scale by 1 / rms (the norm's weight
        in their columns: a unit one here), o and down add the residual stream in their epilogues."""
        h = hidden
        for layer in layers:
            qkv = S.rms_norm_folded_linear(h, nw, EPS, layer["qkv"], None)
            h = S.linear_add(qkv[:, :q_size].contiguous(), layer["o"], None, h)
            act = S.rms_norm_folded_gated_linear(h, nw, EPS, layer["gate_up"])
            h = S.linear_add(act, layer["down"], None, h)
        S.launch(fused_add_rms_norm(h, h, nw, EPS)[0], lm_head)

    for rows in rows_list:
        hidden = rand(rows, hidden_size)

        def step(proj):
            h, res = hidden, hidden
            for layer in layers:
                a, res = add_norm(h, res)
                qkv = proj("qkv", a, layer["qkv"])
                h = proj("o", qkv[:, :q_size].contiguous(), layer["o"])
                a, res = add_norm(h, res)
                h = proj("down", act(proj("gate_up", a, layer["gate_up"])), layer["down"])
            a, _ = fused_add_rms_norm(h, res, nw, EPS)
            proj("lm_head", a, lm_head)

        set_pdl("1")
        row = {"rows": rows, "fp8": fp8, "max_stages": max_stages}
        if not fp8:
            row["cublas_ms"] = graph_us(lambda: step(lambda name, a, w: F.linear(a, w)), 1) / 1e3
        for trigger, share in CHAIN_VARIANTS:
            set_pdl("trigger" if trigger else "1")  # every one of our kernels lets the next launch early

            def proj(name, a, w):
                if isinstance(w, tuple):  # e4m3: a is (x_q, x_scale) from a quantizing kernel, or 16-bit
                    quantized = isinstance(a, tuple)
                    n, k = w[0].shape
                    cfg = capped(fp8_skinny_linear.choose_config(rows, n, k, quantized, num_sms))
                    cfg = cfg._replace(prefetch_k=int(share * k / cfg.split_k))
                    if quantized:
                        return fp8_skinny_linear.launch_quantized(*a, *w, None, DT, config=cfg)
                    return fp8_skinny_linear.launch(a, *w, config=cfg)
                cfg = capped(table.get((name, rows)) or S.choose_config(rows, *w.shape))
                return S.launch(a, w, config=cfg._replace(prefetch_k=int(share * w.shape[1] / cfg.split_k)))
            row[f"skinny_trigger{int(trigger)}_prefetch{share}_ms"] = graph_us(lambda: step(proj), 1) / 1e3
        if not fp8:
            for trigger in (False, True):
                set_pdl("trigger" if trigger else "1")
                row[f"fused_trigger{int(trigger)}_ms"] = graph_us(lambda: fused_step(layers, hidden), 1) / 1e3
                folded_ms = graph_us(lambda: folded_step(layers, hidden), 1) / 1e3
                row[f"folded_trigger{int(trigger)}_ms"] = folded_ms
        set_pdl("1")
        emit(out, row)


def set_pdl(setting: str) -> None:
    os.environ["FASTLLM_PDL"] = setting
    pdl._mode.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["shapes", "chain"])
    parser.add_argument("--model", default="llama-3.1-8b", help="whose projection shapes (default: llama-3.1-8b)")
    parser.add_argument("--rows", default="1,8,16,32")
    parser.add_argument("--table", help="a shapes run's jsonl: the best config per (shape, rows) for chain")
    parser.add_argument("--fp8", action="store_true", help="the e4m3 kernel (fp8_skinny_linear.py)")
    parser.add_argument("--split-k", default="1", help="shapes: splits of K to sweep, e.g. 1,2,4 (default 1)")
    parser.add_argument("--shapes", help="shapes: only these projections, e.g. o,down (default: all five)")
    parser.add_argument("--gated", action="store_true", help="shapes: gate_up as a gated launch (the SiLU in "
                        "its epilogue)")
    parser.add_argument("--max-stages", type=int, help="chain: at most this many pipeline stages a config (a "
                        "program then leaves the next kernel's room in shared memory to start beside it)")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    table = {}
    if args.table:
        for line in open(args.table):
            r = json.loads(line)
            table[(r["shape"], r["rows"])] = S.Config(*r["best_cfg"])
    if args.max_stages is not None and args.phase != "chain":
        parser.error("--max-stages caps the chain's configs only")
    if args.gated and (args.phase != "shapes" or args.fp8 or args.split_k != "1"
                       or args.shapes not in (None, "gate_up")):
        parser.error("--gated sweeps gate_up's bf16 shapes, unsplit (phase shapes; no --fp8, --split-k or "
                     "other --shapes)")
    if args.gated:
        args.shapes = "gate_up"
    shapes, num_layers = model_shapes(args.model)
    if args.shapes:
        unknown = set(args.shapes.split(",")) - set(shapes)
        if unknown:
            parser.error(f"--shapes: unknown projections {sorted(unknown)}; known: {sorted(shapes)}")
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    tag = Path(resolve_model_path(args.model)).name.lower()
    variant = "_fp8" if args.fp8 else "_gated" if args.gated else ""
    path = Path(os.environ.get("OUT", "/tmp")) / f"skinny_{args.phase}_{tag}{variant}.jsonl"
    with open(path, "w") as out:
        if args.phase == "shapes":
            splits = tuple(int(k) for k in args.split_k.split(","))
            run_shapes(shapes, rows_list, out, args.fp8, splits, args.gated)
        else:
            run_chain(shapes, num_layers, rows_list, table, out, args.fp8, args.max_stages)


if __name__ == "__main__":
    main()
