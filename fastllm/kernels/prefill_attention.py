"""Causal attention of a flat batch of query chunks over paged KV (prefill, chunked prefill, verify).

Math: request b owns query rows query_start_loc[b] : query_start_loc[b+1] (q_len of them); they are the
last q_len of its L = seq_lens[b] tokens, so row i sits at position p_i = L - q_len + i and
    out_i = sum_{j <= p_i} softmax_j(scale * q_i . k_j) v_j
All L tokens' K/V are in the cache. The chunk's own q_len K/V rows are also passed as `key` / `value`
[T, Hkv, D], the rows the caller has just written to the cache. So the kernel reads the cached prefix
(L - q_len keys) through the block table and the chunk straight from those contiguous rows. The chunk
holds most of the causal work at prefill lengths. Contiguous rows let Hopper's TMA engine (tensor
descriptors) feed the tensor cores, where per-token page gathers would have to go through the load units.
Plain prefill is an empty prefix, chunked prefill a prefix plus a chunk, decode rows q_len = 1; q_len = 0
does nothing.

FlashAttention-2 scheme: a program owns one tile of BLOCK_Q query tokens x all GROUP = Hq/Hkv heads of
one KV head, packed as BLOCK_M = BLOCK_Q * GROUP (+ padding) rows, row r = (token r // GROUP,
head r % GROUP). Each K/V tile is thus loaded once for the whole group, and short chunks (decode rows,
verify) still fill the tl.dot M dimension with heads instead of padding. Keys come in three loops, each
running an online softmax (base 2, fp32 state):
  1. prefix tiles through the block table (every row sees every prefix key; only the last tile masked);
  2. chunk tiles fully below the diagonal: no mask;
  3. the diagonal chunk tiles: causal mask, and V rows past the request's q_len zeroed, so a neighbour's
     or padding rows (even NaN) cannot leak in through p = 0 * v.
The chunk loops load through TMA (CHUNK_TMA) on sm_90+ for steps of TMA_MIN_TOKENS or more tokens (below
that the descriptors' host cost outweighs them), else through masked pointer loads. On an sm_90 GPU such
steps (16-bit, head_dim 64 or 128) go to prefill_attention_hopper.py instead: the same row packing in a
warp-specialized Gluon kernel (FlashAttention-3's producer warp and two consumer warpgroups).
Grid: (cdiv(max_query_len, BLOCK_Q), B, Hkv). Tiles are launched last-first, so the longest (most causal
work) start first; tiles past a request's q_len return at once. With a tile map (prefill_tiles.py) the grid
is (N, 1, Hkv) instead, N fixed by the map's shape, each program reading which tile it computes: a
CUDA graph captured over a map of N entries replays for any step whose tiles fit it. The inner step is the
FA-2 recipe: exp2 with log2(e) folded into one FMA per score, p @ V accumulated in place (tl.dot's acc
operand).

An FP8 cache (kv_cache_dtype="fp8"): the cached prefix is read as e4m3 and converted to q's dtype in
registers; the chunk's own rows, read from key/value, are the same e4m3 values already in q's dtype (as
rotary_kv_cache_write returns them), so the step attends to the keys a later step will read back; k_scale
is folded into the softmax scale, v_scale into the output. The Hopper (Gluon) kernel reads 16-bit caches
only: FP8 caches run this one (logged once).

Tiles: a static table (choose_config), not an autotuner, so the engine never stalls on first-use tuning.
BM 64 / BN 64 / 4 warps / 3 stages was the best of ~30 configs tune.py timed (bf16, D 128, GQA 4, TMA
chunk loads; README, "Kernel choices"). Two programs fit an SM (112 KB of shared memory each), so one
program's softmax overlaps the other's tensor-core work. benchmarks/kernels/tune.py times other tiles
through `prefill_attention_config(..., config=c)`.

Memory traffic (the kernel is compute-bound at prefill lengths; report TFLOP/s). If every query tile
re-read its keys from DRAM (L2 absorbs much of it, so this is an upper estimate):
    bytes = 2 * T * Hq * D * q.element_size()                       (q in, out)
          + sum_b ceil(q_len_b / BLOCK_Q) * (L_b - q_len_b/2) * Hkv * D * 2 * cache.element_size()
FLOPs: 4 * D * Hq * sum_b sum_i (p_i + 1)   (two matmuls; see flops()).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastllm.kernels import prefill_attention_hopper, prefill_tiles
from fastllm.kernels.reference import FP8, check_kv_scales

try:  # triton >= 3.4: host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover (older triton: pointer loads only)
    TensorDescriptor = None

logger = logging.getLogger("fastllm.kernels")
_LOG2E = 1.4426950408889634


class PrefillConfig(NamedTuple):
    block_m: int  # rows per program: BLOCK_M // GROUP query tokens x GROUP heads
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def choose_config(head_dim: int, group: int, dtype: torch.dtype) -> PrefillConfig:
    """The launch for this shape: a tile must hold at least one token's GROUP rows."""
    block_m = prefill_tiles.block_m(group)
    if head_dim > 128:  # the fp32 accumulator is twice as wide: narrower key tiles, more warps
        return PrefillConfig(block_m, 32, 8, 2)
    # fp32 (the tiny models' correctness mode) needs twice the shared memory per stage
    return PrefillConfig(block_m, 64, 4 if block_m == 64 else 8, 3 if dtype.itemsize <= 2 else 2)


