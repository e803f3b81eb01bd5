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
the longest (most causal work) start first; tiles past a request's q_len return at once.

Memory traffic (the kernel is compute-bound at prefill lengths; report TFLOP/s). If every query tile
re-read its K/V prefix from DRAM (L2 absorbs much of it, so this is an upper estimate):
    bytes = 2 * T * Hq * D * q.element_size()                       (q in, out)
          + sum_b ceil(q_len_b / BLOCK_Q) * (L_b - q_len_b/2) * Hkv * D * 2 * cache.element_size()
FLOPs: 4 * D * Hq * sum_b sum_i (p_i + 1)   (two matmuls; see flops()).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, n0, seq_len, q_pos, bt_row, k_cache_ptr, v_cache_ptr, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step over keys n0 : n0 + BLOCK_N. Without CAUSAL_MASK every key is valid."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    n_ok = n < seq_len
    d_ok = d < HEAD_DIM
    page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)  # int64: page * stride > 2^31
    k_off = page[None, :] * stride_kb + (n % PAGE)[None, :] * stride_ks + kv_head * stride_kh + d[:, None]
    v_off = page[:, None] * stride_vb + (n % PAGE)[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
    if CAUSAL_MASK:
        # masked keys must load 0: p = 0 times a NaN left in an unused slot is still NaN
        k = tl.load(k_cache_ptr + k_off, mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_cache_ptr + v_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    elif BLOCK_D == HEAD_DIM:
        k = tl.load(k_cache_ptr + k_off)
        v = tl.load(v_cache_ptr + v_off)
    else:
        k = tl.load(k_cache_ptr + k_off, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + v_off, mask=d_ok[None, :], other=0.0)
    s = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if CAUSAL_MASK:
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2,  # scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
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
    first_pos = context + tok0  # smallest position in the tile
    last_pos = context + tl.minimum(tok0 + BLOCK_Q, q_len) - 1  # largest valid one
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # key tiles below here are visible to every row
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, n0, seq_len, q_pos, bt_row, k_cache_ptr, v_cache_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
            HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, False, PRECISION)
    for n0 in range(full_end, last_pos + 1, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, n0, seq_len, q_pos, bt_row, k_cache_ptr, v_cache_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
            HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, True, PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (row_t * stride_ot + heads * stride_oh)[:, None] + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _config(head_dim: int, group: int) -> dict:
    """Tile sizes by head dim; BLOCK_M rows = BLOCK_Q tokens x GROUP heads (to tune on the GPU)."""
    block_m, block_n, warps = (128, 64, 8) if head_dim <= 128 else (64, 32, 8)
    block_m = max(block_m, triton.next_power_of_2(group))  # at least one token per tile
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_N=block_n, num_warps=warps, num_stages=2)


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
    cfg = _config(head_dim, group)
    grid = (triton.cdiv(max_query_len, cfg["BLOCK_Q"]), batch, num_kv_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, out, block_tables, seq_lens, query_start_loc,
        scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # fp32 caches are the correctness mode (tiny models vs HF): exact fp32 dots, not tf32.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        **cfg,
    )
    return out
