"""FP8 activations per token: each row of x [M, K] to e4m3 with its float32 scale amax / 448 (or a static
input_scale for every row), as reference.quantize_fp8_per_token. One program a row: the row's amax over
K, then x times the scale's IEEE reciprocal (one division a row, not one an element) rounded to e4m3 (nearest
even): bitwise the reference's on GPUs.
Rows up to ONE_PASS_MAX_K wide are loaded once and held in registers for both (a decode step's rows are a
few KB: the kernel's time is its chain of dependent loads, not bytes); wider rows loop over K twice.
Memory traffic: x read once (wide rows: twice, the second time from L2), M * K bytes of e4m3 and M scales
written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastllm.kernels import pdl
from fastllm.kernels.reference import FP8, FP8_MAX, MIN_AMAX

_BLOCK_K = 2048  # wide rows' tile
ONE_PASS_MAX_K = 16384  # 32 fp32 registers a thread at 16 warps


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_scale_ptr, k_in, stride_xm,  # q [M, K] contiguous, scale [M]
    STATIC: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * k_in
    pdl.wait(USE_PDL)  # launched with PDL (pdl.py)
    if ONE_PASS:  # BLOCK_K >= k_in: the row stays in registers
        ks = tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < k_in, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), axis=0), static_scale_ptr, STATIC, FP8_MAX, MIN_AMAX)
        tl.store(scale_ptr + row, scale)
        q = to_e4m3(x, reciprocal(scale), FP8_MAX)
        tl.store(q_row + ks, q.to(q_ptr.dtype.element_ty), mask=ks < k_in)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        if not STATIC:
            for k0 in range(0, k_in, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + ks, mask=ks < k_in, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, axis=0), static_scale_ptr, STATIC, FP8_MAX, MIN_AMAX)
        tl.store(scale_ptr + row, scale)
        inverse = reciprocal(scale)
        for k0 in range(0, k_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + ks, mask=ks < k_in, other=0.0).to(tl.float32)
            tl.store(q_row + ks, to_e4m3(x, inverse, FP8_MAX).to(q_ptr.dtype.element_ty), mask=ks < k_in)


# Shared with the kernels that quantize their own outputs for an FP8 projection (fused_add_rms_norm.py,
# silu_and_mul.py): one rounding of the scale and the values everywhere.
@triton.jit
def row_scale(amax, static_scale_ptr, STATIC: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)
    return scale


@triton.jit
def reciprocal(scale):
    """The scale's IEEE reciprocal (the reference's): computed once a row, before any loop over the row."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def to_e4m3(x, inverse_scale, FP8_MAX: tl.constexpr):
    return tl.clamp(x * inverse_scale, -FP8_MAX, FP8_MAX)


def num_warps(block_k: int) -> int:
    """4 to 16 warps: at most 32 of a row's elements a thread."""
    return min(16, max(4, block_k // 1024))


def quantize_fp8_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (e4m3 [M, K], float32 scales [M, 1]), as the reference's."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    rows, k_in = x.shape
    q = torch.empty(rows, k_in, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        one_pass = k_in <= ONE_PASS_MAX_K
        block_k = triton.next_power_of_2(k_in) if one_pass else _BLOCK_K
        _quantize_rows_kernel[(rows,)](
            x, q, scale, input_scale if input_scale is not None else scale, k_in, x.stride(0),
            STATIC=input_scale is not None, ONE_PASS=one_pass, BLOCK_K=block_k, FP8_MAX=FP8_MAX,
            MIN_AMAX=MIN_AMAX, num_warps=num_warps(block_k), **pdl.launch_options(x.device),
        )
    return q, scale
