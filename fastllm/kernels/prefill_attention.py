"""Causal attention of a flat batch of query chunks over paged KV (prefill, chunked prefill, verify).

Math: request b owns query rows query_start_loc[b] : query_start_loc[b+1] (q_len of them); they are the
last q_len of its L = seq_lens[b] tokens, so row i sits at position p_i = L - q_len + i and
    out_i = sum_{j <= p_i} softmax_j(scale * q_i . k_j) v_j
K/V of all L tokens are already in the cache. Plain prefill is q_len = L, chunked prefill is a cached
prefix plus a chunk, decode rows are q_len = 1; q_len = 0 does nothing.

FlashAttention-2 scheme: a program owns one tile of BLOCK_Q query tokens x all GROUP = Hq/Hkv heads of
one KV head, packed as BLOCK_M = BLOCK_Q * GROUP (+ padding) rows, row r = (token r // GROUP,
head r % GROUP). Each K/V tile is thus loaded once for the whole group, and short chunks (decode rows,
verify) still fill the tl.dot M dimension with heads instead of padding. The loop over K/V tiles runs an
online softmax (base 2, fp32 state) and splits into tiles fully below the diagonal (no causal mask) and
the diagonal tiles (masked). Grid: (cdiv(max_query_len, BLOCK_Q), B, Hkv), tiles launched last-first so
the longest (most causal work) start first; tiles past a request's q_len return at once. The inner step
is the FA-2 recipe: exp2 with log2(e) folded into one FMA per score, p @ V accumulated into acc in place
(tl.dot's acc operand), causal masks and load masks only on the diagonal tiles.

Tile shapes (BLOCK_M, BLOCK_N, warps, stages) come from triton.autotune over a short candidate list per
head-dim class (CONFIGS_HEAD_DIM_128 / _256), keyed on GROUP, HEAD_DIM, PAGE, the dtypes and a power-of-2
bucket of max_query_len, so it tunes once per bucket (at the first prefill of that size; prefill is never
captured in a CUDA graph) and not per length. Each candidate writes only `out`, so re-running configs while
tuning is harmless. Under TRITON_INTERPRET=1 only the first (pre-tuning) candidate is given: nothing is
timed. benchmarks/kernels/tune.py times every candidate; `prefill_attention(..., config=c)` runs one.

Memory traffic (the kernel is compute-bound at prefill lengths; report TFLOP/s). If every query tile
re-read its K/V prefix from DRAM (L2 absorbs much of it, so this is an upper estimate):
    bytes = 2 * T * Hq * D * q.element_size()                       (q in, out)
          + sum_b ceil(q_len_b / BLOCK_Q) * (L_b - q_len_b/2) * Hkv * D * 2 * cache.element_size()
FLOPs: 4 * D * Hq * sum_b sum_i (p_i + 1)   (two matmuls; see flops()).
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, n0, seq_len, q_pos, bt_row, k_head_ptr, v_head_ptr,
    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step over keys n0 : n0 + BLOCK_N. Without CAUSAL_MASK every key is valid."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    n_ok = n < seq_len
    d_ok = d < HEAD_DIM
    if CAUSAL_MASK:
        page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)  # int64: page * stride > 2^31
    else:
        page = tl.load(bt_row + n // PAGE).to(tl.int64)
    slot = n % PAGE
    # K is loaded like V, [BLOCK_N, BLOCK_D] (rows of HEAD_DIM contiguous elements), and transposed for the
    # dot: measured 1-8% faster on an H100 than gathering K^T as [BLOCK_D, BLOCK_N] directly.
    row_k = page * stride_kb + slot * stride_ks  # [BLOCK_N]
    row_v = page * stride_vb + slot * stride_vs
    k_ptrs = k_head_ptr + row_k[:, None] + d[None, :]
    v_ptrs = v_head_ptr + row_v[:, None] + d[None, :]
    if CAUSAL_MASK:
        # masked keys must load 0: p = 0 times a NaN left in an unused slot is still NaN
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif BLOCK_D == HEAD_DIM:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    k = tl.trans(k)  # [BLOCK_D, BLOCK_N]
    s = tl.dot(q, k, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if CAUSAL_MASK:
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    p = tl.exp2(s * scale_log2 - m_new[:, None])  # one FMA per score
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)  # accumulate in place
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2,  # scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    len_bucket,  # autotune key only (a bucket of max_query_len); unused in the body
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # tuned
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP  # query tokens per tile
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest-running tiles first
    b = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    tok0 = tile * BLOCK_Q
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len  # cached prefix before this chunk

    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP  # [BLOCK_M] query token within the request
    heads = kv_head * GROUP + r % GROUP  # [BLOCK_M] query head
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context + tok  # [BLOCK_M] position of each row in the sequence
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_t = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + (row_t * stride_qt + heads * stride_qh)[:, None] + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # m starts finite so that a row with no valid key in a tile gets p = 0, not exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    first_pos = context + tok0  # smallest position in the tile
    last_pos = context + tl.minimum(tok0 + BLOCK_Q, q_len) - 1  # largest valid one
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # key tiles below here are visible to every row
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, n0, seq_len, q_pos, bt_row, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, False, PRECISION)
    for n0 in range(full_end, last_pos + 1, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, n0, seq_len, q_pos, bt_row, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, True, PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (row_t * stride_ot + heads * stride_oh)[:, None] + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _cfg(block_m: int, block_n: int, num_warps: int, num_stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages)


# Candidates for triton.autotune, BLOCK_M rows = BLOCK_M // GROUP query tokens x GROUP heads. The first of
# each list is the pre-tuning config (the interpreter runs only that one), so tuning can only gain.
# Measured on an H100 (bf16, D 128, GQA 4, tune.py --explore over BM 64/128 x BN 32/64/128 x warps 4/8 x
# stages 2/3/4): many short tiles win for batches of 2k prompts (BM 64, 4 warps: better causal load
# balance), 128 x 128 tiles with 8 warps win for one long prompt or a chunk over a long prefix.
CONFIGS_HEAD_DIM_128 = [
    _cfg(128, 64, 8, 2),  # before tuning
    _cfg(64, 32, 4, 2),  # best at 8 x 2048
    _cfg(64, 64, 4, 2),  # best at 1 x 512, near-best at 8 x 2048 and the chunked case
    _cfg(64, 64, 4, 4),
    _cfg(128, 32, 4, 3),
    _cfg(128, 64, 4, 3),
    _cfg(128, 128, 8, 3),  # best at 1 x 8192 and 4 x (512 over 2048)
    _cfg(128, 128, 8, 4),
]
CONFIGS_HEAD_DIM_256 = [  # head_dim 129..256: the accumulator is twice as wide (not measured yet)
    _cfg(64, 32, 8, 2),  # before tuning
    _cfg(64, 64, 8, 2),
    _cfg(64, 32, 4, 2),
    _cfg(128, 32, 8, 2),
]


def candidate_configs(head_dim: int, group: int) -> list[triton.Config]:
    """The autotune candidates for this shape: tiles must hold at least one token's GROUP rows."""
    need = triton.next_power_of_2(group)
    base = CONFIGS_HEAD_DIM_128 if head_dim <= 128 else CONFIGS_HEAD_DIM_256
    ok = [c for c in base if c.kwargs["BLOCK_M"] >= need]
    return ok or [_cfg(need, 32, 8, 2)]


