"""Shared pieces of the kernel micro-benchmarks (GPU only).

Timing (steady_ms): each call runs back to back with copies of itself inside one CUDA graph, cycling over
enough freshly allocated input sets that one cycle touches at least 4 x the L2 size; the median replay
time over the calls in it is one call's time. That is the steady state a kernel runs in inside the
engine: its inputs come from DRAM, it pays for writing back the dirty lines of the work before it, and
its own dirty lines are written back while later work runs. No host launch cost is counted. The copy
bandwidth (the ceiling, counting read + write bytes) is the fastest 1 GiB device-to-device copy in steady
state (copy_bandwidth: torch's copy_ launched eagerly, or a Triton copy kernel in a graph).

Rows also carry ms_do_bench: triton.testing.do_bench (median, one input set, eager launches, L2 flushed
by zero-filling 256 MB before each call). Its flush leaves up to an L2's worth of dirty lines that the
timed call must write back first, which a 1 GiB copy hardly notices but a 67 MB one does: on an H100 a
67 MB copy measured 0.90 of the 1 GiB copy's rate after that flush and 1.01 after a read-only flush
(scratch exp1 at 7f9e4ca). The read-only flush errs the other way (a call's own writes can stay in L2),
hence the steady state.
"""

from __future__ import annotations

import functools
import statistics
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

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
    from fastllm.kernels.sm_count import num_sms as device_sms

    return device_sms(torch.device(DEVICE))


def time_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """triton.testing.do_bench's median (eager launches, zero-fill L2 flush): the ms_do_bench column."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


STEADY_L2_MULTIPLE = 4  # one cycle over the input sets touches at least this many L2 sizes
STEADY_MIN_CALLS = 16  # calls in one replay
# At most this many sets: a small problem then stays in L2, as it does in the engine, where its inputs were
# just written by the kernel before it.
STEADY_MAX_SETS = 8


def input_sets(make, footprint) -> list:
    """Fresh results of make() (one input set each), as many as a cycle needs to touch STEADY_L2_MULTIPLE
    x the L2 size; 1 to STEADY_MAX_SETS. footprint(first set) -> the bytes one call touches."""
    sets = [make()]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    wanted = -(-STEADY_L2_MULTIPLE * l2 // max(1, int(footprint(sets[0]))))
    return sets + [make() for _ in range(min(STEADY_MAX_SETS, wanted) - 1)]


def steady_ms(calls: list, replays: int = 20, graph: bool = True) -> float:
    """Median ms of one call in steady state (see the module docstring): the calls, one per input set, run
    round-robin, at least STEADY_MIN_CALLS of them in one CUDA graph. graph=False launches them eagerly
    instead, for a call that synchronizes with the host (it cannot be captured; its host time then counts)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile, allocate and tune outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    per_replay = len(calls) * -(-STEADY_MIN_CALLS // len(calls))

    def run_all():
        for i in range(per_replay):
            calls[i % len(calls)]()

    replay = run_all
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            run_all()
        replay = cuda_graph.replay
    for _ in range(2):
        replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(replays)]
    for start, end in events:
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / per_replay


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


