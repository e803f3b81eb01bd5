"""Shared pieces of the kernel micro-benchmarks (GPU only).

Every benchmark times with triton.testing.do_bench (median of CUDA-event timings, L2 flushed between
runs) and reports achieved bandwidth against a copy bandwidth measured once per process:
a device-to-device copy of 1 GiB, counting read + write bytes.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `import fastllm`

# Llama-3-8B
HQ, HKV, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 14336
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a variable only so that a CPU dry run of the scripts can swap it


def paged_kv(batch: int, seq: int, page: int = 16, device=None, dtype=None, num_kv_heads: int = HKV,
             head_dim: int = HEAD_DIM):
    """Random K/V for `batch` requests of `seq` tokens behind a permuted block table:
    (key_cache, value_cache [num_blocks, page, Hkv, D], block_tables [batch, blocks per request])."""
    device, dtype = device or DEVICE, dtype or DTYPE
    per_seq = -(-seq // page)
    num_blocks = batch * per_seq
    key_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, per_seq).int()
    return key_cache, value_cache, block_tables


def fused_qkv(num_tokens: int, num_q_heads: int = HQ, num_kv_heads: int = HKV, head_dim: int = HEAD_DIM,
              device=None, dtype=None):
    """Random q [T, Hq, D], k and v [T, Hkv, D] as the model has them: views of one qkv projection output."""
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, device=device or DEVICE,
                      dtype=dtype or DTYPE)
    return qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)


def rotary_inputs(num_tokens: int, max_pos: int, head_dim: int = HEAD_DIM):
    """Random positions [T] below max_pos and a random float32 cos/sin table [max_pos, D]."""
    positions = torch.randint(0, max_pos, (num_tokens,), device=DEVICE)
    return positions, torch.randn(max_pos, head_dim, device=DEVICE, dtype=torch.float32)


def prefill_problem(batch: int, new: int, prefix: int = 0, page: int = 16, device=None, dtype=None,
                    num_q_heads: int = HQ, num_kv_heads: int = HKV, head_dim: int = HEAD_DIM):
    """`batch` requests of `prefix` cached tokens plus `new` tokens computed this step, laid out as the model
    has them: q, k, v are slices of one qkv projection output [T, Hq + 2 Hkv, D], and k, v are already
    written to the paged cache. Returns (query, key, value, key_cache, value_cache, block_tables, seq_lens,
    query_start_loc): prefill_attention's arguments up to max_query_len and scale."""
    device, dtype = device or DEVICE, dtype or DTYPE
    seq = prefix + new
    key_cache, value_cache, block_tables = paged_kv(batch, seq, page, device, dtype, num_kv_heads, head_dim)
    query, key, value = fused_qkv(batch * new, num_q_heads, num_kv_heads, head_dim, device, dtype)
    pos = torch.arange(prefix, seq, device=device)
    slots = (block_tables[:, pos // page].long() * page + pos % page).reshape(-1)  # [batch * new]
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = key
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = value
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=device)
    return query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc


def contiguous_kv(key_cache, value_cache, block_tables, seq: int):
    """The same K/V laid out contiguously per request, [batch, HKV, seq, HEAD_DIM], for torch's SDPA."""
    batch, (num_kv_heads, head_dim) = block_tables.shape[0], key_cache.shape[2:]

    def gather(cache):
        return cache[block_tables.long()].reshape(batch, -1, num_kv_heads, head_dim)[:, :seq].transpose(1, 2).contiguous()

    return gather(key_cache), gather(value_cache)


def cuda_ok() -> bool:
    return torch.cuda.is_available()


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def time_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _copy_ms(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src))


@functools.lru_cache(maxsize=None)
def copy_bandwidth_gbs() -> float:
    """Achieved GB/s of a 1 GiB device-to-device copy (read + write bytes)."""
    ms = _copy_ms(1 << 30)
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / ms / 1e6


def row(kernel: str, case: str, impl: str, ms: float, nbytes: float | None = None, flops: float | None = None,
        **extra) -> dict:
    """One result row: time, GB/s (and fraction of copy bandwidth), TFLOP/s where given."""
    r = {"kernel": kernel, "case": case, "impl": impl, "ms": round(ms, 4)}
    if nbytes is not None:
        gbs = nbytes / ms / 1e6
        r["GB/s"] = round(gbs, 1)
        r["frac_copy_bw"] = round(gbs / copy_bandwidth_gbs(), 3)
    if flops is not None:
        r["TFLOP/s"] = round(flops / ms / 1e9, 1)
    r.update(extra)
    return r


