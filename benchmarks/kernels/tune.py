"""Time every candidate launch config of the three attention-path kernels at Llama-3-8B shapes (GPU only).

    python benchmarks/kernels/tune.py                     # the candidates the kernels can pick (< 3 min)
    python benchmarks/kernels/tune.py --explore           # a wider grid, to revise the candidate lists
    python benchmarks/kernels/tune.py --only decode,kv    # a subset: decode, prefill, kv
    python benchmarks/kernels/tune.py --csv tune.csv

Shapes: 32 q heads, 8 kv heads, head dim 128, bf16, block size 16.
  paged_decode_attention  B1 x 32768, B1 x 4096, B8 x 4096, B64 x 4096, B256 x 512 (every split count and
                          tile config the host table can choose, plus the pre-tuning launch);
                          metric GB/s (bytes_moved) and its fraction of a measured copy bandwidth.
  prefill_attention       8 x 2048, 1 x 8192, 1 x 512, and a chunk of 512 new tokens over a 2048-token
                          cached prefix for 4 requests; the table's tile and its neighbours, TMA and pointer
                          chunk loads;
                          metric TFLOP/s and its fraction of the best torch SDPA backend on the same problem.
  kv_cache_write          T = 1, 64, 512, 8192 into random slots, and 8192 into whole blocks (a prefill's
                          pattern); every candidate of the host table;
                          metric GB/s and fraction of copy bandwidth.
Each config is timed with triton.testing.do_bench (median, L2 flushed; decode and the KV write as one
CUDA-graph replay, as the engine runs them, with the eager time beside it) and checked against a reference
(fp32 or SDPA output for attention, bitwise for the copy); one failing config is reported and skipped.
The last block of the output is the summary: per case the pre-tuning config, what the kernel picks now,
and the fastest candidate.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
if "--dry-run" in sys.argv:  # Triton reads it when first imported, and kbench imports Triton
    os.environ["TRITON_INTERPRET"] = "1"

import kbench  # noqa: E402  (found through the sys.path entry above)

HQ, HKV, D, PAGE = kbench.HQ, kbench.HKV, kbench.HEAD_DIM, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"  # --dry-run: cpu, tiny cases, Triton's interpreter (checks this script, times nothing)
SCALE = D**-0.5


def bench(fn, warmup: int = 5, rep: int = 25) -> float:
    import triton.testing

    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn) -> float:
    """Median ms of one CUDA-graph replay of fn: how the engine runs decode (and the KV write inside it).

    Eager do_bench of a ~0.05 ms two-launch op mostly measures the host's launch overhead racing the L2
    flush (seen: +-30% between runs); a replay costs the host ~nothing."""
    if DEVICE == "cpu":
        return bench(fn)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = bench(graph.replay)
    del graph
    return ms


def copy_bandwidth_gbs() -> float:
    if DEVICE == "cpu":
        return 1.0
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep=100)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / ms / 1e6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Table:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, **row):
        self.rows.append(row)
        cells = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()]
        print("  " + " ".join(cells), flush=True)


def paged_kv(batch: int, seq: int):
    return kbench.paged_kv(batch, seq, PAGE, DEVICE, DTYPE, HKV, D)


contiguous_kv = kbench.contiguous_kv


# ---------------------------------------------------------------- decode
DECODE_CASES = {"B1_ctx32768": (1, 32768), "B1_ctx4096": (1, 4096), "B8_ctx4096": (8, 4096),
                "B64_ctx4096": (64, 4096), "B256_ctx512": (256, 512),
                # the engine's large decode batches: short contexts, many programs, one split
                "B256_ctx256": (256, 256), "B512_ctx192": (512, 192),
                # the decode sweep's contexts (128-token prompts + up to 256 new): lengths off the tile grid
                "B1_ctx330": (1, 330), "B8_ctx200": (8, 200), "B32_ctx200": (32, 200), "B32_ctx330": (32, 330),
                "B256_ctx200": (256, 200), "B256_ctx330": (256, 330)}


def decode_candidates(mod, batch, ctx, sms, explore):
    """(num_splits, block_n, warps, stages, merge_in_kernel, min_split_len) launches to time for one case."""
    legacy = tuple(mod.legacy_config(ctx, batch, HKV, D, sms))[:4]
    chosen = mod.choose_config(ctx, batch, HKV, D, sms, torch.tensor([], dtype=DTYPE).element_size())
    if explore:
        tiles = [(bn, w, s) for bn in (64, 128) for w in (4, 8) for s in (2, 3, 4)]
        tiles += [(bn, w, s) for bn in (16, 32) for w in (2, 4) for s in (2, 3, 4)] + [(64, 2, 2), (64, 4, 1)]
        max_programs = 40 * sms
        splits = [s for s in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
                  if s * 32 <= ctx and batch * HKV * s <= max_programs]
    else:
        tiles = list(mod.TILE_CONFIGS)
        splits = sorted({chosen[0], legacy[0]} | set(mod.split_candidates(ctx, batch, HKV, sms)))
    # The legacy launch merged its splits in a second kernel; the chosen one is also timed that way.
    legacy = (*legacy, False, 0)
    chosen = (*chosen[:4], True, chosen.min_split_len)
    cands = [legacy, chosen] + [(s, *t, True, 0) for s in splits for t in tiles]
    if chosen[0] > 1:
        cands.append((*chosen[:4], False, chosen[5]))
    return list(dict.fromkeys(cands)), legacy, chosen


def run_decode(table: Table, copy_bw: float, explore: bool, sms: int) -> None:
    import torch.nn.functional as F

    from fastllm.kernels import paged_decode_attention as mod

    for case, (batch, ctx) in DECODE_CASES.items():
        print(f"decode {case}", flush=True)
        try:
            key_cache, value_cache, block_tables = paged_kv(batch, ctx)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
            query = torch.randn(batch, HQ, D, device=DEVICE, dtype=DTYPE)
            k, v = contiguous_kv(key_cache, value_cache, block_tables, ctx)
            q = query.unsqueeze(2)
            ref = torch.cat([F.scaled_dot_product_attention(q[i:i + 8].float(), k[i:i + 8].float(),
                                                            v[i:i + 8].float(), scale=SCALE, enable_gqa=True)
                             for i in range(0, batch, 8)]).squeeze(2)
        except Exception as e:  # noqa: BLE001
            table.add(kernel="decode", case=case, config="setup", error=f"{type(e).__name__}: {e}"[:160])
            continue
        cands, legacy, chosen = decode_candidates(mod, batch, ctx, sms, explore)
        for cand in cands:
            splits, bn, w, s, merge_in_kernel, min_split_len = cand
            tag = ("legacy+chosen" if cand == legacy == chosen else "legacy" if cand == legacy
                   else "chosen" if cand == chosen else "")
            name = (f"splits={splits} BN={bn} w={w} s={s}" + ("" if merge_in_kernel else " two-pass")
                    + (f" min={min_split_len}" if min_split_len else ""))
            try:
                fn = lambda: mod.paged_decode_attention_splits(  # noqa: E731
                    query, key_cache, value_cache, block_tables, seq_lens, ctx, SCALE, splits,
                    block_n=bn, num_warps=w, num_stages=s, merge_in_kernel=merge_in_kernel,
                    min_split_len=min_split_len)
                err = rel_err(fn(), ref)
                ms = bench_graph(fn)
                gbs = mod.bytes_moved(query, key_cache, batch * ctx, splits) / ms / 1e6
                table.add(kernel="decode", case=case, config=name, tag=tag, ms=ms, GBs=gbs,
                          frac=gbs / copy_bw, err=err, bad=err > 2e-2, eager_ms=bench(fn))
            except Exception as e:  # noqa: BLE001
                table.add(kernel="decode", case=case, config=name, tag=tag, error=f"{type(e).__name__}: {e}"[:160])
        if batch <= 8:
            for impl, backend in _sdpa_backends().items():
                try:
                    from torch.nn.attention import sdpa_kernel

                    def fn(backend=backend):
                        with sdpa_kernel([backend]):
                            return F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True)

                    fn()
                    eager = bench(fn)
                    try:
                        ms = bench_graph(fn)
                    except Exception:  # noqa: BLE001  (a backend that cannot be captured: eager time)
                        ms = eager
                    gbs = mod.bytes_moved(query, key_cache, batch * ctx, 1) / ms / 1e6
                    table.add(kernel="decode", case=case, config=impl, tag="torch", ms=ms, GBs=gbs,
                              frac=gbs / copy_bw, eager_ms=eager)
                except Exception as e:  # noqa: BLE001
                    table.add(kernel="decode", case=case, config=impl, tag="torch",
                              error=f"{type(e).__name__}: {e}"[:120])
        del key_cache, value_cache, k, v, ref
        torch.cuda.empty_cache()


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


# ---------------------------------------------------------------- prefill
PREFILL_CASES = {  # name -> (batch, new tokens, cached prefix)
    "B8_S2048": (8, 2048, 0),
    "B1_S8192": (1, 8192, 0),
    "B1_S512": (1, 512, 0),
    "B4_chunk512_ctx2048": (4, 512, 2048),
}


def prefill_configs(explore: bool):
    """PrefillConfigs to time: the table's choice and its neighbours, or (explore) a wider grid."""
    from fastllm.kernels.prefill_attention import PrefillConfig, choose_config

    chosen = choose_config(D, HQ // HKV, DTYPE)
    if not explore:
        return [chosen, PrefillConfig(64, 64, 4, 2), PrefillConfig(128, 64, 4, 2), PrefillConfig(128, 128, 8, 3)]
    out = [chosen]
    for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        if (bm == 128 and bn == 128 and w == 4) or (bn == 128 and s == 4):
            continue  # register-starved (spills) / over the shared-memory limit
        if PrefillConfig(bm, bn, w, s) != chosen:
            out.append(PrefillConfig(bm, bn, w, s))
    return out


def run_prefill(table: Table, explore: bool) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from fastllm.kernels import prefill_attention as mod

    for case, (batch, new, prefix) in PREFILL_CASES.items():
        print(f"prefill {case}", flush=True)
        seq = new + prefix
        try:
            args = kbench.prefill_problem(batch, new, prefix, PAGE, DEVICE, DTYPE, HQ, HKV, D)
            query, key, value, key_cache, value_cache, block_tables = args[:6]
            n_flops = mod.flops([new] * batch, [seq] * batch, HQ, D)
            k, v = contiguous_kv(key_cache, value_cache, block_tables, seq)
            q = query.reshape(batch, new, HQ, D).transpose(1, 2).contiguous()
        except Exception as e:  # noqa: BLE001
            table.add(kernel="prefill", case=case, config="setup", error=f"{type(e).__name__}: {e}"[:160])
            continue
        # SDPA baselines, and the reference output (fp32 math is too slow at these sizes: the first bf16
        # backend that runs is the reference; ours and it differ by bf16 rounding, ~3e-3)
        ref, best_sdpa = None, None
        mask = None
        if prefix:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(new, seq)
        for impl, backend in _sdpa_backends().items():
            def fn(backend=backend):
                with sdpa_kernel([backend]):
                    if mask is None:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
            try:
                out = fn()
                ms = bench(fn)
                ref = out if ref is None else ref
                best_sdpa = ms if best_sdpa is None else min(best_sdpa, ms)
                table.add(kernel="prefill", case=case, config=impl, tag="torch", ms=ms,
                          TFLOPs=n_flops / ms / 1e9)
            except Exception as e:  # noqa: BLE001
                table.add(kernel="prefill", case=case, config=impl, tag="torch", error=f"{type(e).__name__}: {e}"[:120])
        if ref is not None:
            ref = ref.transpose(1, 2).reshape(batch * new, HQ, D)

        full = (*args, new, SCALE)
        chosen = mod.choose_config(D, HQ // HKV, DTYPE)
        tma_ok = mod.use_chunk_tma(key, value)
        tma_chosen = tma_ok and mod._tma_pays(batch * new)  # what the engine would run
        for cfg, tma in [(c, t) for c in prefill_configs(explore) for t in ((True, False) if tma_ok else (False,))]:
            name = _cfg_name(cfg) + (" tma" if tma else " ptr")
            tag = "chosen" if cfg == chosen and tma == tma_chosen else ""
            try:
                fn = lambda: mod.prefill_attention_config(*full, config=cfg, chunk_tma=tma)  # noqa: E731
                out = fn()
                ref = out if ref is None else ref
                err = rel_err(out, ref)
                ms = bench(fn)
                table.add(kernel="prefill", case=case, config=name, tag=tag, ms=ms, TFLOPs=n_flops / ms / 1e9,
                          frac=(best_sdpa / ms) if best_sdpa else float("nan"), err=err, bad=err > 2e-2)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                table.add(kernel="prefill", case=case, config=name, tag=tag, error=f"{type(e).__name__}: {e}"[:160])
        del args, key_cache, value_cache, k, v, q
        torch.cuda.empty_cache()


def _cfg_name(cfg) -> str:
    return f"BM={cfg.block_m} BN={cfg.block_n} w={cfg.num_warps} s={cfg.num_stages}"


# ---------------------------------------------------------------- kv write
KV_CASES = {"T1": 1, "T64": 64, "T512": 512, "T8192": 8192, "T8192_whole_blocks": 8192}
KV_BLOCKS = 8192


def run_kv(table: Table, copy_bw: float, explore: bool) -> None:
    from fastllm.kernels import kv_cache_write as mod
    from fastllm.kernels import reference

    for case, num_tokens in KV_CASES.items():
        print(f"kv_cache_write {case}", flush=True)
        key = torch.randn(num_tokens, HKV, D, device=DEVICE, dtype=DTYPE)
        value = torch.randn_like(key)
        key_cache = torch.zeros(KV_BLOCKS, PAGE, HKV, D, device=DEVICE, dtype=DTYPE)
        value_cache = torch.zeros_like(key_cache)
        if case.endswith("whole_blocks"):  # a prefill's real pattern: whole blocks, in random block order
            blocks = torch.randperm(KV_BLOCKS, device=DEVICE)[: -(-num_tokens // PAGE)]
            slots = (blocks[:, None] * PAGE + torch.arange(PAGE, device=DEVICE)).flatten()[:num_tokens]
        else:  # the benchmark's worst case: every token in a random slot
            slots = torch.randperm(KV_BLOCKS * PAGE, device=DEVICE)[:num_tokens]
        ref_k, ref_v = key_cache.clone(), value_cache.clone()
        reference.kv_cache_write(key, value, ref_k, ref_v, slots)
        nbytes = mod.bytes_moved(key, key_cache, slots, num_tokens)
        chosen = mod.choose_config(num_tokens, HKV * D * key.element_size())
        if explore:
            cands = [mod.KVWriteConfig(t, w) for t in (1, 2, 4, 8, 16, 32) for w in (1, 2, 4, 8)]
        else:
            cands = list(mod.CANDIDATES)
        cands = list(dict.fromkeys([mod.LEGACY_CONFIG, chosen] + cands))
        for cfg in cands:
            tag = "legacy" if cfg == mod.LEGACY_CONFIG else "chosen" if cfg == chosen else ""
            if cfg == mod.LEGACY_CONFIG and cfg == chosen:
                tag = "legacy+chosen"
            name = f"tokens/prog={cfg.block_t} w={cfg.num_warps}"
            try:
                key_cache.zero_()
                value_cache.zero_()
                fn = lambda: mod.kv_cache_write_config(key, value, key_cache, value_cache, slots, config=cfg)  # noqa: E731
                fn()
                ok = torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
                ms = bench_graph(fn)
                gbs = nbytes / ms / 1e6
                table.add(kernel="kv_write", case=case, config=name, tag=tag, ms=ms, GBs=gbs, frac=gbs / copy_bw,
                          bad=not ok, eager_ms=bench(fn))
            except Exception as e:  # noqa: BLE001
                table.add(kernel="kv_write", case=case, config=name, tag=tag, error=f"{type(e).__name__}: {e}"[:160])
        for impl, fn in {
            "torch_index_copy": lambda: (key_cache.view(-1, HKV, D).index_copy_(0, slots, key),
                                         value_cache.view(-1, HKV, D).index_copy_(0, slots, value)),
        }.items():
            ms = bench_graph(fn)
            table.add(kernel="kv_write", case=case, config=impl, tag="torch", ms=ms, GBs=nbytes / ms / 1e6,
                      frac=nbytes / ms / 1e6 / copy_bw, eager_ms=bench(fn))
        del key_cache, value_cache, ref_k, ref_v
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- summary
def summary(table: Table) -> str:
    lines = ["", "=" * 100,
             "SUMMARY  ms: decode and kv_write = one CUDA-graph replay (as the engine runs them), prefill = eager;",
             "         (x) = fraction of the measured copy bandwidth (decode, kv_write) / of the best torch SDPA (prefill)"]
    cases: dict[tuple, list[dict]] = {}
    for r in table.rows:
        cases.setdefault((r["kernel"], r["case"]), []).append(r)
    for (kernel, case), rows in cases.items():
        ours = [r for r in rows if "ms" in r and r.get("tag") != "torch" and not r.get("bad")]
        torch_rows = [r for r in rows if "ms" in r and r.get("tag") == "torch"]
        bad = [r for r in rows if r.get("bad")]
        errors = [r for r in rows if "error" in r and r.get("tag") != "torch"]
        if not ours:
            lines.append(f"{kernel:8s} {case:22s} no successful config ({len(errors)} errors)")
            continue
        best = min(ours, key=lambda r: r["ms"])
        legacy = next((r for r in ours if "legacy" in str(r.get("tag"))), None)
        chosen = next((r for r in ours if "chosen" in str(r.get("tag"))), None)

        def fmt(r):
            if r is None:
                return "-"
            metric = r.get("frac")
            extra = f" {r['TFLOPs']:.0f}TF" if "TFLOPs" in r else ""
            m = f" ({metric:.2f}{extra})" if metric is not None else extra
            return f"{r['ms']:.4f}{m}"

        tb = min(torch_rows, key=lambda r: r["ms"]) if torch_rows else None
        lines.append(f"{kernel:8s} {case:22s} legacy {fmt(legacy):22s} chosen {fmt(chosen):22s} "
                     f"best {fmt(best):22s} [{best['config']}]"
                     + (f"  torch {tb['ms']:.4f} ({tb['config']})" if tb else "")
                     + (f"  BAD={len(bad)}" if bad else "") + (f"  ERR={len(errors)}" if errors else ""))
    return "\n".join(lines)


def _dry_run_setup() -> None:
    global DEVICE, DTYPE, HQ, HKV, D, KV_BLOCKS, SCALE
    assert os.environ.get("TRITON_INTERPRET") == "1", "set at import, before Triton's"
    DEVICE, DTYPE, HQ, HKV, D, KV_BLOCKS = "cpu", torch.float16, 8, 2, 64, 64
    SCALE = D**-0.5
    DECODE_CASES.clear()
    DECODE_CASES.update({"B1_ctx300": (1, 300), "B3_ctx40": (3, 40)})
    PREFILL_CASES.clear()
    PREFILL_CASES.update({"B2_S40": (2, 40, 0), "B2_chunk16_ctx40": (2, 16, 40)})
    KV_CASES.clear()
    KV_CASES.update({"T1": 1, "T37": 37})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--explore", action="store_true", help="time a wider grid than the kernels' candidates")
    parser.add_argument("--only", default="decode,prefill,kv")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny cases")
    args = parser.parse_args()
    if args.dry_run:
        _dry_run_setup()
    elif not torch.cuda.is_available():
        print("tune.py: needs a CUDA GPU")
        return 1
    import triton

    torch.manual_seed(0)
    start = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 4
    copy_bw = copy_bandwidth_gbs()
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (dry run)"
    print(f"{gpu} | {sms} SMs | torch {torch.__version__} | triton {triton.__version__} | "
          f"copy bandwidth {copy_bw:.0f} GB/s (read + write)", flush=True)
    if args.cases:
        wanted = set(args.cases.split(","))
        for cases in (DECODE_CASES, PREFILL_CASES, KV_CASES):
            for name in [c for c in cases if c not in wanted]:
                del cases[name]
    table = Table()
    only = set(args.only.split(","))
    for name, fn in (("kv", lambda: run_kv(table, copy_bw, args.explore)),
                     ("decode", lambda: run_decode(table, copy_bw, args.explore, sms)),
                     ("prefill", lambda: run_prefill(table, args.explore))):
        if name not in only:
            continue
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            table.add(kernel=name, case="*", config="*", error=f"{type(e).__name__}: {e}"[:160])
        print(f"[{name}: {time.time() - t0:.1f} s]", flush=True)
    if args.csv:
        import csv

        keys = sorted({k for r in table.rows for k in r})
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(table.rows)
    print(summary(table))
    print(f"total {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
