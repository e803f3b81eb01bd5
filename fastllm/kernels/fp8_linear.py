"""FP8 projections, y = x @ (W x weight_scale)^T with W in e4m3, on the FP8 tensor cores (sm_89+).

Up to SKINNY_MAX_ROWS rows (decode batches) the weight-streaming kernel runs (fp8_skinny_linear.py: it
quantizes the activations itself). Larger batches: the activations are quantized per token by a Triton kernel (one
program a row: the row's amax, then x / scale rounded to e4m3; or the static input_scale for every row),
and the product runs in cuBLASLt through torch._scaled_mm with row-wise scales: scale_a [M, 1] per token
and scale_b [1, N] per output channel, both float32, the weight column-major (W [N, K] row-major,
transposed), accumulation in fp32 and one rounding to the output dtype.

Math: reference.fp8_linear. The quantized activations are bitwise the reference's (the same IEEE
division and round-to-nearest-even cast); the products differ by the order of the fp32 sums only.
Memory traffic: N * K bytes of W once; x read twice (the second read from L2) and M * K bytes written
and read back in e4m3; M * N output elements.

cuBLASLt needs K and N to be multiples of 16: other shapes (tiny test models) run the reference there,
said once in the log.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from fastllm.kernels import fp8_skinny_linear, pdl, reference
from fastllm.kernels.reference import FP8, FP8_MAX, MIN_AMAX

logger = logging.getLogger("fastllm.kernels")

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


# Batches up to this many rows take the weight-streaming kernel (at most its MAX_ROWS). Only one row for now:
# in the H100 engine run (bench_fp8.py) its one-row FMA path made batch 1 1.38x faster than bf16, but its
# tl.dot path made batch 32 0.43x (every program reads all of x twice, for the scales and the tiles).
# benchmarks/kernels/bench_fp8_linear.py (triton_fp8_skinny against scaled_mm) is to find the crossover.
SKINNY_MAX_ROWS = 1
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info("fp8_linear: %s", message)


def _scaled_mm_fits(weight: torch.Tensor) -> bool:
    n_out, k_in = weight.shape
    return k_in % 16 == 0 and n_out % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] e4m3 x weight_scale [N])^T (+ bias) -> [..., N] in x's dtype."""
    n_out, k_in = weight.shape
    x2 = x.reshape(-1, k_in)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if rows == 0:
        return x.new_empty((*x.shape[:-1], n_out))
    if rows <= SKINNY_MAX_ROWS:
        _log_once(f"the weight-streaming kernel up to {SKINNY_MAX_ROWS} rows")
        out = fp8_skinny_linear.launch(x2, weight, weight_scale, bias, input_scale)
    elif _scaled_mm_fits(weight):
        _log_once(f"torch._scaled_mm above {SKINNY_MAX_ROWS} rows")
        x_q, x_scale = quantize_fp8_per_token(x2, input_scale)
        out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, n_out),
                               out_dtype=x.dtype)
        if bias is not None:
            out += bias
    else:
        _log_once(f"the dequantizing reference above {SKINNY_MAX_ROWS} rows where K or N is not a "
                  "multiple of 16 (torch._scaled_mm needs that)")
        out = reference.fp8_linear(x2, weight, weight_scale, bias, input_scale)
    return out.view(*x.shape[:-1], n_out)
