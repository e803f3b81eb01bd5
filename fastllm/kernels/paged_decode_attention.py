"""Paged decode attention (one query token per request), flash-decoding style.

Math, per request b and query head h (kv head g = h // (Hq / Hkv)), over its L = seq_lens[b] cached tokens:
    s_j = scale * q . k_j,   out = sum_j softmax(s)_j v_j        (j < L; L = 0 gives out = 0)
Each request's KV sequence is cut into `num_splits` equal parts (whole BLOCK_N tiles, sized in the kernel
from its own seq_len). Pass 1 (grid B x Hkv x splits) runs an online softmax over one part for all
Hq/Hkv query heads of one KV group at once: the group is padded to 16 rows so that q @ K^T and p @ V
are tensor-core tl.dot's, and each K/V tile is loaded once per group rather than once per head. It
writes the partial output o_s (already divided by its own softmax sum) and
lse_s = log2(sum_j exp2(s_j log2 e)). The splits are then merged, BLOCK_S at a time:
    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),   M = max_s lse_s.
The merge runs in the same launch: each split, once its partials are stored, counts itself done on a
per-(request, KV head) counter (an acq_rel atomic after a block barrier), and the one that counts last
merges the group's splits and zeroes the counter for the next launch. A second kernel for the merge was
launch-bound time per layer at small batches (merge_in_kernel=False keeps that layout for comparison: the
same merge in a second launch, grid B x Hkv). Splits past the end of a
request's sequence (start >= seq_len) return at once and neither count nor write: the merge recomputes
from seq_len how many splits hold keys, so a loose max_seq_len bound costs only empty programs. With one
split the kernel writes `out` directly.

A request may attend only keys kv_lo .. L - 1: kv_lo = L - window under a sliding window, or kv_start[b]
(cascade attention's suffix, whose shared prefix another kernel reads). The splits then cut kv_base .. L - 1,
kv_base = kv_lo rounded down to a tile, and the keys below kv_lo are masked (their blocks may be freed): the
work a request costs, and the split count chosen for a window, follow the keys it attends, not its context.
return_lse also writes each row's lse (base 2), which merge_attn_states needs to fold in another part. A
decode cascade's suffix launch (CascadeSuffix) folds in its requests' prefix states itself, at the end
(cascade_attention.cascade_decode_attention).

rotary_decode_attention (APPEND) is the engine's decode step in one launch: q and the step's new key are
rotated in the kernel (rotary.py's math at full width, each element with its pair partner), split 0 of each
(request, KV head) writes the new k/v into the cache (skipped for slot < 0), and the split holding position
seq_len - 1 adds the new token to its online softmax from registers, so no program reads that slot back
and nothing orders the write before the other splits' reads. With q/k norm weights (Qwen3) each q head and
the new k are RMS-normed first (rotary.py's math), so the norm costs no launch either. It replaced a rotary
+ KV-write launch per layer, which cost more than the work it adds here (README, "Kernel choices").

An FP8 cache (kv_cache_dtype="fp8") is read as e4m3 and converted in registers (to fp16 under 16-bit
queries, q too; to float32 under float32 ones), k_scale folded
into the softmax scale and v_scale into each split's output (kv_fp8.py); the APPEND step stores the new
k/v as e4m3 and attends to them as stored.

Launch config (split count, BLOCK_N, warps, stages, minimum split length) comes from a host-side table
(`choose_config`) that depends only on max_seq_len (a host-side bound), batch, Hkv, head_dim, dtypes (an
FP8 cache has a rule of its own) and the SM count, never on device values: no host sync, and a CUDA graph
replays the same launch for any seq_lens.
Each request sizes its own splits from its seq_len (at least min_split_len keys each), so a request that
fits one split writes `out` directly and the rest of its splits return at once. It is not a triton.autotune: the
engine's warm-up before graph capture runs on all-padding batches (seq_len 0 / 1), where timings mean
nothing. The table was measured on an H100 with benchmarks/kernels/tune.py (which times every candidate).

Memory traffic (decode is bandwidth-bound; K/V dominate):
    bytes = sum_b L_b * Hkv * D * 2 * cache.element_size()          (K and V, read once per group)
          + 2 * B * Hq * D * query.element_size()                      (q in, out)
          + B * Hq * splits * (D + 1) * 4 * 2   if splits > 1         (partials written, read back)
Block-table reads are a few bytes per page and are ignored (see bytes_moved).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastllm.kernels import pdl, sm_count
from fastllm.kernels.kv_fp8 import to_cache
from fastllm.kernels.merge_attn_states import merge_prefix_states
from fastllm.kernels.reference import FP8, check_kv_scales
from fastllm.kernels.rotary import check_qk_norm, head_rms_norm
from fastllm.kernels.split_counters import split_counters

_LOG2E = 1.4426950408889634
_MIN_GROUP_ROWS = 16  # tl.dot needs M >= 16
_MIN_SPLIT_TOKENS = 256  # below this a split is mostly fixed cost (q load, partial write, reduce input)
# Beyond ~64 splits the merge (B x Hq programs, each walking its splits BLOCK_S at a time) costs more than
# the extra parallelism gains (README, "Kernel choices").
_MAX_SPLITS = 64
_WAVES = 3  # B x Hkv x splits ~ 3 programs per SM: the fastest split counts at B1 and B8 land there

# (block_n, num_warps, num_stages) that tune.py times; choose_config picks among them: a 16-bit cache's by
# _SIXTEEN_BIT_TILES, [1] (128 keys) for long-context bounds (_LONG_CONTEXT), [2] above head_dim 128, [0] for
# fp32 queries and below an FP8 cache's or a cascade suffix's own rules, [3] for a cascade's suffix beside its
# prefix, [4] for an FP8 cache's one-warp programs. [1] was faster at small batches too but flipped a greedy
# token at a 0.12-nat margin in the tiny bf16 Llama-3.1 engine test (bound 256), so below _LONG_CONTEXT it
# stays out until its rounding is compared with the 64-key tile's.
TILE_CONFIGS = [(64, 4, 2), (128, 4, 3), (32, 4, 2), (16, 2, 2), (32, 1, 2), (64, 2, 3), (32, 1, 3)]
# A 16-bit cache's tile by B x Hkv programs a SM: (below this many, tile). Fewer warps a program let an SM
# hold more programs to hide the loads' latency, but which tile wins moves with how the programs fill the
# SMs' slots, not steadily with the batch: measured at every decode graph's batch up to 128 and ten more
# up to 512 (H200, Llama-3-8B's heads, the engine's launch over ragged contexts; README, "Kernel choices").
_SIXTEEN_BIT_TILES = ((1, TILE_CONFIGS[5]), (5, TILE_CONFIGS[0]), (8.5, TILE_CONFIGS[6]),
                      (10, TILE_CONFIGS[3]), (float("inf"), TILE_CONFIGS[6]))
# An FP8 cache under 16-bit queries with B x Hkv >= _FP8_MANY_PROGRAMS_PER_SM a SM takes one-warp programs of
# 32-key tiles (TILE_CONFIGS[4]), not the 16-bit tiles: a program converts twice the keys a byte of
# a 16-bit cache, and one warp's softmax, layout changes and block barriers wait on no other warp. From 1.5
# programs a SM under a bound of _FP8_LONG_BOUND it takes them too; below, a short bound keeps the 64-key
# 4-warp tile (one-warp programs were up to 18% slower on requests of 128 keys). Their split count fills
# one wave of them (_fp8_one_warp_config; docs/fp8.md, on decode attention over an FP8 cache).
_FP8_MANY_PROGRAMS_PER_SM = 5
_FP8_LONG_BOUND = 2048
_FP8_MIN_SPLIT_LEN = 128
# Resident one-warp programs a SM over an FP8 cache, their dots swapped (sm_90, Triton 3.6): the in-kernel
# merge's variant takes 168 registers a thread (18 KB of shared memory), the unsplit one 177.
_FP8_SPLIT_PROGRAMS_PER_SM = 12
_FP8_UNSPLIT_PROGRAMS_PER_SM = 11
# A decode cascade's suffix, whose programs share each SM with a prefix program, takes 16-key 2-warp tiles
# (TILE_CONFIGS[3]) from this many per SM (README, "Kernel choices": they won at ~3.9 programs a SM, lost
# at ~1.9)
_MANY_PROGRAMS_PER_SM_BESIDE_PREFIX = 3
_MIN_BUSY_SPLIT_TOKENS = 512  # min_split_len once B x Hkv >= the SM count
# A 16-bit cache's B x Hkv from this many per SM: no split (the requests' own programs fill the SMs; an FP8
# cache's requests of ~1000 keys still gained from two there)
_NO_SPLIT_PROGRAMS_PER_SM = 2.5
# From this bound on, a request that splits takes 128-key tiles in ~2 programs a SM (TILE_CONFIGS[1]): its
# splits hold >= 8 such tiles, which then beat more splits of 64-key tiles and match cuDNN's SDPA on the same
# K/V laid out contiguously (README, "Kernel choices"). Shorter bounds keep the 64-key tile (see
# TILE_CONFIGS on its rounding).
_LONG_CONTEXT = 16384


def split_candidates(max_seq_len: int, batch: int, num_kv_heads: int, num_sms: int) -> list[int]:
    """Split counts tune.py times around the table's choice."""
    chosen = choose_num_splits(max_seq_len, batch, num_kv_heads, num_sms)
    cap = max(1, min(_MAX_SPLITS, max_seq_len // _MIN_SPLIT_TOKENS))
    return sorted({max(1, chosen // 2), chosen, min(cap, chosen * 2)})


class DecodeConfig(NamedTuple):
    num_splits: int
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    min_split_len: int = 0  # a request shorter than num_splits x this uses fewer splits (0: one tile)


class CascadeSuffix(NamedTuple):
    """A decode cascade's suffix launch (cascade_attention.cascade_decode_attention): each request with prefix
    states (kv_start[b] > 0) folds them into its out once its suffix is done, after the prefix kernel (the
    kernel before this one) has finished (pdl.wait; this launch skips the usual wait at its start)."""
    prefix_o: torch.Tensor  # [B, Hq, S, D] float32: request b's prefix states at row b
    prefix_lse: torch.Tensor  # [B, Hq, S] float32


class NewTokens(NamedTuple):
    """rotary_decode_attention's step: each request's new token before rotary, and where it goes."""
    positions: torch.Tensor  # [B] int
    key: torch.Tensor  # [B, Hkv, D] (strided view allowed; not modified)
    value: torch.Tensor  # [B, Hkv, D]
    cos_sin_cache: torch.Tensor  # [max_positions, D] float32: cos in [:, :D/2], sin in [:, D/2:]
    is_neox: bool
    slot_mapping: torch.Tensor  # [B] int; < 0: padding, writes nothing
    q_norm_weight: torch.Tensor | None = None  # [D]: RMS-norm each q head and the new k first (Qwen3)
    k_norm_weight: torch.Tensor | None = None  # [D]
    norm_eps: float = 1e-6


# The merge's [heads, splits, head_dim] fp32 tile stays within this many elements a warp (64 registers a
# thread), BLOCK_S splits a step: sized for 4 warps, a one-warp program held 256 a thread and spilled.
_MERGE_TILE_ELEMENTS_PER_WARP = 2048
_MAX_MERGE_BLOCK_S = 16


def merge_block_s(block_gm: int, block_d: int, num_warps: int) -> int:
    """BLOCK_S: the splits the merge reads a step, for its BLOCK_GM x BLOCK_D rows."""
    return max(2, min(_MAX_MERGE_BLOCK_S, _MERGE_TILE_ELEMENTS_PER_WARP * num_warps // (block_gm * block_d)))


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """split_counters.py's buffer for this kernel. Launches split only while B x Hkv < 5 programs per SM
    (choose_config), so 4096 counters cover any GPU of up to 819 SMs."""
    return split_counters("decode attention", device, n)


@triton.jit(do_not_specialize=["stride_bt", "min_split_len"])  # eager steps' table width varies: one variant
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr,
    counters_ptr,  # int32 [B * Hkv], all 0 between launches (MERGE_IN_KERNEL)
    pos_ptr, k_new_ptr, v_new_ptr, cos_sin_ptr, slot_ptr,  # APPEND: this step's token of each request
    q_norm_ptr, k_norm_ptr, norm_eps,  # APPEND and QK_NORM: each head's RMSNorm weight [HEAD_DIM] for q and k
    kv_start_ptr,  # int32 [B] (HAS_KV_START): request b attends no key before kv_start[b]
    lse_ptr,  # float32 [B, Hq] (RETURN_LSE): log2 of each row's softmax denominator
    prefix_o_ptr, prefix_lse_ptr, num_prefix_splits,  # CASCADE: CascadeSuffix's prefix states and their S
    window,  # SLIDING: keys seq_len - window .. seq_len - 1 only
    scale_log2,  # scale * k_scale * log2(e): softmax runs in base 2 (k_scale: 1.0 but for an FP8 cache)
    k_scale, v_scale,  # an FP8 cache's scales (the new k/v are divided by them; outputs times v_scale)
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cs,
    num_splits,  # runtime int: a new batch size must not recompile
    min_split_len,  # a multiple of BLOCK_N: shorter requests use fewer splits
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr,  # one split: write out here, no reduce pass
    MERGE_IN_KERNEL: tl.constexpr,  # the group's last split to finish merges them (no pass 2)
    BLOCK_GM: tl.constexpr, BLOCK_S: tl.constexpr,  # the merge's tile: query heads x splits (x BLOCK_D)
    PRECISION: tl.constexpr,
    DOT_F16: tl.constexpr,  # an FP8 cache under 16-bit queries: fp16 dots (see the loop)
    V_IN_REGISTERS: tl.constexpr,  # DOT_F16 on a GPU: V converted before its transpose (see the loop)
    SWAP_DOTS: tl.constexpr,  # the dots as K @ q^T and V^T @ p^T (see the loop; BLOCK_G >= 8 then)
    APPEND: tl.constexpr,  # rotate q and the new k here, write the new k/v, attend to them from registers
    IS_NEOX: tl.constexpr, HALF: tl.constexpr,  # APPEND's rotary layout
    QK_NORM: tl.constexpr,  # APPEND: RMS-norm q's heads and the new k before rotating them
    USE_PDL: tl.constexpr,  # launched with PDL (pdl.py): seq_lens (staged step input) is read before the wait
    OFFSET_64: tl.constexpr,  # a cache of 2^31 elements or more: page offsets in int64, else int32
    HAS_KV_START: tl.constexpr, SLIDING: tl.constexpr, RETURN_LSE: tl.constexpr,
    CASCADE: tl.constexpr,  # a decode cascade's suffix (CascadeSuffix)
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if not CASCADE:  # (a cascade's suffix follows the prefix kernel, which started after the step's writes)
        pdl.wait(USE_PDL)
    # Keys [kv_lo, seq_len) are attended; the splits cut [kv_base, seq_len), kv_base the tile boundary at or
    # below kv_lo, so that tiles stay aligned (see k_in_page below) and the keys before kv_lo are masked.
    kv_lo = _first_key(seq_len, kv_start_ptr, b, window, HAS_KV_START, SLIDING)
    kv_base = (kv_lo // BLOCK_N) * BLOCK_N
    kv_len = seq_len - kv_base
    part_len = _split_len(kv_len, num_splits, min_split_len, BLOCK_N)
    start = kv_base + split * part_len
    end = tl.minimum(start + part_len, seq_len)  # start >= end: an empty split
    if not DIRECT_OUT:
        if start >= end:
            if MERGE_IN_KERNEL and split == 0:  # seq_len 0: nothing to merge, out = 0
                g0 = tl.arange(0, BLOCK_GM)
                d0 = tl.arange(0, BLOCK_D)
                tl.store(out_ptr + b * stride_ob + (kv_head * GROUP + g0)[:, None] * stride_oh + d0[None, :],
                         tl.zeros([BLOCK_GM, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
                         mask=(g0 < GROUP)[:, None] & (d0 < HEAD_DIM)[None, :])
                if RETURN_LSE:
                    tl.store(lse_ptr + b * tl.num_programs(1) * GROUP + kv_head * GROUP + g0,
                             tl.full([BLOCK_GM], float("-inf"), tl.float32), mask=g0 < GROUP)
            return  # the merge only reads the splits that hold keys

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g  # [BLOCK_G] query heads of this KV group (rows >= GROUP are padding)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    keys_end = end  # the keys read from the cache: [start, keys_end)
    # m starts finite so that rows with no valid key give p = 0 rather than exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if APPEND:
        # This step's token sits at position seq_len - 1. Every split rotates q; split 0 writes the new
        # k/v into the cache, and the split that holds position seq_len - 1 takes them from registers
        # (no split reads that slot from the cache, so nothing waits on the write).
        cos, sin, pair, sign = _rope_row(cos_sin_ptr + tl.load(pos_ptr + b).to(tl.int64) * stride_cs, d, d_ok,
                                         HALF, IS_NEOX)
        q_pair = tl.load(q_rows + pair[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        k_row = k_new_ptr + b * stride_knb + kv_head * stride_knh
        k_new = tl.load(k_row + d, mask=d_ok, other=0.0)
        k_pair = tl.load(k_row + pair, mask=d_ok, other=0.0)
        if QK_NORM:  # padding rows and columns load 0 and add nothing to a head's mean square
            qf, kf = q.to(tl.float32), k_new.to(tl.float32)
            q_inv_rms = tl.rsqrt(tl.sum(qf * qf, axis=1) / HEAD_DIM + norm_eps)[:, None]
            k_inv_rms = tl.rsqrt(tl.sum(kf * kf, axis=0) / HEAD_DIM + norm_eps)
            qw = tl.load(q_norm_ptr + d, mask=d_ok, other=0.0)
            qw_pair = tl.load(q_norm_ptr + pair, mask=d_ok, other=0.0)
            kw = tl.load(k_norm_ptr + d, mask=d_ok, other=0.0)
            kw_pair = tl.load(k_norm_ptr + pair, mask=d_ok, other=0.0)
            q = head_rms_norm(q, qw[None, :], q_inv_rms, q_ptr.dtype.element_ty)
            q_pair = head_rms_norm(q_pair, qw_pair[None, :], q_inv_rms, q_ptr.dtype.element_ty)
            k_new = head_rms_norm(k_new, kw, k_inv_rms, k_new_ptr.dtype.element_ty)
            k_pair = head_rms_norm(k_pair, kw_pair, k_inv_rms, k_new_ptr.dtype.element_ty)
        q = _rotate(q, q_pair, cos[None, :], sin[None, :], sign[None, :]).to(q_ptr.dtype.element_ty)
        k_new = _rotate(k_new, k_pair, cos, sin, sign)
        # rounded as rotary_kv_cache_write rounds it: to the activations' dtype, then to the cache's
        k_new = to_cache(k_new.to(k_new_ptr.dtype.element_ty), k_scale, k_cache_ptr.dtype.element_ty)
        v_new = to_cache(tl.load(v_new_ptr + b * stride_vnb + kv_head * stride_vnh + d, mask=d_ok, other=0.0),
                         v_scale, v_cache_ptr.dtype.element_ty)
        new_slot = tl.load(slot_ptr + b).to(tl.int64)  # < 0: a padding row, writes nothing
        if (split == 0) & (new_slot >= 0):
            page_of, in_page = new_slot // PAGE, new_slot % PAGE
            tl.store(k_cache_ptr + page_of * stride_kb + in_page * stride_ks + kv_head * stride_kh + d, k_new,
                     mask=d_ok)
            tl.store(v_cache_ptr + page_of * stride_vb + in_page * stride_vs + kv_head * stride_vh + d, v_new,
                     mask=d_ok)
        keys_end = tl.minimum(end, seq_len - 1)
        # The new token is the online softmax's first step (-inf where another split holds it), so its k/v
        # die before the loop: held across it, they took a 64-key 4-warp program over an FP8 cache from
        # 102 to 136 registers, 3 programs a SM rather than 4 (1.76x the time at B64 x 3840, H200).
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale_log2  # [BLOCK_G]
        s_new = tl.where(keys_end < end, s_new, float("-inf"))
        m_i = tl.maximum(m_i, s_new)
        l_i = tl.exp2(s_new - m_i)  # 1 where this split holds the new token, else 0
        acc = l_i[:, None] * v_new.to(tl.float32)[None, :]

    bt_row = block_tables_ptr + b * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    col = tl.arange(0, BLOCK_N)
    # A tile of at least a page starts on a page boundary (splits are whole tiles, both are powers of two),
    # so each column's slot in its page, and with it the in-page part of its K/V offsets, is the same every
    # tile: computed once here, a tile then adds one page base per column. Address math was ~half of
    # the loop's instructions (ncu), and short-context decode is issue-bound:
    # for the same reason page offsets stay int32 unless the cache is too large for them (OFFSET_64).
    k_in_page = (col % PAGE)[None, :] * stride_ks + d[:, None]  # [BLOCK_D, BLOCK_N]
    v_in_page = (col % PAGE)[:, None] * stride_vs + d[None, :]  # [BLOCK_N, BLOCK_D]
    # An FP8 cache's tiles convert to fp16 (q too): e4m3 -> fp16 is one conversion a pair of elements, ->
    # bf16 three. e4m3 is exact in fp16, and so is a bf16 q inside fp16's range (saturated beyond +-65504,
    # far past any model's queries); p in [0, 1] rounds finer in fp16 than in bf16.
    q_dot = q
    if DOT_F16:
        q_dot = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    if SWAP_DOTS:
        # The query heads as the dots' N side (8 wide on a tensor core) rather than their M side (16 rows):
        # a one-warp program's accumulator and q take half the registers.
        q_dot = tl.trans(q_dot)  # [BLOCK_D, BLOCK_G]
        acc = tl.trans(acc)  # [BLOCK_D, BLOCK_G]
    # The scores' key axis ([BLOCK_N, BLOCK_G] swapped, else [BLOCK_G, BLOCK_N]); acc's heads on the other.
    KEY_AXIS: tl.constexpr = 0 if SWAP_DOTS else 1
    for n0 in range(start, keys_end, BLOCK_N):
        n = n0 + col  # [BLOCK_N] token positions; a tile may span several pages
        n_ok = n < keys_end
        if HAS_KV_START or SLIDING:
            n_ok = n_ok & (n >= kv_lo)  # (a freed block's table entry is never read either)
        page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0)
        if OFFSET_64:
            page = page.to(tl.int64)
        if BLOCK_N >= PAGE:
            k_off = page[None, :] * stride_kb + k_in_page
            v_off = page[:, None] * stride_vb + v_in_page
        else:  # a tile inside one page, at any offset in it
            slot = n % PAGE
            k_off = page[None, :] * stride_kb + slot[None, :] * stride_ks + d[:, None]
            v_off = page[:, None] * stride_vb + slot[:, None] * stride_vs + d[None, :]
        k = tl.load(k_head + k_off, mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N] = K^T
        # Masked tokens must load 0, not whatever is in the slot: p = 0 times NaN is still NaN.
        v = tl.load(v_head + v_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        k = k.to(q_dot.dtype)  # (an FP8 cache's e4m3, exactly; else a no-op)
        v = v.to(q_dot.dtype)
        if V_IN_REGISTERS:
            # p @ v reads v transposed, which ldmatrix does for 16-bit elements only: left alone, Triton
            # moves the conversion after the transpose and gathers e4m3 bytes from shared memory one at a
            # time. An opaque identity (not pure: not moved) keeps the conversion here, in registers.
            v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=v.dtype, is_pure=False, pack=2)
        if SWAP_DOTS:
            s = tl.dot(tl.trans(k), q_dot, input_precision=PRECISION)
        else:
            s = tl.dot(q_dot, k, input_precision=PRECISION)
        p, m_i, alpha, l_i = _online_softmax_step(s, n_ok, m_i, l_i, scale_log2, KEY_AXIS)
        p = p.to(v.dtype)
        acc = acc * tl.expand_dims(alpha, KEY_AXIS)
        if SWAP_DOTS:
            acc = tl.dot(tl.trans(v), p, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(p, v, acc, input_precision=PRECISION)
    if SWAP_DOTS:
        acc = tl.trans(acc)  # [BLOCK_G, BLOCK_D]
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale  # seq_len 0: o = 0 (v_scale 1.0: exact)
    row_mask = g_ok[:, None] & d_ok[None, :]
    if DIRECT_OUT or part_len >= kv_len:  # this request's keys are all in this split: nothing to merge
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_mask)
        if RETURN_LSE:
            tl.store(lse_ptr + b * tl.num_programs(1) * GROUP + heads,
                     tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf")), mask=g_ok)
        if CASCADE:
            _merge_prefix_states(b, kv_head, out_ptr, stride_ob, stride_oh, lse_ptr, kv_start_ptr,
                                 prefix_o_ptr, prefix_lse_ptr, num_prefix_splits, GROUP, HEAD_DIM, BLOCK_G,
                                 BLOCK_D, USE_PDL)
    else:
        # partials: part_o [B, Hq, splits, HEAD_DIM] fp32, part_lse [B, Hq, splits] fp32
        row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=row_mask)
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=g_ok)  # a non-empty split: l_i >= 1
        if MERGE_IN_KERNEL:
            # Count this split done; the last of the group's non-empty splits to get here merges them.
            # The barrier puts every thread's partial stores before the counter's release; the
            # acquire side reads partials past L1 (.cg), where another SM's writes may not be.
            tl.debug_barrier()
            counter = counters_ptr + b * tl.num_programs(1) + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            n_active = tl.cdiv(kv_len, part_len)
            if done == n_active - 1:
                tl.store(counter, 0)  # every other split has counted: ready for the next launch
                _merge_splits(part_o_ptr, part_lse_ptr, out_ptr + b * stride_ob, stride_oh,
                              (b * tl.num_programs(1) * GROUP + kv_head * GROUP) * num_splits, num_splits,
                              n_active, kv_head * GROUP, lse_ptr + b * tl.num_programs(1) * GROUP, GROUP,
                              HEAD_DIM, BLOCK_GM, BLOCK_S, BLOCK_D, RETURN_LSE)
                if CASCADE:
                    _merge_prefix_states(b, kv_head, out_ptr, stride_ob, stride_oh, lse_ptr, kv_start_ptr,
                                         prefix_o_ptr, prefix_lse_ptr, num_prefix_splits, GROUP, HEAD_DIM,
                                         BLOCK_G, BLOCK_D, USE_PDL)


@triton.jit
def _online_softmax_step(s, key_ok, m_i, l_i, scale_log2, KEY_AXIS: tl.constexpr):
    """One tile of the online softmax: s holds unscaled scores with the keys along KEY_AXIS; m_i and l_i are
    the heads' running max (log2 units) and sum. Returns the tile's weights p, the new max, the factor that
    rescales what was summed before (alpha) and the new sum."""
    s = tl.where(tl.expand_dims(key_ok, 1 - KEY_AXIS), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=KEY_AXIS) * scale_log2)
    p = tl.exp2(s * scale_log2 - tl.expand_dims(m_new, KEY_AXIS))
    alpha = tl.exp2(m_i - m_new)
    return p, m_new, alpha, l_i * alpha + tl.sum(p, axis=KEY_AXIS)


@triton.jit
def _merge_prefix_states(b, kv_head, out_ptr, stride_ob, stride_oh, lse_ptr, kv_start_ptr, prefix_o_ptr,
                         prefix_lse_ptr, num_prefix_splits, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """Request b's suffix attention is in out and lse (its KV group's heads): once the prefix kernel's writes
    are visible, fold in b's prefix states (row b) if it has any (kv_start[b] > 0). Every request waits, so
    this grid ends after the prefix kernel (whose buffers may be freed once it does)."""
    tl.debug_barrier()  # this program's out and lse stores, read back below
    pdl.wait(USE_PDL)
    if tl.load(kv_start_ptr + b) > 0:
        g = tl.arange(0, BLOCK_G)
        heads = kv_head * GROUP + g
        num_q_heads = tl.num_programs(1) * GROUP
        merge_prefix_states(out_ptr + b * stride_ob + heads * stride_oh, lse_ptr + b * num_q_heads + heads,
                            prefix_o_ptr, prefix_lse_ptr, (b * num_q_heads + heads) * num_prefix_splits,
                            num_prefix_splits, g < GROUP, HEAD_DIM, BLOCK_D)


@triton.jit
def _rope_row(cs_row, d, d_ok, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Rotary at full width: y[d] = x[d] cos + sign[d] x[pair[d]] sin, the rotation of rotary.py with each
    element's pair partner (d +- D/2 for the neox layout, d ^ 1 interleaved). Returns fp32 cos and sin at
    every d, pair and sign."""
    if IS_NEOX:
        low = d < HALF
        i = tl.where(low, d, d - HALF)
        pair = tl.where(low, d + HALF, d - HALF)
    else:
        low = d % 2 == 0
        i = d // 2
        pair = d ^ 1
    cos = tl.load(cs_row + i, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + i, mask=d_ok, other=0.0).to(tl.float32)
    return cos, sin, pair, tl.where(low, -1.0, 1.0)


@triton.jit
def _rotate(x, x_pair, cos, sin, sign):
    return x.to(tl.float32) * cos + sign * (x_pair.to(tl.float32) * sin)


@triton.jit
def _split_len(kv_len, num_splits, min_split_len, BLOCK_N: tl.constexpr):
    """Keys per split for one request of kv_len keys: whole tiles, at least min_split_len; splits
    0 .. cdiv(kv_len, split_len) - 1 hold keys."""
    return tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N, min_split_len)


@triton.jit
def _first_key(seq_len, kv_start_ptr, b, window, HAS_KV_START: tl.constexpr, SLIDING: tl.constexpr):
    """The lowest key position request b attends to (its one query sits at seq_len - 1)."""
    lo = seq_len * 0
    if HAS_KV_START:
        lo = tl.load(kv_start_ptr + b)
    if SLIDING:
        lo = tl.maximum(lo, seq_len - window)
    return lo


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, out_row_ptr, stride_oh, first_row, num_splits, n_active, first_head,
                  lse_row_ptr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_GM: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, RETURN_LSE: tl.constexpr):
    """out[h] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) over splits 0 .. n_active - 1, for the GROUP
    query heads whose partial rows start at first_row (head-major, num_splits rows each); with RETURN_LSE
    also lse_row[h] = M + log2(sum_s 2^(lse_s - M))."""
    g = tl.arange(0, BLOCK_GM)
    g_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows = first_row + g * num_splits  # [BLOCK_GM]: each head's split 0
    # m starts finite: padding heads (all -inf) then get weight 0 rather than exp2(-inf + inf) = NaN
    m = tl.full([BLOCK_GM], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_GM], tl.float32)
    acc = tl.zeros([BLOCK_GM, BLOCK_D], tl.float32)
    for s0 in range(0, n_active, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        gs_ok = g_ok[:, None] & (s < n_active)[None, :]  # [BLOCK_GM, BLOCK_S]
        gs = rows[:, None] + s[None, :]
        lse = tl.load(part_lse_ptr + gs, mask=gs_ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_o_ptr + gs[:, :, None] * HEAD_DIM + d[None, None, :],
                    mask=gs_ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        w = tl.exp2(lse - m_new[:, None])  # [BLOCK_GM, BLOCK_S]
        alpha = tl.exp2(m - m_new)
        den = den * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        m = m_new
    out = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(out_row_ptr + (first_head + g)[:, None] * stride_oh + d[None, :],
             out.to(out_row_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        has_keys = den > 0.0
        tl.store(lse_row_ptr + first_head + g, tl.where(has_keys, m + tl.log2(tl.where(has_keys, den, 1.0)),
                                                        float("-inf")), mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, kv_start_ptr, lse_ptr, window, stride_ob, stride_oh,
    num_splits, min_split_len,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_GM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_KV_START: tl.constexpr, SLIDING: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """Pass 2 of the two-kernel layout: the same merge as the in-kernel one, one program per (b, KV head)."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    # the same split sizes as pass 1: splits 0 .. n_active - 1 hold keys (none when seq_len is 0: out = 0)
    kv_lo = _first_key(seq_len, kv_start_ptr, b, window, HAS_KV_START, SLIDING)
    kv_len = seq_len - (kv_lo // BLOCK_N) * BLOCK_N
    n_active = tl.cdiv(kv_len, _split_len(kv_len, num_splits, min_split_len, BLOCK_N))
    if n_active == 1:
        return  # pass 1 wrote out
    _merge_splits(part_o_ptr, part_lse_ptr, out_ptr + b * stride_ob, stride_oh,
                  (b * tl.num_programs(1) * GROUP + kv_head * GROUP) * num_splits, num_splits,
                  n_active, kv_head * GROUP, lse_ptr + b * tl.num_programs(1) * GROUP, GROUP, HEAD_DIM, BLOCK_GM,
                  BLOCK_S, BLOCK_D, RETURN_LSE)


def _cdiv(a: int, b: int) -> int:
    # (triton.cdiv is a constexpr function in newer Tritons, slow to call from the host, where the table
    # runs for every layer of an eager step)
    return -(-a // b)


def legacy_config(max_seq_len: int, batch: int, num_kv_heads: int, head_dim: int, num_sms: int) -> DecodeConfig:
    """The launch before tuning (kept for tune.py's comparison): 2 waves, >= 256 tokens a split, <= 64."""
    want = _cdiv(2 * num_sms, max(1, batch * num_kv_heads))
    splits = max(1, min(want, max(1, min(64, max_seq_len // 256))))
    return DecodeConfig(splits, 32 if head_dim > 128 else 64, 4, 2)


def choose_num_splits(max_seq_len: int, batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits so that B x Hkv x splits is ~_WAVES programs per SM, each split >= _MIN_SPLIT_TOKENS tokens.

    Only host-side ints: the same arguments give the same launch (CUDA-graph safe).
    """
    base = max(1, batch * num_kv_heads)
    want = _cdiv(_WAVES * num_sms, base)
    cap = max(1, min(_MAX_SPLITS, max_seq_len // _MIN_SPLIT_TOKENS))
    return max(1, min(want, cap))


def _fp8_one_warp_config(max_seq_len: int, programs: int, num_sms: int) -> DecodeConfig:
    """One-warp programs over an FP8 cache: as many splits as fit one wave of split programs (each >=
    _FP8_MIN_SPLIT_LEN keys: a short request takes fewer); where not even two fit, one split, launched as
    two of the bound's length (every request in one, as the in-kernel merge's variant) where that variant's
    extra program a SM saves a wave. (Splits over several waves won only at requests near a bound of 4096,
    and lost 12-20% at 1024 keys: docs/fp8.md.)"""
    splits = min(_MAX_SPLITS, _FP8_SPLIT_PROGRAMS_PER_SM * num_sms // programs,
                 max_seq_len // _FP8_MIN_SPLIT_LEN)
    if splits >= 2:
        return DecodeConfig(splits, *TILE_CONFIGS[4], _FP8_MIN_SPLIT_LEN)
    split_waves = _cdiv(programs, _FP8_SPLIT_PROGRAMS_PER_SM * num_sms)
    if split_waves < _cdiv(programs, _FP8_UNSPLIT_PROGRAMS_PER_SM * num_sms):
        return DecodeConfig(2, *TILE_CONFIGS[4], max_seq_len)
    return DecodeConfig(1, *TILE_CONFIGS[4], 0)


def choose_config(max_seq_len: int, batch: int, num_kv_heads: int, head_dim: int, num_sms: int,
                  element_size: int = 2, beside_prefix: bool = False,
                  fp8_cache: bool = False) -> DecodeConfig:
    """Split count, tile and minimum split length for one launch; host-side ints only (CUDA-graph safe).

    A 16-bit cache's programs (B x Hkv) take their tile from _SIXTEEN_BIT_TILES (README, "Kernel choices",
    has the measurements behind every rule here). max_seq_len is only a bound (a graph is captured at
    max_model_len), so the split count is sized for it, and min_split_len keeps short requests from being cut
    into one-tile splits once B x Hkv alone covers the SMs, where one or two splits time the same; a 16-bit
    cache does not split from _NO_SPLIT_PROGRAMS_PER_SM. beside_prefix: a decode cascade's suffix launch,
    which runs beside the prefix kernel's programs (fewer free slots an SM): 16-key tiles from 3 programs a
    SM. fp8_cache: an e4m3 cache (element_size is the queries'), which takes one-warp programs from fewer
    programs a SM (_FP8_MANY_PROGRAMS_PER_SM, _FP8_LONG_BOUND) in splits of their own (_fp8_one_warp_config).
    """
    programs = batch * num_kv_heads
    splits = choose_num_splits(max_seq_len, batch, num_kv_heads, num_sms)
    fp8_one_warp = fp8_cache and not beside_prefix and element_size <= 2
    sixteen_bit = element_size <= 2 and not fp8_cache and not beside_prefix and head_dim <= 128  # measured
    if sixteen_bit and programs >= _NO_SPLIT_PROGRAMS_PER_SM * num_sms:
        splits = 1
    if head_dim > 128:
        tile = TILE_CONFIGS[2]
    elif fp8_one_warp and (programs >= _FP8_MANY_PROGRAMS_PER_SM * num_sms
                           or (2 * programs >= 3 * num_sms and max_seq_len >= _FP8_LONG_BOUND)):
        return _fp8_one_warp_config(max_seq_len, programs, num_sms)
    elif beside_prefix and programs >= _MANY_PROGRAMS_PER_SM_BESIDE_PREFIX * num_sms and element_size <= 2:
        tile = TILE_CONFIGS[3]
    elif max_seq_len >= _LONG_CONTEXT and programs < num_sms and element_size <= 2:
        tile = TILE_CONFIGS[1]
        splits = min(splits, _cdiv(2 * num_sms, programs))
    elif sixteen_bit:
        tile = next(tile for below, tile in _SIXTEEN_BIT_TILES if programs < below * num_sms)
    else:
        tile = TILE_CONFIGS[0]
    min_split_len = _MIN_BUSY_SPLIT_TOKENS if programs >= num_sms else 0
    return DecodeConfig(splits, *tile, min_split_len)


def launch_config(max_seq_len: int, batch: int, key_cache: torch.Tensor, element_size: int,
                  beside_prefix: bool = False) -> DecodeConfig:
    """choose_config for a launch over key_cache (element_size: the queries')."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    return choose_config(max_seq_len, batch, num_kv_heads, head_dim, sm_count.num_sms(key_cache.device),
                         element_size, beside_prefix=beside_prefix, fp8_cache=key_cache.dtype == FP8)


def windowed_bound(max_seq_len: int, window: int | None) -> int:
    """A window bounds the keys a request attends, and so the splits and tiles its launch walks, whatever the
    context (plus up to a tile below the window's first key: splits start on tiles)."""
    return max_seq_len if window is None else min(max_seq_len, window + TILE_CONFIGS[1][0])


def compiled_variant(cfg: DecodeConfig) -> tuple:
    """What of a launch config sets the variant Triton compiles (beside the constexprs of the cache, the model
    and the call): the tile and warps, whether it splits, and the split count's integer specialization (an int
    equal to 1, or a multiple of 16; min_split_len is always a multiple of the tile)."""
    return cfg.num_splits == 1, cfg.num_splits % 16 == 0, cfg.block_n, cfg.num_warps, cfg.num_stages


def table_bounds(max_model_len: int) -> list[int]:
    """Bounds (max_seq_len) at which choose_config gives every config it gives for bounds up to max_model_len:
    it reads a bound only by the multiples of _FP8_MIN_SPLIT_LEN it reaches (each of its thresholds is one),
    and nothing changes past _LONG_CONTEXT."""
    step = _FP8_MIN_SPLIT_LEN
    assert _MIN_SPLIT_TOKENS % step == _FP8_LONG_BOUND % step == _LONG_CONTEXT % step == 0
    assert _MAX_SPLITS * _MIN_SPLIT_TOKENS <= _LONG_CONTEXT
    top = min(max_model_len, _LONG_CONTEXT + step)
    return sorted({1, max_model_len, *range(step, top + 1, step)})


def bytes_moved(query: torch.Tensor, key_cache: torch.Tensor, total_kv_tokens: int,
                num_splits: int = 1) -> int:
    """DRAM bytes of one call; total_kv_tokens = sum(seq_lens)."""
    batch, num_q_heads, head_dim = query.shape
    kv = total_kv_tokens * key_cache.shape[2] * head_dim * 2 * key_cache.element_size()
    qo = 2 * batch * num_q_heads * head_dim * query.element_size()
    partials = 2 * batch * num_q_heads * num_splits * (head_dim + 1) * 4 if num_splits > 1 else 0
    return kv + qo + partials


def fp8_dot_flags(cache_dtype: torch.dtype, query_dtype: torch.dtype, on_gpu: bool,
                  num_warps: int) -> dict[str, bool]:
    """The kernel's DOT_F16, V_IN_REGISTERS and SWAP_DOTS for a cache and query dtype: fp16 dots over an FP8
    cache under 16-bit queries; V's inline PTX works on pairs of fp16 (float32's V is a register an element)
    and only on a GPU (not in the interpreter); one-warp programs over it swap their dots (168 registers a
    thread against 221-235 unswapped, 12 programs a SM rather than 8)."""
    dot_f16 = cache_dtype == FP8 and query_dtype != torch.float32
    return {"DOT_F16": dot_f16, "V_IN_REGISTERS": dot_f16 and on_gpu, "SWAP_DOTS": dot_f16 and num_warps == 1}


def query_tile_rows(group: int, swap_dots: bool) -> int:
    """BLOCK_G: a KV head's query heads padded to the dot's side they take (16 rows; 8 columns swapped)."""
    return max(8 if swap_dots else _MIN_GROUP_ROWS, triton.next_power_of_2(group))


def paged_decode_attention_splits(
    query, key_cache, value_cache, block_tables, seq_lens, max_seq_len: int, scale: float, num_splits: int,
    block_n: int | None = None, num_warps: int = 4, num_stages: int = 2, merge_in_kernel: bool = True,
    min_split_len: int = 0, append: NewTokens | None = None, offset_64: bool | None = None,
    window: int | None = None, kv_start: torch.Tensor | None = None, return_lse: bool = False,
    k_scale: float = 1.0, v_scale: float = 1.0, cascade: CascadeSuffix | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """paged_decode_attention with an explicit launch config (tests and tuning); max_seq_len is unused here.
    merge_in_kernel=False merges the splits in a second kernel (the layout before the in-kernel merge).
    min_split_len: keys a split holds at least (rounded up to whole tiles), so that a short request uses
    fewer of the num_splits. append: rotary_decode_attention's step (query is then before rotary).
    offset_64: int64 page offsets; None decides from the cache size (tests force True on small caches).
    window, kv_start, return_lse: as in the reference (the splits cut only the keys a request attends).
    k_scale, v_scale: an FP8 cache's scales. cascade: a decode cascade's suffix (CascadeSuffix)."""
    batch, num_q_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    assert key_cache.shape == value_cache.shape and key_cache.shape[3] == head_dim
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert key_cache.dtype == value_cache.dtype and key_cache.dtype in (query.dtype, FP8), \
        "tl.dot needs matching operand dtypes (an FP8 cache is converted to q's)"
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), query.dtype
    check_kv_scales(key_cache, k_scale, v_scale)
    assert head_dim <= 256, head_dim
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1
    assert seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert num_splits >= 1
    assert window is None or window >= 1, window
    assert kv_start is None or (kv_start.shape == (batch,) and kv_start.dtype == torch.int32
                                and kv_start.is_contiguous())
    group = num_q_heads // num_kv_heads
    if cascade is not None:
        assert return_lse and merge_in_kernel and append is None, "a cascade's suffix merges in the kernel"
        assert kv_start is not None, "a cascade's suffix finds its grouped requests by kv_start"
        assert cascade.prefix_o.is_contiguous() and cascade.prefix_lse.is_contiguous()
        assert cascade.prefix_o.shape[:2] == (batch, num_q_heads), (cascade.prefix_o.shape, num_q_heads)
    out = torch.empty((batch, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    lse = torch.empty((batch, num_q_heads), dtype=torch.float32, device=query.device) if return_lse else out
    if batch == 0:
        return (out, lse) if return_lse else out
    block_n = block_n or (32 if head_dim > 128 else 64)
    assert block_n >= 16 and block_n & (block_n - 1) == 0, block_n
    min_split_len = max(1, _cdiv(min_split_len, block_n)) * block_n
    block_d = max(16, triton.next_power_of_2(head_dim))
    merge_in_kernel = merge_in_kernel and num_splits > 1
    if num_splits > 1:
        f32 = dict(dtype=torch.float32, device=query.device)
        part_o = torch.empty((batch, num_q_heads, num_splits, head_dim), **f32)
        part_lse = torch.empty((batch, num_q_heads, num_splits), **f32)
    else:
        part_o = part_lse = out  # unused
    counters = _split_counters(query.device, batch * num_kv_heads) if merge_in_kernel else seq_lens  # unused
    if offset_64 is None:
        offset_64 = max(key_cache.numel(), value_cache.numel()) >= 2**31
    if append is not None:
        new_k, new_v, cos_sin = append.key, append.value, append.cos_sin_cache
        assert new_k.shape == new_v.shape == (batch, num_kv_heads, head_dim), (new_k.shape, new_v.shape)
        assert new_k.stride(2) == new_v.stride(2) == 1 and cos_sin.stride(1) == 1
        assert cos_sin.shape[1] == head_dim and head_dim % 2 == 0
        assert append.positions.shape == append.slot_mapping.shape == (batch,)
        assert append.positions.is_contiguous() and append.slot_mapping.is_contiguous()
        qk_norm = check_qk_norm(append.q_norm_weight, append.k_norm_weight, head_dim)
        norm_weights = (append.q_norm_weight, append.k_norm_weight) if qk_norm else (seq_lens,) * 2  # unused
        new_args = (append.positions, new_k, new_v, cos_sin, append.slot_mapping, *norm_weights,
                    append.norm_eps)
        new_strides = (new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), cos_sin.stride(0))
    else:
        qk_norm = False
        new_args, new_strides = (seq_lens,) * 7 + (0.0,), (0,) * 5  # unused
    block_gm = triton.next_power_of_2(group)
    block_s = merge_block_s(block_gm, block_d, num_warps)
    dot_flags = fp8_dot_flags(key_cache.dtype, query.dtype, query.is_cuda, num_warps)
    block_g = query_tile_rows(group, dot_flags["SWAP_DOTS"])
    kv_start_arg = kv_start if kv_start is not None else seq_lens  # unused without it
    cascade_args = (cascade.prefix_o, cascade.prefix_lse, cascade.prefix_o.shape[2]) if cascade is not None \
        else (out, lse, 0)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, key_cache, value_cache, out, part_o, part_lse, block_tables, seq_lens, counters, *new_args,
        kv_start_arg, lse, *cascade_args, window or 0, scale * k_scale * _LOG2E, k_scale, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        *new_strides,
        num_splits, min_split_len,
        GROUP=group, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        DIRECT_OUT=num_splits == 1, MERGE_IN_KERNEL=merge_in_kernel, BLOCK_GM=block_gm, BLOCK_S=block_s,
        # fp32 caches are the correctness mode (tiny models vs HF): exact fp32 dots, not tf32.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        **dot_flags,
        APPEND=append is not None, IS_NEOX=append is None or append.is_neox, HALF=head_dim // 2,
        QK_NORM=qk_norm,
        OFFSET_64=offset_64, HAS_KV_START=kv_start is not None, SLIDING=window is not None, RETURN_LSE=return_lse,
        CASCADE=cascade is not None,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(query.device),
    )
    if num_splits > 1 and not merge_in_kernel:
        _decode_reduce_kernel[(batch, num_kv_heads)](
            part_o, part_lse, out, seq_lens, kv_start_arg, lse, window or 0, out.stride(0), out.stride(1),
            num_splits, min_split_len,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_GM=block_gm, BLOCK_S=block_s, BLOCK_D=block_d, BLOCK_N=block_n,
            HAS_KV_START=kv_start is not None, SLIDING=window is not None, RETURN_LSE=return_lse,
            num_warps=4,
        )
    return (out, lse) if return_lse else out


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D], one token per request
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32, each <= max_seq_len
    max_seq_len: int,  # host-side bound on the keys a request attends (seq_len - kv_start); sizes the KV split
    scale: float,
    window: int | None = None,  # sliding window: keys seq_len - window .. seq_len - 1
    kv_start: torch.Tensor | None = None,  # [B] int32: keys before it are not attended (a cascade's suffix)
    return_lse: bool = False,  # also return lse [B, Hq] float32 (base 2)
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return launch_chosen(query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, scale,
                         window=window, kv_start=kv_start, return_lse=return_lse, k_scale=k_scale,
                         v_scale=v_scale)


def launch_chosen(query, key_cache, value_cache, block_tables, seq_lens, max_seq_len: int, scale: float,
                  append: NewTokens | None = None, window: int | None = None,
                  kv_start: torch.Tensor | None = None, return_lse: bool = False, k_scale: float = 1.0,
                  v_scale: float = 1.0, cascade: CascadeSuffix | None = None):
    """paged_decode_attention_splits with the host table's launch config (launch_config)."""
    max_seq_len = windowed_bound(max_seq_len, window)
    cfg = launch_config(max_seq_len, query.shape[0], key_cache, query.element_size(), cascade is not None)
    return paged_decode_attention_splits(
        query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, scale, cfg.num_splits,
        block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, min_split_len=cfg.min_split_len,
        append=append, window=window, kv_start=kv_start, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale,
        cascade=cascade,
    )


def rotary_decode_attention(
    positions: torch.Tensor,  # [B] int
    query: torch.Tensor,  # [B, Hq, D] before rotary (strided view allowed; not modified)
    key: torch.Tensor,  # [B, Hkv, D] before rotary (not modified)
    value: torch.Tensor,  # [B, Hkv, D]
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [B] int; < 0 means skip (padding)
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,  # [B] int32, >= 1: the new token is at position seq_len - 1
    max_seq_len: int,
    scale: float,
    window: int | None = None,
    q_norm_weight: torch.Tensor | None = None,  # [D]: RMS-norm each q head and the new k first (Qwen3)
    k_norm_weight: torch.Tensor | None = None,  # [D]
    norm_eps: float = 1e-6,
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> torch.Tensor:
    """A decode step's whole attention in one launch: rotary_kv_cache_write, then paged_decode_attention
    (see the reference for the exact semantics). Saves a launch-bound kernel per layer and the rotated
    q's round trip through memory."""
    append = NewTokens(positions, key, value, cos_sin_cache, is_neox, slot_mapping, q_norm_weight,
                       k_norm_weight, norm_eps)
    return launch_chosen(query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, scale, append,
                         window=window, k_scale=k_scale, v_scale=v_scale)
