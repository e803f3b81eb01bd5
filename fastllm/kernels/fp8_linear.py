"""FP8 projections, y = x @ (W x weight_scale)^T with W in e4m3, on the FP8 tensor cores (sm_89+).

Up to SKINNY_MAX_ROWS rows (decode batches) the weight-streaming kernel runs (fp8_skinny_linear.py).
Larger batches: the activations are quantized per token (fp8_quantize.py: the row's amax, then
x * (1 / scale) rounded to e4m3; or the static input_scale for every row), and the product runs in our Triton
GEMM (fp8_gemm.py) at the shapes it was tuned faster, else in cuBLASLt through torch._scaled_mm with row-wise
scales: scale_a [M, 1] per token and scale_b [1, N] per output channel, both float32, the weight column-major
(W [N, K] row-major, transposed), fp32 accumulation (below) and one rounding to the output dtype.

Accumulation above SKINNY_MAX_ROWS rows (fast_accum): Hopper's FP8 MMA keeps ~14 bits of its fp32
accumulator. For bf16 outputs the sums stay in it over the whole of K (torch._scaled_mm's use_fast_accum,
fp8_gemm unpromoted), as vLLM's CUTLASS FP8 kernels run (their FP8FastAccum schedules): the error it adds is
of the order of bf16's own rounding of the output, and promoting stalls the MMA pipeline every K tile
(docs/fp8.md has both measured). fp16 outputs, rounded four times finer, are promoted to fp32 every K tile.

Math: reference.fp8_linear. The quantized activations are bitwise the reference's (the same IEEE
reciprocal, product and round-to-nearest-even cast); the products differ by the order of the fp32 sums only.
Memory traffic: N * K bytes of W once; x read twice (the second read from L2) and M * K bytes written
and read back in e4m3; M * N output elements.

cuBLASLt needs K and N to be multiples of 16: other shapes (tiny test models) run the reference there,
said once in the log. So do float32 outputs, the correctness mode: Hopper's FP8 MMA keeps ~14 bits of the
fp32 accumulator between promotions (DeepSeek-V3 report, 3.3.2), so _scaled_mm's float32 output is good to
~2^-13 only, enough to flip the next layer's e4m3 roundings across a whole prompt.

fp8_linear_quantized takes activations quantized already, by the RMSNorm or SiLU-and-mul kernel before the
projection (their _fp8 variants): the same paths, with no quantizing launch.
"""

from __future__ import annotations

import logging

import torch

from fastllm.kernels import fp8_gemm, fp8_skinny_linear, reference
from fastllm.kernels.fp8_quantize import quantize_fp8_per_token

logger = logging.getLogger("fastllm.kernels")

# Batches up to this many rows take the weight-streaming kernel (at most its MAX_ROWS): with its e4m3 configs
# it beat torch._scaled_mm on every Llama-3.1-8B projection at 1 and 32 rows (tune_skinny_linear.py shapes
# --fp8, docs/fp8.md), and its fp32-accumulated tl.dot is closer to the exact sum than cuBLASLt's.
SKINNY_MAX_ROWS = 32
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info("fp8_linear: %s", message)


_ACCUMULATION_LOG = {  # by fast_accum
    True: f"bf16 outputs above {SKINNY_MAX_ROWS} rows sum in the FP8 MMA's accumulator over all of K (fast "
          "accumulation, as vLLM's CUTLASS kernels)",
    False: f"fp16 outputs above {SKINNY_MAX_ROWS} rows: sums promoted to fp32 every K tile"}


def fast_accum(out_dtype: torch.dtype) -> bool:
    """Whether a product above SKINNY_MAX_ROWS rows leaves its sums in the FP8 MMA's accumulator (bf16
    outputs) rather than promoting them to fp32 every K tile (fp16)."""
    return out_dtype == torch.bfloat16


def _logged_fast_accum(out_dtype: torch.dtype) -> bool:
    """fast_accum(out_dtype), the accumulation it picks logged once."""
    fast = fast_accum(out_dtype)
    _log_once(_ACCUMULATION_LOG[fast])
    return fast


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
    if 0 < rows <= SKINNY_MAX_ROWS:  # (one row quantizes as it streams: no launch of its own)
        _log_once(f"the weight-streaming kernel up to {SKINNY_MAX_ROWS} rows")
        out = fp8_skinny_linear.launch(x2, weight, weight_scale, bias, input_scale)
    else:
        out = fp8_linear_quantized(*quantize_fp8_per_token(x2, input_scale), weight, weight_scale, bias, x.dtype)
    return out.view(*x.shape[:-1], n_out)


def fp8_linear_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_linear of activations a norm or SiLU-and-mul kernel quantized already: x_q [..., K] e4m3 with float32
    scales x_scale [..., 1] -> [..., N] in out_dtype. The same paths by row count, less the quantizing."""
    n_out, k_in = weight.shape
    x2, scale2 = x_q.reshape(-1, k_in), x_scale.reshape(-1, 1)
    rows = x2.shape[0]
    if rows == 0:
        return x_q.new_empty((*x_q.shape[:-1], n_out), dtype=out_dtype)
    if rows <= SKINNY_MAX_ROWS:
        _log_once(f"the weight-streaming kernel up to {SKINNY_MAX_ROWS} rows")
        out = fp8_skinny_linear.launch_quantized(x2, scale2, weight, weight_scale, bias, out_dtype)
    elif out_dtype == torch.float32:
        _log_once(f"the dequantizing reference above {SKINNY_MAX_ROWS} rows for float32 outputs "
                  "(torch._scaled_mm keeps ~14 bits of its accumulator on Hopper)")
        out = reference.fp8_linear_quantized(x2, scale2, weight, weight_scale, bias, out_dtype)
    elif (config := fp8_gemm.choose_config(rows, n_out, k_in)) is not None \
            and fp8_gemm.fits(x2, scale2, weight, weight_scale, out_dtype):
        _log_once("the Triton FP8 GEMM (fp8_gemm.py) for its tuned shapes above "
                  f"{SKINNY_MAX_ROWS} rows, torch._scaled_mm for the others")
        out = fp8_gemm.launch(x2, scale2, weight, weight_scale, bias, out_dtype, config,
                              fast_accum=_logged_fast_accum(out_dtype))
    elif _scaled_mm_fits(weight):
        if config is not None:
            _log_once("torch._scaled_mm where fp8_gemm.py was tuned faster but cannot run (it needs sm_90, "
                      "triton >= 3.4 and 16-byte aligned rows)")
        out = _scaled_mm(x2, scale2, weight, weight_scale, bias, out_dtype,
                         fast_accum=_logged_fast_accum(out_dtype))
    else:
        _log_once(f"the dequantizing reference above {SKINNY_MAX_ROWS} rows where K or N is not a "
                  "multiple of 16 (torch._scaled_mm needs that)")
        out = reference.fp8_linear_quantized(x2, scale2, weight, weight_scale, bias, out_dtype)
    return out.view(*x_q.shape[:-1], n_out)


def _scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype, *, fast_accum: bool) -> torch.Tensor:
    _log_once(f"torch._scaled_mm above {SKINNY_MAX_ROWS} rows")
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=out_dtype, use_fast_accum=fast_accum)
    if bias is not None:
        out += bias
    return out
