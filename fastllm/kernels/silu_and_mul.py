"""SiLU-and-multiply of the fused gate/up projection (the SwiGLU MLP activation).

Math: x = [gate | up] along the last dim, out = to_dtype(to_dtype(silu(gate)) * up) with
silu(g) = g / (1 + exp(-g)) in fp32. The intermediate rounding matches the reference
`F.silu(gate) * up`, which materialises silu(gate) in the model dtype.

Memory traffic: read 2I, write I elements per token:
    bytes = 3 * T * I * x.element_size()      (see bytes_moved)
Whether this beats torch.compile's fusion of the same two lines is for the benchmark to say.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastllm.kernels import pdl

_BLOCK = 1024


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