@functools.lru_cache(maxsize=None)
def copy_bandwidth() -> tuple[float, str]:
    """(GB/s, how) of the fastest 1 GiB device-to-device copy in steady state (read + write bytes): torch's
    copy_ launched eagerly (a captured copy_ becomes a memcpy node that runs on a copy engine, ~20% slower
    on an H100) and a plain Triton copy kernel in a graph at a few block sizes. The fastest is the ceiling."""
    nbytes = 1 << 30
    src = torch.empty(nbytes // 4, dtype=torch.int32, device=DEVICE).random_()
    dst = torch.empty_like(src)
    candidates = {"torch copy_, eager": steady_ms([functools.partial(dst.copy_, src)], graph=False)}
    for block in (4096, 8192, 16384):
        grid = (triton.cdiv(src.numel(), block),)
        launch = functools.partial(_copy_kernel[grid], src, dst, src.numel(), BLOCK=block, num_warps=8)
        candidates[f"triton copy, BLOCK {block}, graph"] = steady_ms([launch])
    how, ms = min(candidates.items(), key=lambda item: item[1])
    return 2 * nbytes / ms / 1e6, how


def copy_bandwidth_gbs() -> float:
    return copy_bandwidth()[0]


@functools.lru_cache(maxsize=None)
def matmul_tflops(n: int = 8192) -> float:
    """bf16 tensor-core rate: an n x n x n torch.mm on random data (cuBLAS), in steady state."""
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    return 2 * n**3 / steady_ms([functools.partial(torch.mm, a, b, out=c)]) / 1e9


def timed_row(kernel: str, case: str, impl: str, calls: list, nbytes: float | None = None,
              flops: float | None = None, graph: bool = True, **extra) -> dict:
    """row() of calls timed in steady state (calls: one per input set, e.g. from input_sets; graph as in
    steady_ms), with do_bench's time of the first beside it."""
    do_bench_ms = round(time_ms(calls[0]), 4)
    timing = {} if graph else {"timing": "eager"}
    return row(kernel, case, impl, steady_ms(calls, graph=graph), nbytes, flops, ms_do_bench=do_bench_ms,
               **timing, **extra)


def baseline_rows(rows: list[dict], kernel: str, case: str, impls: dict, sets: list,
                  nbytes: float | None = None, syncing: tuple = ()) -> None:
    """A timed_row per baseline, impl name -> fn(*input set), each called on every input set. Impls named in
    `syncing` synchronize with the host (e.g. boolean-mask indexing) and are timed eagerly: a failed capture
    would leave the CUDA RNG unusable for the rest of the process."""
    for impl, fn in impls.items():
        calls = [functools.partial(fn, *args) for args in sets]

        def make(impl=impl, calls=calls):
            return timed_row(kernel, case, impl, calls, nbytes, graph=impl not in syncing)

        try_row(rows, kernel, case, impl, make)


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
        r["frac_matmul"] = round(flops / ms / 1e9 / matmul_tflops(), 3)
    r.update(extra)
    return r


def add_speedups(rows: list[dict]) -> list[dict]:
    """speedup = best baseline time / ours, per (kernel, case); 'ours' is the impl named 'triton', and other
    impls named triton_* (our alternative kernels) are not baselines."""
    by_case: dict[tuple, list[dict]] = {}
    for r in rows:
        by_case.setdefault((r["kernel"], r["case"]), []).append(r)
    for group in by_case.values():
        ours = [r for r in group if r["impl"] == "triton" and r.get("ms") is not None]
        base = [r["ms"] for r in group if not r["impl"].startswith("triton") and r.get("ms") is not None]
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


def sdpa_rows(rows: list[dict], kernel: str, case: str, qkv_sets: list, *, causal: bool, scale: float,
              nbytes: float | None = None, flops: float | None = None, check=None) -> None:
    """Time torch SDPA, backend by backend, on contiguous q [B, Hq, S, D], k/v [B, Hkv, S, D] (qkv_sets: one
    (q, k, v) per input set, as steady_ms cycles over them).

    GQA goes through enable_gqa; a backend that rejects it gets K/V expanded to Hq heads instead
    (impl '<backend>_expanded', which reads Hq/Hkv times more K/V). check(out) -> a number to record.
    """
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def call(backend, q, k, v, gqa: bool):
        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        return run

    for name, backend in sdpa_backends().items():
        def make(name=name, backend=backend):
            try:
                calls, impl = [call(backend, q, k, v, True) for q, k, v in qkv_sets], name
                out = calls[0]()
            except RuntimeError:
                group = qkv_sets[0][0].shape[1] // qkv_sets[0][1].shape[1]
                calls = [call(backend, q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False)
                         for q, k, v in qkv_sets]
                out, impl = calls[0](), f"{name}_expanded"
            extra = {} if check is None else {"rel_err_ours_vs_this": round(check(out), 5)}
            return timed_row(kernel, case, impl, calls, nbytes, flops, **extra)

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