def add_speedups(rows: list[dict]) -> list[dict]:
    """speedup = best baseline time / ours, per (kernel, case); 'ours' is the impl named 'triton'."""
    by_case: dict[tuple, list[dict]] = {}
    for r in rows:
        by_case.setdefault((r["kernel"], r["case"]), []).append(r)
    for group in by_case.values():
        ours = [r for r in group if r["impl"] == "triton" and r.get("ms") is not None]
        base = [r["ms"] for r in group if r["impl"] != "triton" and r.get("ms") is not None]
        if ours and base:
            ours[0]["speedup_vs_torch_best"] = round(min(base) / ours[0]["ms"], 2)
    return rows


def try_row(rows: list[dict], kernel: str, case: str, impl: str, make_row) -> None:
    """Append make_row()'s row, or one saying why it failed: one broken baseline never sinks a benchmark."""
    try:
        rows.append(make_row())
    except Exception as e:  # noqa: BLE001 (e.g. an SDPA backend that rejects the shape)
        rows.append({"kernel": kernel, "case": case, "impl": impl, "error": f"{type(e).__name__}: {e}"[:200]})


def run_cases(kernel: str, cases: dict) -> list[dict]:
    """cases: name -> measure() returning (rows, ours_fn). Each case is isolated from the others' failures."""
    rows: list[dict] = []
    for name, measure in cases.items():
        try:
            rows += measure()[0]
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"[:200]
            rows.append({"kernel": kernel, "case": name, "impl": "triton", "error": error})
        torch.cuda.empty_cache()
    return add_speedups(rows)


def sdpa_backends() -> dict:
    """impl name -> torch SDPA backend; each is tried on its own (a backend may reject a shape)."""
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa_rows(rows: list[dict], kernel: str, case: str, q, k, v, *, causal: bool, scale: float,
              nbytes: float | None = None, flops: float | None = None, check=None) -> None:
    """Time torch SDPA, backend by backend, on contiguous q [B, Hq, S, D], k/v [B, Hkv, S, D].

    GQA goes through enable_gqa; a backend that rejects it gets K/V expanded to Hq heads instead
    (impl '<backend>_expanded', which reads Hq/Hkv times more K/V). check(out) -> a number to record.
    """
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    group = q.shape[1] // k.shape[1]
    for name, backend in sdpa_backends().items():
        def make(name=name, backend=backend):
            with sdpa_kernel([backend]):
                try:
                    fn = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal,
                                           scale=scale, enable_gqa=True)
                    out, impl = fn(), name
                except RuntimeError:
                    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                    fn = functools.partial(F.scaled_dot_product_attention, q, ke, ve, is_causal=causal,
                                           scale=scale)
                    out, impl = fn(), f"{name}_expanded"
                extra = {} if check is None else {"rel_err_ours_vs_this": round(check(out), 5)}
                return row(kernel, case, impl, time_ms(fn), nbytes, flops, **extra)

        try_row(rows, kernel, case, name, make)


def compiled(fn):
    """torch.compile of plain PyTorch code: the baseline a fused kernel must beat."""
    return torch.compile(fn, dynamic=False, fullgraph=False)


def record(benchmark, rows: list[dict], fn) -> None:
    """pytest-benchmark: keep the do_bench rows in extra_info, and let it time fn (synchronised) too."""
    benchmark.extra_info["rows"] = rows

    def synced():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(synced, rounds=20, warmup_rounds=3)


def entry_points(kernel: str, cases, measure):
    """The two ways a bench_*.py runs, from its measure(case) -> (rows, our callable): run() for
    run_all.py's table, and one pytest-benchmark test per case (bind it to a test_* name)."""
    def run() -> list[dict]:
        return run_cases(kernel, {name: functools.partial(measure, name) for name in cases})

    @pytest.mark.gpu
    @pytest.mark.skipif(not cuda_ok(), reason="needs a CUDA GPU")
    @pytest.mark.parametrize("case", list(cases))
    def test(benchmark, case):
        rows, ours = measure(case)
        record(benchmark, rows, ours)

    return run, test
