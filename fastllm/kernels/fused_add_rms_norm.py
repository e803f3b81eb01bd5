"""RMSNorm over the last dim, optionally fused with the residual add before it.

Math (exactly the reference's rounding points; dtype = the input dtype):
    rms_norm:            y = w * to_dtype(x * rsqrt(mean(x^2) + eps))    (x, mean, rsqrt in fp32)
    fused_add_rms_norm:  r' = to_dtype(x + residual);  y = rms_norm(r')  -> (y, r')
y has torch's promoted dtype of (w, x), as `weight * normed.to(dtype)` does.
The _fp8 variants, before a projection with FP8 weights, write y quantized per token instead (e4m3 and a
float32 scale a row: fp8_quantize.py's rounding of the y above, bitwise), so the projection needs no
quantizing launch of its own.

One program normalises BLOCK_R rows of N elements held in registers: one row for hidden sizes
(N = 4096), many for Qwen3's per-head q/k norm (N = 128 on [T, H, D], a strided view of qkv).

Memory traffic (one read of each input, one write of each output; weight is cached):
    rms_norm:            rows * N * (x.element_size() + out.element_size())
    fused_add_rms_norm:  rows * N * (3 * x.element_size() + out.element_size())
(see bytes_moved). Unfused PyTorch reads and writes the row several times (fp32 copies included).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastllm.kernels import pdl
from fastllm.kernels.fp8_quantize import reciprocal, row_scale, to_e4m3
from fastllm.kernels.reference import FP8, FP8_MAX, MIN_AMAX


# The row count varies every step: not specializing it (on == 1, % 16) keeps one compiled variant instead
# of several, each JIT-compiled at its first use, possibly mid-serving.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    num_rows, num_heads, n_cols, eps,
    stride_xa, stride_xh, stride_ra, stride_rh,  # x, residual viewed as [A, H, N]; row = a * H + h
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,  # out is e4m3, scale_ptr a float32 scale a row (the _fp8 variants)
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (pdl.py): the weight loads before the wait
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    a = rows // num_heads
    h = rows % num_heads
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < n_cols)[None, :]  # [BLOCK_R, BLOCK_N]
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
    pdl.wait(USE_PDL)
    x = tl.load(x_ptr + (a * stride_xa + h * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_off = (a * stride_ra + h * stride_rh)[:, None] + cols[None, :]
        res = tl.load(res_ptr + r_off, mask=mask, other=0.0)
        # round the sum to the model dtype first: that is the residual the next layer sees
        x = (x.to(tl.float32) + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * n_cols + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)  # [BLOCK_R]
    normed = (xf * inv_rms[:, None]).to(x.dtype)  # HF rounds before the weight multiply
    y = w.to(tl.float32)[None, :] * normed.to(tl.float32)
    out_off = rows[:, None] * n_cols + cols[None, :]
    if QUANT:  # y rounded as the unquantized output would be, then quantized per row
        y = y.to(x.dtype).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), axis=1), scale_ptr, False, FP8_MAX, MIN_AMAX)  # [BLOCK_R]
        tl.store(scale_ptr + rows, scale, mask=rows < num_rows)
        q = to_e4m3(y, reciprocal(scale)[:, None], FP8_MAX)
        tl.store(out_ptr + out_off, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> a [A, H, N] view (strided is fine) with a contiguous last dim."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])  # copies only if the leading dims don't merge


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quant: bool = False):
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous(), (weight.shape, x.shape)
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    assert n <= 32768, "one row must fit in registers"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if quant:
        assert out_dtype == x.dtype, "quantizes the norm's output in x's dtype"
    out = torch.empty(x.shape, dtype=FP8 if quant else out_dtype, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device) if quant else None
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if x.numel() == 0:
        return out, res_out, scale
    x3 = _as_3d(x)
    r3 = _as_3d(residual) if residual is not None else x3
    num_rows = x3.shape[0] * x3.shape[1]
    block_n = triton.next_power_of_2(n)
    block_r = max(1, min(64, 4096 // block_n))  # ~4K elements per program
    num_warps = 4 if block_r * block_n <= 4096 else (8 if block_n <= 8192 else 16)
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x3, r3, weight, out, res_out if res_out is not None else out, scale if quant else weight,
        num_rows, x3.shape[1], n, eps,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_N=block_n, QUANT=quant, FP8_MAX=FP8_MAX,
        MIN_AMAX=MIN_AMAX, num_warps=num_warps,
        **pdl.launch_options(x.device),
    )
    return out, res_out, scale


def bytes_moved(x: torch.Tensor, out_dtype: torch.dtype, fused_residual: bool) -> int:
    elt = x.element_size()
    # read x, write out; fused: also read residual, write the new residual
    per = elt + torch.empty((), dtype=out_dtype).element_size() + (2 * elt if fused_residual else 0)
    return x.numel() * per


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] (last dim contiguous; e.g. [T, H, D] strided views of qkv), weight: [N]."""
    return _launch(x, None, weight, eps)[0]


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) quantized per token: (e4m3 [..., N], float32 scales [..., 1])."""
    out, _, scale = _launch(x, None, weight, eps, quant=True)
    return out, scale


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., N]; returns (rms_norm(x + residual), x + residual) as new tensors."""
    out, res_out, _ = _launch(x, residual, weight, eps)
    return out, res_out


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm with its normed output quantized per token: (e4m3, float32 scales [..., 1],
    x + residual)."""
    out, res_out, scale = _launch(x, residual, weight, eps, quant=True)
    return out, scale, res_out
