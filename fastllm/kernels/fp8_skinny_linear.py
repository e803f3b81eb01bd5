"""FP8 projections of a decode batch (a few rows): y = x @ (W x weight_scale)^T with W in e4m3, as a
weight-streaming kernel.

The bf16 skinny kernel's plan (skinny_linear.py) on half the bytes: each program streams BLOCK_N rows of
W over the whole K while the few rows of x stay in L2. One row in 16 bits takes an FMA path that quantizes x
itself (its scale, amax / 448 over the whole row or the static input_scale, first; then x's tiles as it goes:
no separate launch) and keeps per-lane partial sums of the e4m3 products in fp32, one cross-lane reduction at
the end. x quantized ahead (by the norm before the projection), or more rows, quantized once by
fp8_quantize.py (each program would otherwise re-read all of x for the scales and again for the tiles), take
an e4m3 tl.dot with fp32 accumulation, padded to 16 rows (swap_ab: as W @ x^T for 16-bit outputs).
Up to MAX_ROWS rows; fp8_linear.py hands larger batches to torch._scaled_mm.

Math: reference.fp8_linear. The quantized x is bitwise the reference's on the GPU (the same IEEE
reciprocal of the scale, product and round-to-nearest-even cast); e4m3 products are exact in fp32, summed in
another order, then scaled by x's and W's scales and rounded once to the output dtype.
Memory traffic: N * K bytes of W once; x from L2 by every program (one row: twice, in its dtype; more: once,
in e4m3, after fp8_quantize.py's pass); M * N written.
Launch configs: a table of its own (below), from an e4m3 sweep; skinny_linear's row buckets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastllm.kernels import pdl, sm_count
from fastllm.kernels.fp8_quantize import quantize_fp8_per_token, reciprocal, row_scale, to_e4m3
from fastllm.kernels.reference import FP8_MAX, MIN_AMAX
from fastllm.kernels.skinny_linear import (Config, k_mask, k_range, merge_k_splits, prefetch_args, prefetch_weights,
                                          row_bucket, split_k_buffers, store_out)

__all__ = ["MAX_ROWS", "choose_config", "launch", "launch_quantized"]

MAX_ROWS = 32  # its e4m3 configs were swept up to here (the bf16 kernel's 33-64-row bucket is not this one's)

# Launch configs from an H200 sweep of e4m3 weights at Llama-3.1-8B's projections, x quantized ahead and the
# dot swapped (one-off: tune_skinny_linear.py's configs cut to BLOCK_N 64/128, the sizes that reach wgmma;
# splits of K 1-4): the default, the best or within 3% of it on qkv and o, and the measured best where it
# differed. BLOCK_K counts e4m3 elements. One row in 16 bits (o_proj, static input scales) takes the FMA path,
# which quantizes x as it streams (a dot would need x quantized by a launch of its own first), but for
# gate_up, which streams faster through the dot even so.
_ONE_ROW_16BIT = Config(8, 1024, 4, 2, False)
_ONE_ROW_16BIT_TUNED = {(6144, 4096): Config(8, 1024, 4, 3, False),  # (N, K)
                        (28672, 4096): Config(32, 256, 4, 3)}
_DOT = Config(64, 256, 4, 5)
_TUNED = {  # (row bucket, N, K)
    (1, 28672, 4096): Config(128, 256, 8, 3), (1, 4096, 14336): Config(128, 256, 4, 4, split_k=4),
    (8, 28672, 4096): Config(128, 256, 8, 3), (8, 4096, 14336): Config(64, 512, 4, 4),
    (16, 6144, 4096): Config(64, 512, 4, 4), (16, 4096, 4096): Config(64, 512, 4, 4),
    (16, 28672, 4096): Config(128, 256, 8, 3), (16, 4096, 14336): Config(64, 256, 4, 5, split_k=2),
    (32, 28672, 4096): Config(64, 256, 4, 4), (32, 4096, 14336): Config(64, 256, 4, 5, split_k=2),
}


def choose_config(num_rows: int, n_out: int, k_in: int, quantized: bool = True, num_sms: int = 0) -> Config:
    """The table's config; `quantized`: x arrives in e4m3 (else one row mostly takes the FMA path). An untuned
    shape takes the default, split to fill num_sms where it has few column tiles (split_to_fill)."""
    if num_rows == 1 and not quantized:
        return _ONE_ROW_16BIT_TUNED.get((n_out, k_in), _ONE_ROW_16BIT)
    tuned = _TUNED.get((row_bucket(num_rows), n_out, k_in))
    return tuned if tuned is not None else split_to_fill(_DOT, n_out, k_in, num_sms)


def split_to_fill(cfg: Config, n_out: int, k_in: int, num_sms: int) -> Config:
    """cfg with K split (in powers of two) while its programs fill under half of num_sms, for shapes with
    fewer column tiles than a quarter of them, each split keeping two BLOCK_K tiles or more. The default's
    64-wide tiles give a small model's narrow projections few programs (Qwen3-0.6B's o and down: 16 on 132
    SMs); the swept shapes (Llama-3.1-8B's) have 64 or more and stay as they are. Not yet timed on these
    shapes."""
    tiles = triton.cdiv(n_out, cfg.block_n)
    split = 1
    if tiles < num_sms // 4:
        while tiles * split < num_sms // 2 and k_in // (2 * split) >= 2 * cfg.block_k:
            split *= 2
    return cfg._replace(split_k=split) if split > 1 else cfg


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_skinny_linear_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, input_scale_ptr, out_ptr, part_ptr, counters_ptr, num_rows, n_out, k_in,
    stride_xm, HAS_BIAS: tl.constexpr, STATIC: tl.constexpr, PREQUANT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr, SPLIT_K: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < n_out
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * k_in  # [BLOCK_N, 1]
    x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    k_lo, k_hi = k_range(k_in, SPLIT_K, BLOCK_K)
    prefetch_weights(w_rows, k_lo, k_hi, USE_PDL, PREFETCH_LINES, LINE)
    pdl.wait(USE_PDL)  # launched with PDL (pdl.py): x is the previous kernel's output
    if PREQUANT:  # x is e4m3 already; input_scale_ptr holds each row's scale
        x_scale = tl.load(input_scale_ptr + rows, mask=row_ok, other=1.0)
    elif STATIC:
        x_scale = tl.zeros([BLOCK_M], tl.float32) + tl.load(input_scale_ptr).to(tl.float32)
    else:  # each row's amax over the whole of K (x is a few rows: it stays in L2 for the second pass)
        amax = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < k_in)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        x_scale = row_scale(tl.max(amax, axis=1), input_scale_ptr, False, FP8_MAX, MIN_AMAX)
    if not PREQUANT:
        x_inverse = reciprocal(x_scale)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # SWAP_AB's: out^T = W @ x^T
    acc_lanes = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # the one-row path's per-lane partial sums
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = k_mask(ks, k_hi, EVEN_K)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if PREQUANT:
            q = x
        else:
            q = to_e4m3(x.to(tl.float32), x_inverse[:, None], FP8_MAX).to(w.dtype)
        if USE_DOT and SWAP_AB:
            # wgmma's FP8 accumulator keeps ~14 bits: each tile's sum is promoted to acc_t's fp32
            acc_t = tl.dot(w, tl.trans(q), acc_t, max_num_imprecise_acc=BLOCK_K)
        elif USE_DOT:
            acc += tl.dot(q, tl.trans(w))
        else:  # BLOCK_M == 1
            acc_lanes += q.to(tl.float32) * w.to(tl.float32)  # [1, BLOCK_K] x [BLOCK_N, BLOCK_K]
    if not USE_DOT:
        acc = tl.sum(acc_lanes, axis=1)[None, :]
    elif SWAP_AB:
        acc = tl.trans(acc_t)
    mask = row_ok[:, None] & col_ok[None, :]
    # split K: the exact e4m3 sums added first, then scaled once
    acc, last = merge_k_splits(acc, part_ptr, counters_ptr, rows, cols, mask, num_rows, n_out, SPLIT_K)
    if last:
        w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
        store_out(acc * x_scale[:, None] * w_scale[None, :], bias_ptr, out_ptr, out_ptr, rows, cols, mask,
                  n_out, HAS_BIAS, False)


def swap_ab(out_dtype: torch.dtype) -> bool:
    """tl.dot as W @ x^T (the weights' tile as the MMA's M side) for 16-bit outputs. Hopper runs e4m3 on its
    tensor cores only through wgmma, whose M is 64 or more: with the few rows of x as M, Triton's dot takes
    the MMAv2 path, which converts every e4m3 element to fp16 first (sm_90 SASS: 192 conversions a thread for
    a 64 x 256 tile, ~half of the loop, bounding it at the conversion units' rate). Swapped, the dot is a
    QGMMA on e4m3 (no conversions, 127 instructions in place of 388). wgmma keeps ~14 bits of its FP8
    accumulator (DeepSeek-V3 report, 3.3.2), so each tile's sum (BLOCK_K elements) is promoted to fp32, as
    DeepSeek's kernels do every 128 (left in wgmma's accumulator over K = 14336 they were 3e-3 off, past an
    fp16 output's rounding; promoting every 128 slowed the kernel, every tile did not). float32
    outputs, the correctness mode, keep the MMAv2 path: exact products, fp32 sums."""
    return out_dtype != torch.float32


def launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None, *,
           config: Config | None = None) -> torch.Tensor:
    """The kernel on 1..MAX_ROWS rows of x [rows, K] (contiguous rows); weight [N, K] e4m3 contiguous,
    weight_scale [N] float32 -> [rows, N] in x's dtype."""
    cfg = config or choose_config(x.shape[0], *weight.shape, quantized=False,
                                  num_sms=sm_count.num_sms(x.device))
    if cfg.use_dot or x.shape[0] > 1:  # x quantized once here, not re-read for its scales by every program
        x_q, x_scale = quantize_fp8_per_token(x, input_scale)
        return launch_quantized(x_q, x_scale, weight, weight_scale, bias, x.dtype, config=cfg)
    return _launch(x, input_scale, False, weight, weight_scale, bias, x.dtype, cfg)


def launch_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype, *, config: Config | None = None
                     ) -> torch.Tensor:
    """The kernel on activations quantized already: x_q [rows, K] e4m3 with float32 scales x_scale [rows, 1]."""
    cfg = config or choose_config(x_q.shape[0], *weight.shape, num_sms=sm_count.num_sms(x_q.device))
    return _launch(x_q, x_scale.view(x_q.shape[0]), True, weight, weight_scale, bias, out_dtype, cfg)


def _launch(x: torch.Tensor, scales: torch.Tensor | None, prequant: bool, weight: torch.Tensor,
            weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, cfg: Config
            ) -> torch.Tensor:
    """x: e4m3 with its rows' scales (prequant), or one row in 16/32 bits with the static input_scale or None."""
    num_rows = x.shape[0]
    n_out, k_in = weight.shape
    assert x.dim() == 2 and x.shape[1] == k_in and x.stride(1) == 1 and weight.is_contiguous(), \
        (x.shape, x.stride(), weight.shape)
    assert 0 < num_rows <= MAX_ROWS and weight_scale.shape == (n_out,), (num_rows, weight_scale.shape)
    use_dot = cfg.use_dot or num_rows > 1  # the FMA path holds one row
    assert prequant or not use_dot, "tl.dot takes e4m3 activations"
    assert not cfg.swap_ab, "the e4m3 kernel swaps its dot by the output dtype (swap_ab), not by the config"
    out = torch.empty(num_rows, n_out, dtype=out_dtype, device=x.device)
    tiles = triton.cdiv(n_out, cfg.block_n)
    part, counters = split_k_buffers(cfg.split_k, num_rows, n_out, tiles, out)
    _fp8_skinny_linear_kernel[(tiles, cfg.split_k)](
        x, weight, weight_scale, bias if bias is not None else weight_scale,
        scales if scales is not None else weight_scale, out, part, counters, num_rows, n_out, k_in, x.stride(0),
        HAS_BIAS=bias is not None, STATIC=scales is not None and not prequant, PREQUANT=prequant,
        BLOCK_M=max(16, triton.next_power_of_2(num_rows)) if use_dot else 1, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_K=k_in % cfg.block_k == 0, USE_DOT=use_dot,
        SWAP_AB=use_dot and swap_ab(out_dtype), SPLIT_K=cfg.split_k, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX,
        **prefetch_args(cfg, weight.element_size()), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch_options(x.device),
    )
    return out