@triton.jit
def _load_rows(ptrs, row_ok, d_ok, ROW_MASK: tl.constexpr, D_MASK: tl.constexpr):
    """A [rows, BLOCK_D] tile; masked-off elements load 0."""
    if ROW_MASK and D_MASK:
        x = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    elif ROW_MASK:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif D_MASK:
        x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _softmax_step(acc, m_i, l_i, s, v, scale_log2, PRECISION: tl.constexpr):
    """Fold one tile into the online-softmax state: raw scores s [BLOCK_M, BLOCK_N] (masked ones -inf)
    and the tile's V [BLOCK_N, BLOCK_D]."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    p = tl.exp2(s * scale_log2 - m_new[:, None])  # one FMA per score
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)  # accumulate in place
    return acc, m_new, l_i


@triton.jit
def _prefix_tile(
    acc, m_i, l_i, q, n0, context, bt_row, k_head_ptr, v_head_ptr,
    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, lo, q_pos, window, SLIDING: tl.constexpr,
):
    """Cached keys n0 : n0 + BLOCK_N through the block table; with MASKED, only those in [lo, context), and
    with SLIDING too, for each row only those above its position q_pos [BLOCK_M] - window."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    n_ok = (n < context) & (n >= lo)  # (below lo the blocks may be freed: neither table nor slot is read)
    d_ok = d < HEAD_DIM
    if MASKED:
        page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)  # int64: page * stride > 2^31
    else:
        page = tl.load(bt_row + n // PAGE).to(tl.int64)
    slot = n % PAGE
    k_ptrs = k_head_ptr + (page * stride_kb + slot * stride_ks)[:, None] + d[None, :]
    v_ptrs = v_head_ptr + (page * stride_vb + slot * stride_vs)[:, None] + d[None, :]
    # masked keys must load 0: p = 0 times a NaN left in an unused slot is still NaN
    k = _load_rows(k_ptrs, n_ok, d_ok, MASKED, BLOCK_D != HEAD_DIM).to(q.dtype)  # (FP8 cache: exact)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if MASKED:
        s = tl.where(n_ok[None, :], s, float("-inf"))
        if SLIDING:
            s = tl.where(n[None, :] > q_pos[:, None] - window, s, float("-inf"))
    v = _load_rows(v_ptrs, n_ok, d_ok, MASKED, BLOCK_D != HEAD_DIM).to(q.dtype)
    return _softmax_step(acc, m_i, l_i, s, v, scale_log2, PRECISION)


@triton.jit
def _chunk_tile_rows(
    acc, m_i, l_i, q, j0, q_len, q_tok, k_rows, v_rows, stride_kt, stride_vt, scale_log2, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, PRECISION: tl.constexpr, SLIDING: tl.constexpr,
):
    """Chunk keys j0 : j0 + BLOCK_N from the contiguous rows; with CAUSAL_MASK, key j only for rows of
    token q_tok >= j (and with SLIDING, q_tok - window < j), and no row at or past q_len is read."""
    j = j0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    j_ok = j < q_len
    d_ok = d < HEAD_DIM
    k = _load_rows(k_rows + j.to(tl.int64)[:, None] * stride_kt + d[None, :], j_ok, d_ok, CAUSAL_MASK,
                   BLOCK_D != HEAD_DIM)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if CAUSAL_MASK:
        s = _causal_mask(s, j, q_tok, window, SLIDING)
    v = _load_rows(v_rows + j.to(tl.int64)[:, None] * stride_vt + d[None, :], j_ok, d_ok, CAUSAL_MASK,
                   BLOCK_D != HEAD_DIM)
    return _softmax_step(acc, m_i, l_i, s, v, scale_log2, PRECISION)


@triton.jit
def _causal_mask(s, j, q_tok, window, SLIDING: tl.constexpr):
    """Scores of keys j [BLOCK_N] that rows of token q_tok [BLOCK_M] do not see set to -inf."""
    seen = j[None, :] <= q_tok[:, None]
    if SLIDING:
        seen = seen & (j[None, :] > q_tok[:, None] - window)
    return tl.where(seen, s, float("-inf"))


@triton.jit
def _chunk_tile_tma(acc, m_i, l_i, q, k_desc, v_desc, q_start, col, j0, q_len, q_tok, scale_log2, window,
                    BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr, PRECISION: tl.constexpr,
                    SLIDING: tl.constexpr):
    """Chunk keys j0 : j0 + BLOCK_N through TMA. A diagonal tile (CAUSAL_MASK) may run past the request
    into the next request's rows or padding: those scores are masked and their V rows zeroed (p = 0 times
    a NaN row would still be NaN); rows past the tensor's end load as zeros."""
    k = k_desc.load([q_start + j0, col])  # [BLOCK_N, HEAD_DIM]
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    v = v_desc.load([q_start + j0, col])
    if CAUSAL_MASK:
        j = j0 + tl.arange(0, BLOCK_N)
        s = _causal_mask(s, j, q_tok, window, SLIDING)
        v = tl.where((j < q_len)[:, None], v, 0.0)
    return _softmax_step(acc, m_i, l_i, s, v, scale_log2, PRECISION)


@triton.jit
def _chunk_tile(
    acc, m_i, l_i, q, j0, q_start, q_len, q_tok, k_desc, v_desc, col, k_rows, v_rows, stride_kt, stride_vt,
    scale_log2, window, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, CHUNK_TMA: tl.constexpr, PRECISION: tl.constexpr, SLIDING: tl.constexpr,
):
    """Chunk keys j0 : j0 + BLOCK_N through TMA or through pointers (CHUNK_TMA, a compile-time choice)."""
    if CHUNK_TMA:
        acc, m_i, l_i = _chunk_tile_tma(acc, m_i, l_i, q, k_desc, v_desc, q_start, col, j0, q_len, q_tok,
                                        scale_log2, window, BLOCK_N, CAUSAL_MASK, PRECISION, SLIDING)
    else:
        acc, m_i, l_i = _chunk_tile_rows(acc, m_i, l_i, q, j0, q_len, q_tok, k_rows, v_rows, stride_kt, stride_vt,
                                         scale_log2, window, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL_MASK,
                                         PRECISION, SLIDING)
    return acc, m_i, l_i


@triton.jit
def _tile_split(lo, seen_lo, full_end, BLOCK_N: tl.constexpr):
    """A walk over keys from lo (rounded down to a tile) to a diagonal: tiles below `a` need a mask (some
    row does not see keys below seen_lo, the highest row's first key), tiles a .. b - 1 none (every row
    sees them; full_end: where the keys every row sees end, a tile boundary), from b on a mask again.
    Returns (first tile, a, b)."""
    start = (lo // BLOCK_N) * BLOCK_N
    a = tl.maximum(start, tl.minimum(tl.cdiv(seen_lo, BLOCK_N) * BLOCK_N, full_end))
    return start, a, tl.maximum(a, full_end)


# stride_bt (the step's widest block table) changes from step to step: one compiled variant for all.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, key_ptr, value_ptr,  # the chunk's K/V rows, [T, Hkv, D]
    key_desc, value_desc,  # TMA descriptors over the same rows as [T, Hkv * D] (CHUNK_TMA; else unused)
    k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    kv_start_ptr,  # int32 [B] (HAS_KV_START): request b attends no key before kv_start[b] (<= its context)
    tile_map_ptr,  # int32 [N, 2] (HAS_TILE_MAP): program i computes query tile tile_map[i, 1] of request
    # tile_map[i, 0] (-1: none); see prefill_tiles.py
    lse_ptr,  # float32 [T, Hq] (RETURN_LSE): log2 of each row's softmax denominator
    window,  # SLIDING: the row at position p sees keys p - window < k <= p
    scale_log2,  # scale * k_scale * log2(e) (k_scale: 1.0 but for an FP8 cache)
    v_scale,  # an FP8 cache's: the output's (k_scale is in scale_log2)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_TMA: tl.constexpr, PRECISION: tl.constexpr,
    HAS_KV_START: tl.constexpr, SLIDING: tl.constexpr, RETURN_LSE: tl.constexpr, HAS_TILE_MAP: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP  # query tokens per tile
    if HAS_TILE_MAP:  # a grid fixed by the map's size (CUDA graphs), ordered by the host
        b = tl.load(tile_map_ptr + 2 * tl.program_id(0)).to(tl.int64)
        tile = tl.load(tile_map_ptr + 2 * tl.program_id(0) + 1)
    else:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest-running tiles first
        b = tl.program_id(1).to(tl.int64)
    if b < 0:  # an unused entry of the map
        return
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    tok0 = tile * BLOCK_Q
    if tok0 >= q_len:
        return
    context = tl.load(seq_lens_ptr + b) - q_len  # cached prefix before this chunk

    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP  # [BLOCK_M] query token within the chunk
    heads = kv_head * GROUP + r % GROUP  # [BLOCK_M] query head
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_t = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + (row_t * stride_qt + heads * stride_qh)[:, None] + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # m starts finite so that a row with no valid key in a tile gets p = 0, not exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys a row may see start at kv_start (0 without it) and, with a window, above its position - window:
    # lo is the first key of the tile's lowest row, seen_lo that of its highest (last_tok).
    last_tok = tl.minimum(tok0 + BLOCK_Q, q_len) - 1
    lo = context * 0
    if HAS_KV_START:
        lo = tl.load(kv_start_ptr + b)
    seen_lo = lo
    if SLIDING:
        seen_lo = tl.maximum(lo, context + last_tok - window + 1)
        lo = tl.maximum(lo, context + tok0 - window + 1)

    # 1. the cached prefix, through the block table: masked tiles at its low end (window, kv_start) and at
    # its partial last tile, none between
    bt_row = block_tables_ptr + b * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kch
    v_head = v_cache_ptr + kv_head * stride_vch
    q_pos = context + tok
    n_start, n_a, n_b = _tile_split(lo, seen_lo, (context // BLOCK_N) * BLOCK_N, BLOCK_N)
    for n0 in range(n_start, tl.minimum(n_a, context), BLOCK_N):
        acc, m_i, l_i = _prefix_tile(
            acc, m_i, l_i, q, n0, context, bt_row, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
            scale_log2, HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, True, PRECISION, lo, q_pos, window, SLIDING)
    for n0 in range(n_a, n_b, BLOCK_N):
        acc, m_i, l_i = _prefix_tile(
            acc, m_i, l_i, q, n0, context, bt_row, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
            scale_log2, HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, False, PRECISION, lo, q_pos, window, SLIDING)
    for n0 in range(tl.maximum(n_b, n_start), context, BLOCK_N):
        acc, m_i, l_i = _prefix_tile(
            acc, m_i, l_i, q, n0, context, bt_row, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
            scale_log2, HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, True, PRECISION, lo, q_pos, window, SLIDING)

    # 2. the chunk's own keys (chunk-relative j): tiles every row of this tile sees without a mask (keys
    # j <= tok0, and inside the highest row's window), 3. masked ones below them (window) and the diagonal
    k_rows = key_ptr + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_rows = value_ptr + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    col = kv_head * HEAD_DIM
    j_lo = tok0 * 0
    j_seen = j_lo
    if SLIDING:
        j_lo = tl.maximum(tok0 - window + 1, 0)
        j_seen = tl.maximum(last_tok - window + 1, 0)
    j_start, j_a, j_b = _tile_split(j_lo, j_seen, ((tok0 + 1) // BLOCK_N) * BLOCK_N, BLOCK_N)
    for j0 in range(j_start, j_a, BLOCK_N):
        acc, m_i, l_i = _chunk_tile(
            acc, m_i, l_i, q, j0, q_start, q_len, tok, key_desc, value_desc, col, k_rows, v_rows, stride_kt,
            stride_vt, scale_log2, window, HEAD_DIM, BLOCK_D, BLOCK_N, True, CHUNK_TMA, PRECISION, SLIDING)
    for j0 in range(j_a, j_b, BLOCK_N):
        acc, m_i, l_i = _chunk_tile(
            acc, m_i, l_i, q, j0, q_start, q_len, tok, key_desc, value_desc, col, k_rows, v_rows, stride_kt,
            stride_vt, scale_log2, window, HEAD_DIM, BLOCK_D, BLOCK_N, False, CHUNK_TMA, PRECISION, SLIDING)
    for j0 in range(j_b, last_tok + 1, BLOCK_N):
        acc, m_i, l_i = _chunk_tile(
            acc, m_i, l_i, q, j0, q_start, q_len, tok, key_desc, value_desc, col, k_rows, v_rows, stride_kt,
            stride_vt, scale_log2, window, HEAD_DIM, BLOCK_D, BLOCK_N, True, CHUNK_TMA, PRECISION, SLIDING)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale  # (v_scale 1.0: exact)
    tl.store(out_ptr + (row_t * stride_ot + heads * stride_oh)[:, None] + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:  # every row sees at least its own key: l_i > 0
        tl.store(lse_ptr + row_t * tl.num_programs(2) * GROUP + heads, m_i + tl.log2(l_i), mask=row_ok)


def flops(query_lens: list[int], seq_lens: list[int], num_q_heads: int, head_dim: int) -> int:
    """Useful FLOPs (QK^T and PV) of one call: query row i of a request attends p_i + 1 keys."""
    keys = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens))
    return 4 * head_dim * num_q_heads * keys


def bytes_moved(query: torch.Tensor, key_cache: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                block_q: int) -> int:
    """Approximate DRAM bytes of one call if every query tile re-read its keys from memory."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    qo = 2 * sum(query_lens) * query.shape[1] * head_dim * query.element_size()
    kv_rows = sum(triton.cdiv(q, block_q) * (s - q / 2) for q, s in zip(query_lens, seq_lens) if q > 0)
    return int(qo + kv_rows * num_kv_heads * head_dim * 2 * key_cache.element_size())


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    return TensorDescriptor is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


def _tma_layout_ok(rows: torch.Tensor, head_dim: int) -> bool:
    """TMA needs [T, Hkv * D] rows: heads packed, 16-byte aligned base and row stride, a power-of-2 box."""
    size = rows.element_size()
    return (rows.stride(2) == 1 and rows.stride(1) == head_dim and head_dim == triton.next_power_of_2(head_dim)
            and head_dim >= 16 and (rows.stride(0) * size) % 16 == 0 and rows.data_ptr() % 16 == 0)


_logged: set[str] = set()


def use_chunk_tma(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the chunk's tiles can load through TMA (device and layout); says once why not on a CUDA
    device. prefill_attention also needs the step to be large enough (_tma_pays)."""
    why = None
    if not key.is_cuda:
        return False
    if not _has_tma(key.device.index if key.device.index is not None else torch.cuda.current_device()):
        why = "no TMA (needs an sm_90+ GPU and triton >= 3.4)"
    elif not (_tma_layout_ok(key, key.shape[2]) and _tma_layout_ok(value, value.shape[2])):
        why = f"K/V rows not TMA-compatible (head_dim {key.shape[2]}, strides {key.stride()})"
    if why and why not in _logged:
        _logged.add(why)
        logger.info("prefill_attention: chunk K/V through pointer loads: %s", why)
    return why is None


# TMA descriptors cost host time at every launch. TMA chunk loads won at 8 x 2048 tokens and at 4 x 512
# over a 2048-token prefix, and lost at 1 x 512; launched back to back, where the host sets the pace,
# 4 x 512 without a prefix lost too (README, "Kernel choices"): the gate is on tokens, not work.
TMA_MIN_TOKENS = 2048


def _tma_pays(num_tokens: int) -> bool:
    if num_tokens >= TMA_MIN_TOKENS:
        return True
    if "small" not in _logged:
        _logged.add("small")
        logger.info("prefill_attention: steps under %d tokens load the chunk K/V through pointers "
                    "(TMA descriptor setup costs more than it saves there)", TMA_MIN_TOKENS)
    return False


def prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]: the chunks' own K/V, the rows just written to the cache
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    max_query_len: int,  # host-side bound on q_len (sizes the grid)
    scale: float,
    window: int | None = None,  # sliding window: the row at position p sees keys p - window < k <= p
    kv_start: torch.Tensor | None = None,  # [B] int32, <= each request's context: keys before it are not seen
    return_lse: bool = False,  # also return lse [T, Hq] float32 (base 2)
    # [N, 2] int32 (prefill_tiles.build_tile_map): the grid is (N, 1, Hkv), whatever max_query_len
    tile_map: torch.Tensor | None = None,
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return prefill_attention_config(query, key, value, key_cache, value_cache, block_tables, seq_lens,
                                    query_start_loc, max_query_len, scale, window=window, kv_start=kv_start,
                                    return_lse=return_lse, tile_map=tile_map, k_scale=k_scale, v_scale=v_scale)


def _hopper_unsupported(query, key, value, key_cache, value_cache, masks_keys: bool = False) -> str | None:
    why = prefill_attention_hopper.unsupported(query, key, value, key_cache, value_cache)
    if why is None and masks_keys:
        why = "it has no sliding window, key start or LSE output (windowed layers, cascade attention)"
    if why is None and not (_tma_layout_ok(key, key.shape[2]) and _tma_layout_ok(value, value.shape[2])):
        why = f"K/V rows not TMA-compatible (strides {key.stride()})"
    return why


def _use_hopper_kernel(query, key, value, key_cache, value_cache, masks_keys: bool, tile_map: bool) -> bool:
    """Whether the step goes to the Gluon kernel of prefill_attention_hopper.py; says once why not on a
    CUDA device. masks_keys: the call has a window, a key start or asks for the LSE."""
    if not query.is_cuda or not _tma_pays(query.shape[0]):
        return False
    if tile_map:  # its grid follows the step's requests
        if "tile map" not in _logged:
            _logged.add("tile map")
            logger.info("prefill_attention: launches with a tile map (CUDA graphs of mixed steps) run the "
                        "Triton kernel, not the Hopper (Gluon) one, at any size")
        return False
    why = _hopper_unsupported(query, key, value, key_cache, value_cache, masks_keys)
    if why and why not in _logged:
        _logged.add(why)
        logger.info("prefill_attention: the Triton kernel, not the Hopper (Gluon) one: %s", why)
    elif why is None and "hopper" not in _logged:
        _logged.add("hopper")
        logger.info("prefill_attention: steps of %d+ tokens run the Hopper (Gluon) kernel", TMA_MIN_TOKENS)
    return why is None


def prefill_attention_config(query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                             max_query_len: int, scale: float, config: PrefillConfig | None = None,
                             chunk_tma: bool | None = None, hopper: bool | None = None, window: int | None = None,
                             kv_start: torch.Tensor | None = None, return_lse: bool = False,
                             tile_map: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
    """prefill_attention with an explicit kernel, tile config and TMA choice (None: the defaults); for tests
    and tune.py. hopper=True forces the Gluon kernel (sm_90 only), False the Triton one; a config or a
    chunk_tma choice means the Triton kernel. chunk_tma=True also runs the TMA path under TRITON_INTERPRET=1.
    A window, a kv_start, return_lse or a tile_map always run the Triton kernel; a tile map must be built
    for the config's block_m // group query tokens per tile."""
    num_tokens, num_q_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    batch = seq_lens.shape[0]
    assert key_cache.shape == value_cache.shape and key_cache.shape[3] == head_dim
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim), (key.shape, query.shape)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert query.dtype == key.dtype == value.dtype and key_cache.dtype == value_cache.dtype \
        and key_cache.dtype in (query.dtype, FP8), "tl.dot needs matching operand dtypes (FP8 caches convert)"
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), query.dtype
    check_kv_scales(key_cache, k_scale, v_scale)
    assert head_dim <= 256, head_dim
    assert query.stride(2) == key.stride(2) == value.stride(2) == 1
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert query_start_loc.shape == (batch + 1,) and query_start_loc.dtype == torch.int32
    assert query_start_loc.is_contiguous()
    assert window is None or window >= 1, window
    assert kv_start is None or (kv_start.shape == (batch,) and kv_start.dtype == torch.int32
                                and kv_start.is_contiguous())
    assert tile_map is None or (tile_map.dim() == 2 and tile_map.shape[1] == 2
                                and tile_map.dtype == torch.int32 and tile_map.is_contiguous())
    group = num_q_heads // num_kv_heads
    masks_keys = window is not None or kv_start is not None or return_lse
    if hopper is None:
        hopper = config is None and chunk_tma is None and _use_hopper_kernel(query, key, value, key_cache, value_cache,
                                                                             masks_keys, tile_map is not None)
    elif hopper:  # forced: the default path has just checked the same
        assert tile_map is None, "the Hopper prefill kernel takes no tile map"
        why = _hopper_unsupported(query, key, value, key_cache, value_cache, masks_keys)
        assert why is None, f"the Hopper prefill kernel cannot take this call: {why}"
    if hopper:
        return prefill_attention_hopper.prefill_attention_hopper(
            query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale)
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=query.device) if return_lse else out
    if num_tokens == 0 or batch == 0 or (max_query_len <= 0 and tile_map is None) \
            or (tile_map is not None and tile_map.shape[0] == 0):
        return (out, lse) if return_lse else out
    config = config or choose_config(head_dim, group, query.dtype)
    assert config.block_m >= group, (config, group)
    if chunk_tma is None:
        chunk_tma = _tma_pays(num_tokens) and use_chunk_tma(key, value)
    elif chunk_tma:  # forced (tests, tune.py): the descriptors would silently read the wrong columns
        assert TensorDescriptor is not None, "TMA descriptors need triton >= 3.4"
        assert _tma_layout_ok(key, head_dim) and _tma_layout_ok(value, head_dim), (key.stride(), value.stride())
    key_desc, value_desc = key, value  # unused without TMA
    if chunk_tma:
        shape, box = [num_tokens, num_kv_heads * head_dim], [config.block_n, head_dim]
        key_desc = TensorDescriptor(key, shape, [key.stride(0), 1], box)
        value_desc = TensorDescriptor(value, shape, [value.stride(0), 1], box)
    if tile_map is not None:
        grid = (tile_map.shape[0], 1, num_kv_heads)
    else:
        grid = (triton.cdiv(max_query_len, config.block_m // group), batch, num_kv_heads)
    _prefill_kernel[grid](
        query, key, value, key_desc, value_desc, key_cache, value_cache, out, block_tables, seq_lens,
        query_start_loc, kv_start if kv_start is not None else seq_lens,
        tile_map if tile_map is not None else seq_lens, lse, window or 0, scale * k_scale * _LOG2E, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, CHUNK_TMA=chunk_tma,
        # fp32 caches are the correctness mode (tiny models vs HF): exact fp32 dots, not tf32.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_KV_START=kv_start is not None, SLIDING=window is not None, RETURN_LSE=return_lse,
        HAS_TILE_MAP=tile_map is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return (out, lse) if return_lse else out
