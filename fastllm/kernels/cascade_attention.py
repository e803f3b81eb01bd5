"""Cascade attention's shared part: the query rows of a group of requests attend to the prefix they share.

Requests whose block tables start with the same cached blocks (a system prompt, few-shot examples, n > 1
siblings) form a group; every query row of the group sees every key of the shared prefix (it lies before
all of them: no causal mask). Paged decode attention reads that prefix once per request; here the group's
rows form the tile instead: a program packs BLOCK_M // GROUP query rows x the GROUP query heads of one KV
head, as prefill_attention does, so each prefix K/V tile is read once per row tile of the group, not once
per request. Each row's attention to its own suffix (the keys after the prefix) is the paged kernels' with
kv_start; merge_attn_states.py folds the two parts together by their log-sum-exp.

A decode step takes cascade_decode_attention: this kernel, then paged decode over the suffixes, which folds
each grouped row's prefix states into its output as it finishes the row, so no merge launch. Under PDL the
prefix kernel lets the suffix kernel start at once (TRIGGER), and the suffix kernel waits for it only before
those merges, so the two overlap as two streams would. A mixed step's suffix is the prefill kernel's: the
prefix kernel runs beside it on a side stream, then merge_attn_states.

Math, for query row t of group g over its prefix keys k_0 .. k_{P-1} (P = prefix_lens[g]):
    o_s = sum_{j in split s} softmax(scale q_t . k_j) v_j (normalized within the split),
    lse_s = log2 sum_{j in split s} 2^(scale log2(e) q_t . k_j)
Grid: (row tiles x splits, Hkv, G); the prefix is cut into `num_splits` parts of whole BLOCK_N tiles so a
small group still fills the GPU (programs of a tile past a group's rows, or of a split past its prefix,
return at once; an empty split writes lse = -inf, which the merge weighs 0). The group is the slowest grid
axis, so one group's programs launch together: a CUDA graph's padding groups (no rows; they return at once)
come after the real programs, not interleaved with them, which could put two real ones on an SM
(choose_num_splits sizes for one an SM). The launch config depends only on host-side bounds
(max_group_rows, max_prefix_len), never on device values.

Memory traffic: sum_g ceil(rows_g / BLOCK_Q) * P_g * Hkv * D * 2 * cache.element_size() of K/V (the row
tiles of one group read the same tiles at about the same time, mostly from L2), the rows' q, and the
partial states written: R * Hq * splits * (D + 1) * 4 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastllm.kernels import pdl, prefill_tiles, sm_count
from fastllm.kernels.paged_decode_attention import CascadeSuffix, launch_chosen
from fastllm.kernels.prefill_attention import _prefix_tile
from fastllm.kernels.reference import FP8, check_kv_scales

_LOG2E = 1.4426950408889634
_MIN_SPLIT_TOKENS = 256  # below this a split is mostly fixed cost (q load, partial write, merge input)
_MAX_SPLITS = 32


@triton.jit(do_not_specialize=["stride_bt", "num_splits", "min_split_len"])
def _cascade_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, lse_ptr, block_tables_ptr, prefix_rows_ptr, prefix_lens_ptr, rows_ptr,
    row_start_ptr,
    scale_log2,  # scale * k_scale * log2(e) (k_scale: 1.0 but for an FP8 cache, read as prefill reads it)
    v_scale,  # an FP8 cache's value scale (1.0 else), applied to the output
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    num_splits,
    min_split_len,  # keys a split covers at least: a prefix shorter than the grid's bound fills fewer splits
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    TRIGGER: tl.constexpr,  # a decode cascade on a PDL GPU: let the suffix kernel start now (see pdl.py)
    BY_QUERY_ROW: tl.constexpr,  # the outputs' row is the query row (a decode cascade's), not the group row
):
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP  # query rows per tile
    tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    kv_head = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    num_q_heads = tl.num_programs(1) * GROUP
    r0 = tl.load(row_start_ptr + g)
    num_rows = tl.load(row_start_ptr + g + 1) - r0
    tok0 = tile * BLOCK_Q
    if tok0 >= num_rows:
        return
    prefix_len = tl.load(prefix_lens_ptr + g)
    part_len = tl.cdiv(tl.maximum(tl.cdiv(prefix_len, num_splits), min_split_len), BLOCK_N) * BLOCK_N
    start = split * part_len
    end = tl.minimum(start + part_len, prefix_len)

    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP  # [BLOCK_M] the group's row
    heads = kv_head * GROUP + r % GROUP  # [BLOCK_M] query head
    row_ok = (r < BLOCK_Q * GROUP) & (tok < num_rows)
    t = tl.load(rows_ptr + r0 + tok, mask=row_ok, other=0).to(tl.int64)  # the query row in the flat batch
    out_row = t if BY_QUERY_ROW else (r0 + tok).to(tl.int64)
    state = (out_row * num_q_heads + heads) * num_splits + split  # [BLOCK_M] row of the outputs
    if start >= end:
        tl.store(lse_ptr + state, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
        return
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (t * stride_qt + heads * stride_qh)[:, None] + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # m starts finite so that padding rows get p = 0, not exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + tl.load(prefix_rows_ptr + g).to(tl.int64) * stride_bt  # the leader's table
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _prefix_tile(
            acc, m_i, l_i, q, n0, end, bt_row, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
            scale_log2, HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, False, PRECISION, 0, 0, 0, False)
    if full_end < end:
        acc, m_i, l_i = _prefix_tile(
            acc, m_i, l_i, q, full_end, end, bt_row, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
            scale_log2, HEAD_DIM, PAGE, BLOCK_D, BLOCK_N, True, PRECISION, 0, 0, 0, False)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale  # (v_scale 1.0: exact)
    tl.store(o_ptr + state[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + state, m_i + tl.log2(l_i), mask=row_ok)  # a non-empty split: l_i >= 1


def choose_num_splits(max_group_rows: int, num_kv_heads: int, block_q: int, max_prefix_len: int,
                      num_sms: int) -> int:
    """Splits so that one group's programs fill the SMs once, one program an SM, each split >=
    _MIN_SPLIT_TOKENS keys; host-side ints only. The kernel after it (a decode step's suffix, started beside
    it by PDL) or beside it (a mixed step's prefill, on the main stream) runs its programs on the same SMs:
    a second prefix program on an SM leaves them no room until it ends (README, "Kernel choices"). Sized
    for one group: a CUDA graph's plan pads to MAX_GROUPS groups (worker/cascade.py), most steps have one,
    and its padding groups' programs return at once; more groups add programs."""
    programs = triton.cdiv(max_group_rows, block_q) * num_kv_heads
    cap = max(1, min(_MAX_SPLITS, max_prefix_len // _MIN_SPLIT_TOKENS))
    return max(1, min(num_sms // max(1, programs), cap))


def cascade_prefix_attention(
    query: torch.Tensor,  # [T, Hq, D], rotated
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    prefix_rows: torch.Tensor,  # [G] int32: the request whose table row holds each group's shared blocks
    prefix_lens: torch.Tensor,  # [G] int32, >= 1
    rows: torch.Tensor,  # [R] int32: the groups' query rows, group by group
    row_start: torch.Tensor,  # [G + 1] int32
    max_group_rows: int,  # host-side bound on row_start[g + 1] - row_start[g]
    max_prefix_len: int,  # host-side bound on prefix_lens
    scale: float,
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [R, Hq, S, D] float32, lse [R, Hq, S] float32): S partial states per row (see the
    reference for the exact semantics)."""
    return cascade_prefix_attention_splits(query, key_cache, value_cache, block_tables, prefix_rows, prefix_lens,
                                           rows, row_start, max_group_rows, max_prefix_len, scale,
                                           k_scale=k_scale, v_scale=v_scale)


def cascade_prefix_attention_splits(query, key_cache, value_cache, block_tables, prefix_rows, prefix_lens, rows,
                                    row_start, max_group_rows: int, max_prefix_len: int, scale: float,
                                    num_splits: int | None = None, block_m: int | None = None,
                                    num_warps: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                                    trigger: bool = False, by_query_row: bool = False
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """cascade_prefix_attention with an explicit launch config (None: the chosen one); tests and tuning.
    trigger: let the next kernel (a PDL launch) start beside this one (cascade_decode_attention).
    by_query_row: the states of query row t at o[t] / lse[t] ([T, Hq, S, ...]; rows in no group are left
    unwritten), so that a decode step's suffix kernel finds request b's at row b.
    The chosen split count is sized for max_prefix_len (a graph's bound): its splits keep >= _MIN_SPLIT_TOKENS
    keys, so a shorter prefix fills fewer of them and the rest return at once. An explicit count splits any
    prefix that many ways (whole tiles)."""
    num_rows = rows.shape[0]
    _, num_q_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    num_groups = prefix_lens.shape[0]
    assert key_cache.shape == value_cache.shape and key_cache.shape[3] == head_dim
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert key_cache.dtype == value_cache.dtype and key_cache.dtype in (query.dtype, FP8), \
        "tl.dot needs matching operand dtypes (FP8 caches convert)"
    check_kv_scales(key_cache, k_scale, v_scale)
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1 and prefix_rows.shape == (num_groups,)
    assert block_tables.dtype == prefix_rows.dtype == prefix_lens.dtype == rows.dtype == row_start.dtype == torch.int32
    assert row_start.shape == (num_groups + 1,) and rows.is_contiguous() and prefix_lens.is_contiguous()
    group = num_q_heads // num_kv_heads
    block_m = block_m or prefill_tiles.block_m(group)  # the prefill kernel's row tile, as the docstring says
    min_split_len = 1
    if num_splits is None:
        min_split_len = _MIN_SPLIT_TOKENS
        num_splits = choose_num_splits(max_group_rows, num_kv_heads, block_m // group, max_prefix_len,
                                       sm_count.num_sms(query.device))
    f32 = dict(dtype=torch.float32, device=query.device)
    out_rows = query.shape[0] if by_query_row else num_rows
    o = torch.empty((out_rows, num_q_heads, num_splits, head_dim), **f32)
    lse = torch.empty((out_rows, num_q_heads, num_splits), **f32)
    if num_rows == 0 or num_groups == 0:
        return o, lse
    grid = (triton.cdiv(max_group_rows, block_m // group) * num_splits, num_kv_heads, num_groups)
    _cascade_prefix_kernel[grid](
        query, key_cache, value_cache, o, lse, block_tables, prefix_rows, prefix_lens, rows, row_start,
        scale * k_scale * _LOG2E, v_scale,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0), num_splits,
        min_split_len,
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=32 if head_dim > 128 else 64,
        # fp32 caches are the correctness mode (tiny models vs HF): exact fp32 dots, not tf32.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps or (8 if head_dim > 128 else 4), num_stages=3 if query.element_size() <= 2 else 2,
        TRIGGER=trigger, BY_QUERY_ROW=by_query_row,
    )
    return o, lse


def cascade_decode_attention(
    query: torch.Tensor,  # [B, Hq, D], rotated: one decode row per request
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_start: torch.Tensor,  # [B] int32: each request's suffix start (its group's prefix length; 0 alone)
    prefix_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    rows: torch.Tensor,  # [R] int32 (-1: padding)
    row_start: torch.Tensor,
    max_group_rows: int,
    max_prefix_len: int,
    max_suffix_len: int,  # host-side bound on seq_len - kv_start
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """A decode step's cascade attention (see the reference) in two launches: the prefix kernel, then paged
    decode over the suffixes, which folds each grouped row's prefix states into its out as it finishes the
    row (no merge launch). With PDL (pdl.py) the suffix kernel starts while the prefix kernel runs, and waits
    for it only before those merges. The prefix kernel writes request b's states at row b, and the suffix
    kernel reads them where kv_start[b] > 0: a request is in a group exactly then (prefixes have >= 1 token).
    """
    if rows.shape[0] == 0 or prefix_lens.shape[0] == 0:  # no prefix launch: the suffix must not skip its wait
        return launch_chosen(query, key_cache, value_cache, block_tables, seq_lens, max_suffix_len, scale,
                             kv_start=kv_start, k_scale=k_scale, v_scale=v_scale)
    prefix_o, prefix_lse = cascade_prefix_attention_splits(
        query, key_cache, value_cache, block_tables, prefix_rows, prefix_lens, rows, row_start,
        max_group_rows, max_prefix_len, scale, k_scale=k_scale, v_scale=v_scale,
        trigger=pdl.enabled(query.device), by_query_row=True)
    out, _ = launch_chosen(query, key_cache, value_cache, block_tables, seq_lens, max_suffix_len, scale,
                           kv_start=kv_start, return_lse=True, k_scale=k_scale, v_scale=v_scale,
                           cascade=CascadeSuffix(prefix_o, prefix_lse))
    return out