def len_bucket(max_query_len: int) -> int:
    """Autotune key: max_query_len rounded up to a power of 2 in [16, 16384] (11 buckets, not every length).

    Powers of 2, not 4: 8 x 2048 and 1 x 8192 want different tiles. Every bucket is a multiple of 16, so
    this int argument never changes Triton's specialization (no recompiles)."""
    return min(max(16, triton.next_power_of_2(max(1, max_query_len))), 16384)


def _bench_quick(fn, quantiles=None):
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


@functools.lru_cache(maxsize=None)
def _tuned_kernel(head_dim: int, group: int):
    """One autotuner per candidate list; it tunes once per (len bucket, GROUP, HEAD_DIM, PAGE, dtypes) at
    the first call with that key. Under TRITON_INTERPRET=1 only the first (pre-tuning) config is given,
    so nothing is timed."""
    configs = candidate_configs(head_dim, group)
    if _INTERPRET:
        configs = configs[:1]
    kwargs = {}
    if "do_bench" in inspect.signature(triton.autotune).parameters:
        kwargs["do_bench"] = _bench_quick  # ~30 ms a config instead of ~125 ms
    return triton.autotune(configs=configs, key=["len_bucket", "GROUP", "HEAD_DIM", "PAGE"], **kwargs)(
        _prefill_kernel)


