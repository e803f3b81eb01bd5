"""FP8 activations per token: each row of x [M, K] to e4m3 with its float32 scale amax / 448 (or a static
input_scale for every row), as reference.quantize_fp8_per_token. One program a row: the row's amax over
K, then x / scale rounded to e4m3 (IEEE division, round to nearest even: bitwise the reference's on GPUs).
Memory traffic: x read twice (the second time from L2), M * K bytes of e4m3 and M scales written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastllm.kernels import pdl
from fastllm.kernels.reference import FP8, FP8_MAX, MIN_AMAX

_BLOCK_K = 2048


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_scale_ptr, k_in, stride_xm,  # q [M, K] contiguous, scale [M]
    STATIC: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * k_in
    pdl.wait(USE_PDL)  # launched with PDL (pdl.py)
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + ks, mask=ks < k_in, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < k_in, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_row + ks, q.to(q_ptr.dtype.element_ty), mask=ks < k_in)


def quantize_fp8_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (e4m3 [M, K], float32 scales [M, 1]), as the reference's."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    rows, k_in = x.shape
    q = torch.empty(rows, k_in, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](
            x, q, scale, input_scale if input_scale is not None else scale, k_in, x.stride(0),
            STATIC=input_scale is not None, BLOCK_K=min(_BLOCK_K, triton.next_power_of_2(k_in)),
            FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, num_warps=4, **pdl.launch_options(x.device),
        )
    return q, scale
