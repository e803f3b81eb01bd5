"""SiLU-and-multiply of the fused gate/up projection (the SwiGLU MLP activation).

Math: x = [gate | up] along the last dim, out = to_dtype(to_dtype(silu(gate)) * up) with
silu(g) = g / (1 + exp(-g)) in fp32. The intermediate rounding matches the reference
`F.silu(gate) * up`, which materialises silu(gate) in the model dtype.

Memory traffic: read 2I, write I elements per token:
    bytes = 3 * T * I * x.element_size()      (see bytes_moved)
Whether this beats torch.compile's fusion of the same two lines is for the benchmark to say.

silu_and_mul_fp8, before a down projection with FP8 weights, writes the output quantized per token (e4m3
and a float32 scale a token: fp8_quantize.py's rounding of the output above, bitwise): one program a token
holds its row in registers for the amax. Rows wider than fp8_quantize.ONE_PASS_MAX_K take this kernel and
then fp8_quantize's, said once in the log.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from fastllm.kernels import fp8_quantize, pdl
from fastllm.kernels.fp8_quantize import reciprocal, row_scale, to_e4m3
from fastllm.kernels.reference import FP8, FP8_MAX, MIN_AMAX

logger = logging.getLogger("fastllm.kernels")
_BLOCK = 1024
_say_once = functools.cache(logger.info)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < inter
    pdl.wait(USE_PDL)  # launched with PDL (pdl.py)
    gate = tl.load(x_ptr + t * stride_xt + c, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + inter + c, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded like F.silu's output
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + c, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_xt, inter, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                             MIN_AMAX: tl.constexpr, USE_PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < inter
    pdl.wait(USE_PDL)  # launched with PDL (pdl.py)
    gate = tl.load(x_ptr + t * stride_xt + c, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + inter + c, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)  # as silu_and_mul writes it
    scale = row_scale(tl.max(tl.abs(out), axis=0), scale_ptr, False, FP8_MAX, MIN_AMAX)
    tl.store(scale_ptr + t, scale)
    q = to_e4m3(out, reciprocal(scale), FP8_MAX)
    tl.store(q_ptr + t * inter + c, q.to(q_ptr.dtype.element_ty), mask=mask)


def bytes_moved(x: torch.Tensor) -> int:
    return x.numel() * x.element_size() * 3 // 2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] laid out as [gate | up]; returns silu(gate) * up, [..., I]."""
    assert x.dim() >= 1 and x.shape[-1] % 2 == 0, x.shape
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, 2 * inter)  # [T, 2I]: a view for [T, 2I] inputs and contiguous ones
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, _BLOCK))](
        x2, out, x2.stride(0), inter, inter, BLOCK=_BLOCK, num_warps=4, **pdl.launch_options(x.device),
    )
    return out


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul(x) quantized per token: (e4m3 [..., I], float32 scales [..., 1])."""
    assert x.dim() >= 1 and x.shape[-1] % 2 == 0, x.shape
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    inter = x.shape[-1] // 2
    if inter > fp8_quantize.ONE_PASS_MAX_K:
        _say_once(f"silu_and_mul_fp8: rows of {inter} > {fp8_quantize.ONE_PASS_MAX_K} elements: SiLU-and-mul, "
                  "then a quantizing launch")
        out = silu_and_mul(x)
        q, scale = fp8_quantize.quantize_fp8_per_token(out.reshape(-1, inter))
        return q.view(out.shape), scale.view(*out.shape[:-1], 1)
    q = torch.empty((*x.shape[:-1], inter), dtype=FP8, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if q.numel() == 0:
        return q, scale
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    block = triton.next_power_of_2(inter)
    _silu_and_mul_fp8_kernel[(x2.shape[0],)](
        x2, q, scale, x2.stride(0), inter, BLOCK=block, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX,
        num_warps=fp8_quantize.num_warps(block), **pdl.launch_options(x.device),
    )
    return q, scale