# (len bucket, GROUP, HEAD_DIM, PAGE, q dtype, cache dtype) -> the config autotune picked. Later calls launch
# the plain kernel with it: the Autotuner's own per-call key building costs ~10-30 us of host time, as much
# as a short prefill's kernel (seen on an H100: 1 x 512 took 0.078 ms through it, 0.048 without).
_picked: dict[tuple, triton.Config] = {}


def tuned_config(head_dim: int, group: int, max_query_len: int, page: int, dtype: torch.dtype):
    """The config autotune picked for this key, or None if that key was not tuned yet (tune.py reports it)."""
    return _picked.get((len_bucket(max_query_len), group, head_dim, page, dtype, dtype))


def flops(query_lens: list[int], seq_lens: list[int], num_q_heads: int, head_dim: int) -> int:
    """Useful FLOPs (QK^T and PV) of one call: query row i of a request attends p_i + 1 keys."""
    keys = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens))
    return 4 * head_dim * num_q_heads * keys


def bytes_moved(query: torch.Tensor, key_cache: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                block_q: int) -> int:
    """Approximate DRAM bytes of one call if every query tile re-read its K/V prefix from memory."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    qo = 2 * sum(query_lens) * query.shape[1] * head_dim * query.element_size()
    kv_rows = sum(triton.cdiv(q, block_q) * (s - q / 2) for q, s in zip(query_lens, seq_lens) if q > 0)
    return int(qo + kv_rows * num_kv_heads * head_dim * 2 * key_cache.element_size())


def prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    max_query_len: int,  # host-side bound on q_len (sizes the grid)
    scale: float,
) -> torch.Tensor:
    return prefill_attention_config(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                    max_query_len, scale, config=None)


def prefill_attention_config(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                             max_query_len: int, scale: float, config: triton.Config | None) -> torch.Tensor:
    """prefill_attention with config None (autotuned) or one explicit candidate (tests, tune.py)."""
    num_tokens, num_q_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    batch = seq_lens.shape[0]
    assert key_cache.shape == value_cache.shape and key_cache.shape[3] == head_dim
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert query.dtype == key_cache.dtype == value_cache.dtype, "tl.dot needs matching operand dtypes"
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), query.dtype
    assert head_dim <= 256, head_dim
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert query_start_loc.shape == (batch + 1,) and query_start_loc.dtype == torch.int32
    assert query_start_loc.is_contiguous()
    group = num_q_heads // num_kv_heads
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or batch == 0 or max_query_len <= 0:
        return out
    args = (
        query, key_cache, value_cache, out, block_tables, seq_lens, query_start_loc,
        scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        len_bucket(max_query_len),
    )
    consts = dict(
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # fp32 caches are the correctness mode (tiny models vs HF): exact fp32 dots, not tf32.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )

    def grid(meta):
        return (triton.cdiv(max_query_len, meta["BLOCK_M"] // group), batch, num_kv_heads)

    if config is None:
        key = (len_bucket(max_query_len), group, head_dim, page, query.dtype, key_cache.dtype)
        config = _picked.get(key)
        if config is None:  # first call with this key: autotune times the candidates, then runs the best
            tuner = _tuned_kernel(head_dim, group)
            tuner[grid](*args, **consts)
            _picked[key] = tuner.best_config
            return out
    assert config.kwargs["BLOCK_M"] >= group, (config, group)
    _prefill_kernel[grid](*args, **consts, **config.all_kwargs())
    return out
