"""Projections of a decode batch (a few rows): y = x @ W^T (+ bias) as a weight-streaming kernel.

At decode batch sizes a projection is a matrix-vector product: its time is the read of W [N, K]. Each
program streams BLOCK_N rows of W over the whole K (no split-K, so no reduction pass) while the few rows
of x stay in L2. One row takes an FMA path (per-lane partial sums over the loop, one cross-lane reduction
at the end); more rows tl.dot, padded to 16 rows, or swapped (W @ x^T: the weights' tile as the MMA's M
side, which Hopper runs as a wgmma). Up to 32 rows for any shape, 33-64 (a batch-8 verify's 40) only for
the shapes the table has measured there; larger batches are GEMMs, which cuBLAS does better, and the public
`linear` hands them to it.

The gated MLP's gate/up projection (weight [gate; up], [2N, K]) may end in its activation (GATED): each
program streams BLOCK_N rows of gate and the same rows of up, and stores silu(gate) * up [rows, N], rounded
where the projection and the SiLU kernel round, so it gives the unfused pair's bits; the SiLU's launch and
the [rows, 2N] round trip go. Its config is the [2N, K] projection's with half the tile width (the same
bytes a program, as many programs), or its own table's where that lost (gated_config).

A decoder layer with the norms' weights folded into qkv's and gate/up's columns (models/llama.py: a
speculative draft's) reads the residual stream h whole: those two scale their sums by each row's 1 / rms(h)
(RMS_NORM_FOLDED; the sums of squares under tl.dot from x @ x^T's diagonal, so the input tile feeds only dots
and its loads stay pipelined), and o and down add h in their epilogue (ADD_RESIDUAL, rounded as the projection
then the add). A decode layer then launches no norm and no add (tune_skinny_linear.py chain times it).

Without folding, on the one-row FMA path the input may be computed in the loads rather than read (Prologue):
rms_norm(x + residual), the first program storing the residual sum. Every program recomputes its tiles from
L2: a launch saved for a little elementwise work. The tiles round where the norm kernel rounds, so it gives
the unfused pair's result up to the order of its sum of squares (each program first passes over K for the
row's rms, which the norm needs before it rounds h / rms; launches with the norm are unsplit, so program 0
alone stores the residual sum). The fused ops take it for latency-bound weights (<= SMALL_WEIGHT_BYTES): every
program's re-reads of x cost more than the launch saved on Qwen3-8B's (tune_skinny_linear.py chain at one row:
Qwen3-0.6B's projections 0.73 -> 0.67 ms a step, the 8B's 4.06 -> 4.32). Not under tl.dot: a tile from
registers rather than shared memory made the 0.6B's projections 3-4x slower at 2-8 rows.

It beat cuBLAS on every projection of Llama-3.1-8B at 1 to 32 rows (tune_skinny_linear.py shapes:
CUDA-graph replays over weight copies larger than L2, bf16; README, "Kernel choices").

Math: fp32 accumulation, one rounding to the output dtype (fp32 inputs: IEEE fp32 products).
Memory traffic: N * K * elt of W, once; N * rows * elt written.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastllm.kernels import pdl
from fastllm.kernels.fused_add_rms_norm import fused_add_rms_norm, rms_norm
from fastllm.kernels.silu_and_mul import silu_and_mul
from fastllm.kernels.split_counters import split_counters

logger = logging.getLogger("fastllm.kernels")

MAX_ROWS = 64
ANY_SHAPE_ROWS = 32  # up to here every shape takes the kernel; past it only those the table measured there


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_weights(w_rows, k_lo, k_hi, USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                     LINE: tl.constexpr):
    """Before the PDL wait: the first PREFETCH_LINES cache lines (LINE elements each) of this program's
    part of each W row into L2. The weights are no kernel's output: their reads may overlap the previous
    kernel."""
    if USE_PDL and PREFETCH_LINES > 0:
        lines = k_lo + tl.arange(0, PREFETCH_LINES) * LINE
        _prefetch_l2(w_rows + tl.where(lines[None, :] < k_hi, lines[None, :], k_lo))


def prefetch_args(cfg: Config, element_size: int) -> dict:
    """prefetch_weights' launch constexprs for cfg.prefetch_k columns of W: PREFETCH_LINES (0: none) of
    LINE elements, a 128-byte cache line each."""
    lines = triton.next_power_of_2(triton.cdiv(cfg.prefetch_k * element_size, 128)) if cfg.prefetch_k else 0
    return {"PREFETCH_LINES": lines, "LINE": 128 // element_size}


@triton.jit
def k_mask(ks, k_hi, EVEN_K: tl.constexpr):
    """Which of a K tile's columns ks lie in this program's part (below k_hi): all of them when K is whole
    BLOCK_K tiles (EVEN_K; every split's part is then whole tiles too), so the loads go unmasked."""
    if EVEN_K:
        return tl.full(ks.shape, 1, tl.int1)
    return ks < k_hi


@triton.jit
def k_range(k_in, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's part [lo, hi) of K: all of it, or split k's share in whole BLOCK_K tiles (a share past K
    is empty)."""
    if SPLIT_K == 1:
        lo = 0
        hi = k_in
    else:
        k_per = tl.cdiv(tl.cdiv(k_in, SPLIT_K), BLOCK_K) * BLOCK_K
        lo = tl.program_id(1) * k_per
        hi = tl.minimum(k_in, lo + k_per)
    return lo, hi


@triton.jit
def merge_k_splits(acc, part_ptr, counters_ptr, rows, cols, mask, num_rows, n_out, SPLIT_K: tl.constexpr):
    """Split-K's epilogue: returns (this tile's total, whether this program stores it). Unsplit, acc and
    True. Split, each program stores its partial sums [BLOCK_M, BLOCK_N] and counts itself done; the last of
    the column tile's SPLIT_K programs adds the partials (in split order: the same sum whichever program is
    last) and zeroes the tile's counter for the next launch."""
    if SPLIT_K == 1:
        last = True
    else:
        part = part_ptr + rows[:, None] * n_out + cols[None, :]  # part [SPLIT_K, num_rows, n_out] fp32
        tl.store(part + tl.program_id(1) * num_rows * n_out, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stores before the counter's release
        counter = counters_ptr + tl.program_id(0)
        last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        if last:
            tl.store(counter, 0)
            acc = tl.zeros_like(acc)
            for k in range(SPLIT_K):  # other SMs' partials: read past L1 (.cg)
                acc += tl.load(part + k * num_rows * n_out, mask=mask, other=0.0, cache_modifier=".cg")
    return acc, last


# What the kernel's input is (the PROLOGUE constexpr): x itself, rms_norm(x + residual) with the norm's
# weight, or rms_norm(x) of a weight whose columns carry the norm's weight (fold_norm_weight): the sums scaled
# by each row's 1 / rms(x) in the epilogue.
PLAIN, ADD_RMS_NORM, RMS_NORM_FOLDED = 0, 1, 2
_ADD_RMS_NORM = tl.constexpr(ADD_RMS_NORM)  # as kernels read it
_RMS_NORM_FOLDED = tl.constexpr(RMS_NORM_FOLDED)


@triton.jit
def residual_sum(x_rows, res_rows, ks, mask):
    """x + residual over the tile, rounded as fused_add_rms_norm rounds it: the residual the next layer
    adds to."""
    x = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
    res = tl.load(res_rows + ks[None, :], mask=mask, other=0.0)
    return (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)


@triton.jit
def inv_rms_of_sum(x_rows, res_rows, res_out_rows, row_ok, k_in, eps, store, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """ADD_RMS_NORM's pass over K before the weights stream: each row's 1 / rms(x + residual) [BLOCK_M],
    so the tiles round as the norm kernel rounds them. With `store`, x + residual is written."""
    sum_sq = tl.zeros([row_ok.shape[0]], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & k_mask(ks, k_in, EVEN_K)[None, :]
        h = residual_sum(x_rows, res_rows, ks, mask)
        if store:
            tl.store(res_out_rows + ks[None, :], h, mask=mask)
        hf = h.to(tl.float32)
        sum_sq += tl.sum(hf * hf, axis=1)
    return tl.rsqrt(sum_sq / k_in + eps)


@triton.jit
def input_tile(x_rows, res_rows, norm_w_ptr, inv_rms, ks, mask, k_ok, PROLOGUE: tl.constexpr):
    """The input's [BLOCK_M, BLOCK_K] tile at columns ks in the model dtype: x, or norm_w * rms_norm(x +
    residual), rounded where fused_add_rms_norm rounds (inv_rms from inv_rms_of_sum)."""
    if PROLOGUE == _ADD_RMS_NORM:
        h = residual_sum(x_rows, res_rows, ks, mask)
        normed = (h.to(tl.float32) * inv_rms[:, None]).to(h.dtype)
        norm_w = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0)
        x = (norm_w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(h.dtype)
    else:
        x = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
    return x


@triton.jit
def sum_squares(x, sum_sq, gram, USE_DOT: tl.constexpr):
    """RMS_NORM_FOLDED's sums of squares of x's rows: under tl.dot as the diagonal of x @ x^T (gram), so that
    the tile's only uses are dots and its loads stay pipelined (an elementwise use made the 0.6B's
    projections ~30% slower); on the FMA path from the tile in registers (sum_sq)."""
    if USE_DOT:
        gram = tl.dot(x, tl.trans(x), gram, input_precision="ieee")
    else:
        xf = x.to(tl.float32)
        sum_sq += tl.sum(xf * xf, axis=1)
    return sum_sq, gram


@triton.jit
def inv_rms_of(sum_sq, gram, k_in, eps, USE_DOT: tl.constexpr):
    """Each row's 1 / rms [BLOCK_M, 1] from sum_squares' sums."""
    if USE_DOT:
        rows = tl.arange(0, gram.shape[0])
        sum_sq = tl.sum(tl.where(rows[:, None] == rows[None, :], gram, 0.0), axis=1)
    return tl.rsqrt(sum_sq / k_in + eps)[:, None]


@triton.jit
def accumulate(x, w, acc, acc_t, acc_lanes, USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """One K tile's products into the path's accumulator: acc [BLOCK_M, BLOCK_N] (tl.dot), acc_t [BLOCK_N,
    BLOCK_M] (the swapped dot, out^T = W @ x^T) or acc_lanes [BLOCK_N, BLOCK_K] (one row's per-lane sums)."""
    if USE_DOT and SWAP_AB:
        acc_t = tl.dot(w, tl.trans(x), acc_t, input_precision="ieee")
    elif USE_DOT:
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    else:  # BLOCK_M == 1
        acc_lanes += x.to(tl.float32) * w.to(tl.float32)  # [1, BLOCK_K] x [BLOCK_N, BLOCK_K]
    return acc, acc_t, acc_lanes


@triton.jit
def finished(acc, acc_t, acc_lanes, USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """accumulate's sums as [BLOCK_M, BLOCK_N]."""
    if not USE_DOT:
        acc = tl.sum(acc_lanes, axis=1)[None, :]
    elif SWAP_AB:
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from the fp32 sums, each rounded where the unfused pair rounds: the projection's
    output to dtype, then SiLU as silu_and_mul.py computes it."""
    g = gate.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)
    return act.to(tl.float32) * up.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, num_rows, n_out, k_in, stride_xm,  # W, out contiguous
    res_ptr, norm_w_ptr, res_out_ptr, stride_rm, eps,  # ADD_RMS_NORM's (res_out contiguous), ADD_RESIDUAL's
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,  # PDL: W lines (of LINE elements) per row to prefetch
    PROLOGUE: tl.constexpr,
    GATED: tl.constexpr,  # W is [gate; up] ([2 * n_out, K]) and out silu(gate) * up
    ADD_RESIDUAL: tl.constexpr,  # out = the projection + res [rows, N], each rounded as the unfused add
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < n_out
    k_lo, k_hi = k_range(k_in, SPLIT_K, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * k_in  # [BLOCK_N, 1]
    x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # accumulate's three paths' sums
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_lanes = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up, up_t, up_lanes = tl.zeros_like(acc), tl.zeros_like(acc_t), tl.zeros_like(acc_lanes)  # GATED's up rows
    res_rows, res_out_rows = res_ptr + rows[:, None] * stride_rm, res_out_ptr + rows[:, None] * k_in
    prefetch_weights(w_rows, k_lo, k_hi, USE_PDL, PREFETCH_LINES, LINE)
    pdl.wait(USE_PDL)  # launched with PDL (pdl.py): nothing before it reads what an earlier kernel wrote
    inv_rms = tl.zeros([BLOCK_M], tl.float32)
    # RMS_NORM_FOLDED's sums of squares
    sum_sq, gram = tl.zeros([BLOCK_M], tl.float32), tl.zeros([BLOCK_M, BLOCK_M], tl.float32)
    if PROLOGUE == _ADD_RMS_NORM:  # (its launches are unsplit)
        inv_rms = inv_rms_of_sum(x_rows, res_rows, res_out_rows, row_ok, k_in, eps, pid == 0, BLOCK_K, EVEN_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = k_mask(ks, k_hi, EVEN_K)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
        x_mask = row_ok[:, None] & k_ok[None, :]
        x = input_tile(x_rows, res_rows, norm_w_ptr, inv_rms, ks, x_mask, k_ok, PROLOGUE)
        if PROLOGUE == _RMS_NORM_FOLDED:  # (its launches are unsplit)
            sum_sq, gram = sum_squares(x, sum_sq, gram, USE_DOT)
        acc, acc_t, acc_lanes = accumulate(x, w, acc, acc_t, acc_lanes, USE_DOT, SWAP_AB)
        if GATED:
            w_up = tl.load(w_rows + n_out * k_in + ks[None, :], mask=w_mask, other=0.0)
            up, up_t, up_lanes = accumulate(x, w_up, up, up_t, up_lanes, USE_DOT, SWAP_AB)
    acc = finished(acc, acc_t, acc_lanes, USE_DOT, SWAP_AB)
    if GATED:  # (launches unsplit)
        up = finished(up, up_t, up_lanes, USE_DOT, SWAP_AB)
    if PROLOGUE == _RMS_NORM_FOLDED:
        inv_rms = inv_rms_of(sum_sq, gram, k_in, eps, USE_DOT)
        acc, up = acc * inv_rms, up * inv_rms
    if GATED:
        acc = silu_times(acc, up, out_ptr.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    acc, last = merge_k_splits(acc, part_ptr, counters_ptr, rows, cols, mask, num_rows, n_out, SPLIT_K)
    if last:
        store_out(acc, bias_ptr, out_ptr, res_rows, rows, cols, mask, n_out, HAS_BIAS, ADD_RESIDUAL)


@triton.jit
def store_out(acc, bias_ptr, out_ptr, res_rows, rows, cols, mask, n_out, HAS_BIAS: tl.constexpr,
              ADD_RESIDUAL: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < n_out, other=0.0).to(tl.float32)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    if ADD_RESIDUAL:  # rounded as the projection's output, then as the add
        res = tl.load(res_rows + cols[None, :], mask=mask, other=0.0)
        out = (out.to(tl.float32) + res.to(tl.float32)).to(out.dtype)
    tl.store(out_ptr + rows[:, None] * n_out + cols[None, :], out, mask=mask)


class Config(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool = True  # False: the one-row FMA path
    prefetch_k: int = 0  # columns of each W row prefetched into L2 before the PDL wait
    split_k: int = 1  # programs a column tile's K is split over (the last to finish adds the partials)
    swap_ab: bool = False  # tl.dot as W @ x^T (BLOCK_N >= 64: a wgmma's M side on Hopper)


# Launch configs from an H100 sweep (benchmarks/kernels/tune_skinny_linear.py shapes, bf16): per row
# bucket a default, which was the best or within ~2% of it on most of Llama-3.1-8B's projections, and the
# measured best where it differed. One row takes the FMA path; more rows tl.dot (rows padded to 16). The
# 64-row bucket's default (the swapped dot that won most Qwen3-8B shapes at 40 and 64 rows, H200) runs only
# where called with no config for an unmeasured shape: linear() hands those to cuBLAS (measured_there).
# A batch takes the first bucket that holds it.
_DEFAULT = {1: Config(16, 1024, 4, 3, False), 8: Config(32, 512, 4, 5), 16: Config(32, 512, 4, 5),
            32: Config(32, 512, 4, 4), 64: Config(64, 128, 4, 5, swap_ab=True)}
_TUNED = {  # (row bucket, N, K)
    (1, 6144, 4096): Config(8, 512, 4, 3, False), (8, 6144, 4096): Config(64, 128, 4, 5),
    (16, 6144, 4096): Config(32, 128, 4, 5),
    (32, 4096, 4096): Config(32, 256, 4, 5), (16, 28672, 4096): Config(128, 128, 4, 5),
    (32, 28672, 4096): Config(128, 128, 8, 4), (16, 4096, 14336): Config(32, 256, 4, 5),
    (32, 128256, 4096): Config(128, 128, 4, 4),
    # Qwen3-8B's and Qwen3-0.6B's (the speculative pair), H200, --model: rows 1 and 5 (8B); 1, 2 and 8 (0.6B)
    (8, 4096, 4096): Config(32, 512, 4, 4), (1, 24576, 4096): Config(64, 128, 4, 4),
    (8, 24576, 4096): Config(64, 128, 4, 3), (8, 4096, 12288): Config(32, 512, 4, 4),
    (1, 151936, 4096): Config(128, 256, 4, 3), (8, 151936, 4096): Config(128, 128, 4, 3),
    (1, 4096, 1024): Config(8, 1024, 4, 2, False), (8, 4096, 1024): Config(32, 128, 4, 5),
    (1, 1024, 2048): Config(8, 1024, 8, 2, False), (8, 1024, 2048): Config(16, 512, 4, 3),
    (1, 6144, 1024): Config(8, 512, 4, 2, False), (8, 6144, 1024): Config(64, 128, 4, 5),
    (1, 1024, 3072): Config(8, 1024, 8, 2, False),
    (1, 151936, 1024): Config(64, 128, 4, 4), (8, 151936, 1024): Config(64, 128, 4, 4),
    # H200, --model: the 8B at 16 and 32 rows (its batches' decode), the 0.6B at 16 and 32 (the draft's rounds
    # at batch 8-32; its first round at batch 8 has 16 rows). The 8B's qkv at 32 rows is Llama-3.1-8B's shape:
    # this replaced an H100 choice that took 19.6 us on the H200 against 16.6.
    (32, 6144, 4096): Config(64, 256, 4, 4),
    (16, 24576, 4096): Config(64, 128, 4, 3), (32, 24576, 4096): Config(64, 128, 4, 3),
    (16, 151936, 4096): Config(128, 128, 8, 3), (32, 151936, 4096): Config(128, 128, 4, 4),
    (16, 4096, 1024): Config(32, 512, 4, 4), (32, 4096, 1024): Config(32, 512, 4, 3),
    (16, 1024, 2048): Config(16, 512, 4, 3), (32, 1024, 2048): Config(16, 512, 4, 3),
    (16, 6144, 1024): Config(64, 128, 4, 5), (32, 6144, 1024): Config(64, 256, 4, 4),
    (16, 1024, 3072): Config(16, 512, 4, 3), (32, 1024, 3072): Config(16, 512, 4, 3),
    (16, 151936, 1024): Config(64, 128, 4, 3), (32, 151936, 1024): Config(128, 128, 4, 3),
    (8, 1024, 3072): Config(32, 128, 4, 5, split_k=4),  # the 0.6B's down at 8 rows, split: 5.3 us against 6.1
    # The 64-row bucket (33-64 rows; a batch-8 verify at k 4 has 40), H200, --model qwen3-8b --rows 40,64 --split-k
    # 1,2 with swapped dots: the shapes where the kernel was not slower than cuBLAS at either edge (gate/up was
    # within 2% of it: left to cuBLAS). qkv and o are Llama-3.1-8B's shapes too.
    (64, 6144, 4096): Config(64, 128, 4, 5, swap_ab=True), (64, 4096, 4096): Config(32, 256, 4, 4),
    (64, 4096, 12288): Config(64, 128, 4, 5, split_k=2, swap_ab=True), (64, 151936, 4096): Config(128, 128, 4, 4),
}


# Weights this small are latency-bound at decode rows: under PDL early triggers (the kernel before lets
# this one start), a quarter of each program's share of K is fetched into L2 before the wait
# (tune_skinny_linear.py chain: Qwen3-0.6B's projections at 1-8 rows gained, the 8B's larger ones lost).
SMALL_WEIGHT_BYTES = 16 << 20


def row_bucket(num_rows: int) -> int:
    """The tables' row bucket of a batch of 1..MAX_ROWS rows."""
    return next(bucket for bucket in _DEFAULT if num_rows <= bucket)


def measured_there(num_rows: int, n_out: int, k_in: int, gated: bool = False) -> bool:
    """Whether the kernel runs this shape at this row count: any shape up to ANY_SHAPE_ROWS, only the table's
    above (where cuBLAS's GEMMs are as fast elsewhere; gated: its own table's too)."""
    key = (row_bucket(num_rows), n_out, k_in)
    return num_rows <= ANY_SHAPE_ROWS or key in _TUNED or (gated and key in _GATED_TUNED)


def choose_config(num_rows: int, n_out: int, k_in: int, element_size: int = 2, triggers: bool = False
                  ) -> Config:
    """The table's config, adapted to the launch (`triggers`: PDL early triggers are on)."""
    bucket = row_bucket(num_rows)
    return adapted(_TUNED.get((bucket, n_out, k_in), _DEFAULT[bucket]), n_out, k_in, element_size, triggers)


def adapted(cfg: Config, n_out: int, k_in: int, element_size: int, triggers: bool) -> Config:
    """A table's config for a [n_out, k_in] weight of element_size bytes: under PDL early triggers small
    weights prefetch a quarter of K; fp32 halves BLOCK_K."""
    if triggers and n_out * k_in * element_size <= SMALL_WEIGHT_BYTES:
        cfg = cfg._replace(prefetch_k=k_in // (4 * cfg.split_k))
    if element_size > 2:  # fp32 (test models): the same tile bytes, so the pipeline still fits in shared memory
        cfg = cfg._replace(block_k=cfg.block_k * 2 // element_size)
    return cfg


# Gated launches' own configs where the projection's, gated (gated_tiles), lost by 3% or more, and at 33-64
# rows where they beat cuBLAS and the SiLU kernel: (row bucket, 2N, K) -> the config of the gated launch
# (BLOCK_N columns of each half). H200, a sweep at Qwen3-0.6B's, Qwen3-8B's and Llama-3.1-8B's gate/up
# (README, "Kernel choices"; tune_skinny_linear.py shapes --gated re-measures them).
_GATED_TUNED = {
    (1, 28672, 4096): Config(32, 256, 4, 3), (8, 28672, 4096): Config(64, 128, 4, 4, swap_ab=True),
    (32, 6144, 1024): Config(64, 128, 4, 5, swap_ab=True), (64, 6144, 1024): Config(32, 128, 4, 5),
    (32, 24576, 4096): Config(64, 64, 4, 4, swap_ab=True),
    (64, 24576, 4096): Config(64, 64, 4, 4, swap_ab=True),
}


def gated_config(num_rows: int, n_out: int, k_in: int, element_size: int = 2, triggers: bool = False
                 ) -> Config:
    """A gated launch's config (weight [gate; up], [2 * n_out, K]): its own measured one, else the [2 * n_out,
    K] projection's, gated."""
    cfg = _GATED_TUNED.get((row_bucket(num_rows), 2 * n_out, k_in))
    if cfg is not None:
        return adapted(cfg, 2 * n_out, k_in, element_size, triggers)
    return gated_tiles(choose_config(num_rows, 2 * n_out, k_in, element_size, triggers), num_rows)


def gated_tiles(cfg: Config, num_rows: int) -> Config:
    """A projection's config for its gated launch, so each program streams as many bytes a stage (gate's rows
    and up's) and there are as many programs: half the tile width; unsplit. A tile that would fall below its
    path's narrowest (16 for tl.dot, 64 for the swapped dot, a wgmma's M) keeps its width and halves its
    depth instead (half the programs)."""
    narrowest = 64 if cfg.swap_ab else 16 if cfg.use_dot or num_rows > 1 else 1
    if cfg.block_n // 2 >= narrowest:
        cfg = cfg._replace(block_n=cfg.block_n // 2)
    else:
        cfg = cfg._replace(block_k=cfg.block_k // 2)
    return unsplit(cfg)


def unsplit(cfg: Config) -> Config:
    """cfg over the whole of K in one program a column tile (its prefetch the same columns of W)."""
    return cfg._replace(split_k=1, prefetch_k=cfg.prefetch_k * cfg.split_k)


def split_k_buffers(split_k: int, num_rows: int, n_out: int, tiles: int, out: torch.Tensor):
    """Split-K's fp32 partials [split_k, rows, N] and the column tiles' counters (`out` twice when unsplit)."""
    if split_k == 1:
        return out, out
    part = torch.empty(split_k, num_rows, n_out, dtype=torch.float32, device=out.device)
    return part, split_counters("skinny linear", out.device, tiles)


class Prologue(NamedTuple):
    """How the kernel computes its input from x: PLAIN (x is the input), ADD_RMS_NORM (rms_norm(x +
    residual) with norm_weight and eps; the sum goes to residual_out) or RMS_NORM_FOLDED (rms_norm(x) with
    eps, the norm's weight folded into W)."""
    kind: int = PLAIN
    residual: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    residual_out: torch.Tensor | None = None


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, config: Config | None = None,
           out: torch.Tensor | None = None, prologue: Prologue = Prologue(), gated: bool = False,
           add_residual: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on 1..MAX_ROWS rows of x [rows, K] (contiguous rows), weight [N, K] contiguous; gated:
    weight [gate; up] ([2N, K], no bias) and out silu(x @ gate^T) * (x @ up^T) [rows, N]; add_residual
    [rows, N] (contiguous rows): out is x @ W^T + add_residual."""
    num_rows = x.shape[0]
    n_out, k_in = weight.shape
    assert x.dim() == 2 and x.shape[1] == k_in and x.stride(1) == 1 and weight.is_contiguous(), \
        (x.shape, x.stride(), weight.shape)
    assert 0 < num_rows <= MAX_ROWS and x.dtype == weight.dtype, (num_rows, x.dtype, weight.dtype)
    if gated:
        assert n_out % 2 == 0 and bias is None, "a gated launch takes [gate; up] and no bias"
        n_out //= 2
    if out is None:
        out = torch.empty(num_rows, n_out, dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, n_out) and out.is_contiguous() and out.dtype == x.dtype
    residual, residual_out = x, out  # placeholders unless ADD_RMS_NORM / ADD_RESIDUAL
    if add_residual is not None:
        assert prologue.kind != ADD_RMS_NORM, "one residual a launch: the prologue's or the epilogue's"
        assert add_residual.shape == out.shape and add_residual.stride(1) == 1
        assert add_residual.dtype == x.dtype
        residual = add_residual
    if prologue.kind == ADD_RMS_NORM:
        residual, residual_out, norm_weight = prologue.residual, prologue.residual_out, prologue.norm_weight
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
        assert residual_out.shape == x.shape and residual_out.dtype == x.dtype
        assert residual_out.is_contiguous()
        assert norm_weight.shape == (k_in,) and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype
    cfg = config or launch_config(x, weight, gated)
    use_dot = cfg.use_dot or num_rows > 1  # the FMA path holds one row
    assert prologue.kind != ADD_RMS_NORM or not use_dot, "the add + norm prologue runs on the FMA path"
    assert prologue.kind == PLAIN or cfg.split_k == 1, "the norm's prologue runs unsplit"
    assert not gated or cfg.split_k == 1, "gated launches run unsplit"
    tiles = triton.cdiv(n_out, cfg.block_n)
    part, counters = split_k_buffers(cfg.split_k, num_rows, n_out, tiles, out)
    _skinny_linear_kernel[(tiles, cfg.split_k)](
        x, weight, bias if bias is not None else weight, out, part, counters, num_rows, n_out, k_in, x.stride(0),
        residual, prologue.norm_weight if prologue.kind == ADD_RMS_NORM else weight, residual_out,
        residual.stride(0), prologue.eps,
        HAS_BIAS=bias is not None, BLOCK_M=max(16, triton.next_power_of_2(num_rows)) if use_dot else 1,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k_in % cfg.block_k == 0, USE_DOT=use_dot,
        SWAP_AB=use_dot and cfg.swap_ab, SPLIT_K=cfg.split_k,
        **prefetch_args(cfg, x.element_size()), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch_options(x.device), PROLOGUE=prologue.kind, GATED=gated,
        ADD_RESIDUAL=add_residual is not None,
    )
    return out


def launch_config(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> Config:
    """The tables' config for a launch on x [rows, K] and weight ([gate; up] when gated)."""
    n_out, k_in = weight.shape
    if gated:
        return gated_config(x.shape[0], n_out // 2, k_in, x.element_size(), pdl.triggers(x.device))
    return choose_config(x.shape[0], n_out, k_in, x.element_size(), pdl.triggers(x.device))


def launch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        config: Config | None = None, gated: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight^T (+ bias), x + residual) in one launch (gated: as launch's)."""
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = launch(x, weight, bias, config=config, gated=gated,
                 prologue=Prologue(ADD_RMS_NORM, residual, norm_weight, eps, residual_out))
    return out, residual_out


_logged: set = set()  # reasons a path was not taken, logged once


def _log_once(key, message: str, *args) -> None:
    """logger.info(message, *args) the first time `key` (a path not taken, and why) comes up."""
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


def _skinny(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether this projection (gated: as a gated launch) takes the kernel here, else cuBLAS (logged once per
    reason)."""
    why = None
    if x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        why = "inputs that are not [rows, K] with contiguous rows"
    elif x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        why = f"dtypes {x.dtype} x {weight.dtype}"
    elif x.shape[0] > MAX_ROWS:
        why = f"batches of more than {MAX_ROWS} rows"
    elif x.shape[0] == 0:
        why = "empty batches"
    elif not measured_there(x.shape[0], *weight.shape, gated):
        why = (f"[{weight.shape[0]}, {weight.shape[1]}] weights at {ANY_SHAPE_ROWS + 1}-{MAX_ROWS} rows "
               "(no measured config there)")
    if why is None:
        return True
    _log_once(why, "linear: cuBLAS for %s", why)
    return False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] @ weight [N, K]^T (+ bias) -> [rows, N] (into `out` when given)."""
    if _skinny(x, weight):
        return launch(x, weight, bias, out=out)
    if out is None:
        return F.linear(x, weight, bias)
    return torch.addmm(bias, x, weight.t(), out=out) if bias is not None else torch.mm(x, weight.t(), out=out)


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) of weight [gate; up] [2N, K] -> [rows, N]: one launch where the kernel
    takes the projection, else cuBLAS and the SiLU kernel."""
    if _skinny(x, weight, gated=True):
        return launch(x, weight, gated=True)
    return silu_and_mul(linear(x, weight, None))


def _fuses(op: str, x: torch.Tensor, weight: torch.Tensor, *same_dtype: torch.Tensor, gated: bool = False
           ) -> bool:
    """Whether the norm's prologue runs in the projection's launch here (logged once per reason when not)."""
    if not _skinny(x, weight, gated):
        return False
    why = None
    cfg = launch_config(x, weight, gated)
    if x.shape[0] > 1:
        why = "batches of more than one row"
    elif weight.numel() * weight.element_size() > SMALL_WEIGHT_BYTES:
        why = f"weights over {SMALL_WEIGHT_BYTES >> 20} MiB (streaming more than latency-bound)"
    elif cfg.use_dot:
        why = f"[{weight.shape[0]}, {weight.shape[1]}] weights, whose one-row config takes tl.dot"
    elif any(t.dtype != x.dtype or t.stride(-1) != 1 for t in same_dtype):
        why = "a residual or norm weight not of the input's dtype, or strided"
    elif cfg.split_k > 1:
        why = "projections whose config splits K (the norm's prologue runs unsplit)"
    if why is None:
        return True
    _log_once((op, why), "%s: two launches for %s", op, why)
    return False


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight^T (+ bias), x + residual): one launch at one row (_fuses)."""
    if _fuses("add_rms_norm_linear", x, weight, residual, norm_weight):
        return launch_add_rms_norm(x, residual, norm_weight, eps, weight, bias)
    normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), residual


def add_rms_norm_gated_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gated_linear(rms_norm(x + residual), weight), x + residual): the gated MLP's first half, one launch at
    one row (_fuses), else the norm's and the gated one."""
    if _fuses("add_rms_norm_gated_linear", x, weight, residual, norm_weight, gated=True):
        return launch_add_rms_norm(x, residual, norm_weight, eps, weight, gated=True)
    normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return gated_linear(normed, weight), residual


# Projections whose weight carries the norm's (layers/linear.py, fold_norm_weight): the decoder layer's qkv
# and gate/up read the residual stream h and scale their sums by 1 / rms(h) (RMS_NORM_FOLDED), and o and down
# add h in their epilogue (ADD_RESIDUAL), so a decode layer launches no norm and no add. Elsewhere (prefill,
# cuBLAS, swapped configs) the norm runs apart with the weight the folding left it: ones.


def _folded_config(op: str, x: torch.Tensor, weight: torch.Tensor, gated: bool) -> Config | None:
    """The launch config that scales by 1 / rms in the epilogue, or None where the norm runs apart (logged
    once per reason): cuBLAS's shapes, and configs that swap the dot (x @ x^T beside W @ x^T made
    Llama-3.1-8B's batch-8 decode step slower, H200)."""
    if not _skinny(x, weight, gated):
        return None
    cfg = launch_config(x, weight, gated)
    if cfg.swap_ab:
        why = "configs that swap the dot"
        _log_once((op, why), "%s: the norm apart (a launch of its own) for %s", op, why)
        return None
    return unsplit(cfg)  # (the sums of squares over the whole of K)


def rms_norm_folded_linear(x: torch.Tensor, unit_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """rms_norm(x) @ weight^T (+ bias) for a weight that carries the norm's weight (fold_norm_weight), the
    norm left with unit_weight (ones): one launch where the kernel takes the projection unswapped (it never
    reads unit_weight), else the norm and the projection."""
    cfg = _folded_config("rms_norm_folded_linear", x, weight, False)
    if cfg is not None:
        return launch(x, weight, bias, config=cfg, prologue=Prologue(RMS_NORM_FOLDED, eps=eps))
    return linear(rms_norm(x, unit_weight, eps), weight, bias)


def rms_norm_folded_gated_linear(x: torch.Tensor, unit_weight: torch.Tensor, eps: float, weight: torch.Tensor
                                 ) -> torch.Tensor:
    """gated_linear(rms_norm(x), weight) for a [gate; up] weight that carries the norm's weight."""
    cfg = _folded_config("rms_norm_folded_gated_linear", x, weight, True)
    if cfg is not None:
        return launch(x, weight, config=cfg, prologue=Prologue(RMS_NORM_FOLDED, eps=eps), gated=True)
    return gated_linear(rms_norm(x, unit_weight, eps), weight)


def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
               ) -> torch.Tensor:
    """x @ weight^T (+ bias) + residual, rounded as the projection and then the add: the add in the kernel's
    epilogue where it takes the projection."""
    if _skinny(x, weight) and residual.stride(1) == 1:
        return launch(x, weight, bias, add_residual=residual)
    return linear(x, weight, bias) + residual
