"""FP8 projections of a few hundred rows (batch-256 decode steps): y = (x_q x x_scale) @ (W x weight_scale)^T,
x_q [M, K] and W [N, K] in e4m3, as a persistent Triton GEMM on Hopper's FP8 tensor cores (TMA loads).

Where it runs: the shapes of _TUNED, where an H200 sweep (benchmarks/kernels/tune_fp8_gemm.py) found it faster
than torch._scaled_mm (cuBLASLt); fp8_linear.py sends everything else to _scaled_mm. The winners are 64-row
tiles with 256-deep K steps and 4 stages, on the narrow projections (o, down; qkv and gate_up at 64 rows):
down_proj's 4,096 columns at 256 rows make 128 such tiles for 132 SMs, where cuBLASLt runs 64 of 128 x 128
(H200, `nvjet_..._128x128_128x6`).

Math: reference.fp8_linear_quantized. e4m3 products summed by tl.dot (in the MMA's accumulator over all of K
with fast_accum, else promoted to fp32 every BLOCK_K: fp8_linear.fast_accum), then x's per-token and W's
per-channel scales, the bias, one rounding to the output dtype.
Memory traffic: W once from HBM (N * K bytes), x_q from L2 by every column tile, M * N outputs written.
Needs: sm_90 and triton >= 3.4 (TMA descriptors), 16-byte aligned rows (K and N * 2 bytes multiples of 16)
and base pointers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastllm.kernels import sm_count

try:  # triton >= 3.4: host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

__all__ = ["GemmConfig", "choose_config", "fits", "launch"]


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3


# (row bucket, N, K) -> config, from tune_fp8_gemm.py on an H200 at Llama-3.1-8B's projections (the bucket's
# largest row count; us against _scaled_mm's, both with bf16 outputs' fast accumulation): the shapes where the
# best config beat torch._scaled_mm by 3% or more. The others stay cuBLASLt's: gate_up from 128 rows (39.7 /
# 36.6 us at 128), qkv from 256, all at 512. (Swept first with sums promoted every K tile: the same configs.)
_TUNED: dict[tuple[int, int, int], GemmConfig] = {
    (64, 6144, 4096): GemmConfig(64, 64, 256, 4, 4),  # qkv: 10.9 / 14.4
    (64, 4096, 4096): GemmConfig(64, 64, 256, 4, 4),  # o: 9.5 / 14.1
    (64, 28672, 4096): GemmConfig(64, 128, 256, 4, 4),  # gate_up: 35.6 / 38.8 (64 x 256 x 128: 35.0)
    (64, 4096, 14336): GemmConfig(64, 64, 256, 4, 4),  # down: 24.6 / 37.2
    (128, 6144, 4096): GemmConfig(64, 128, 256, 4, 4),  # qkv: 11.7 / 14.7
    (128, 4096, 4096): GemmConfig(64, 64, 256, 4, 4),  # o: 9.8 / 14.1
    (128, 4096, 14336): GemmConfig(64, 64, 256, 4, 4),  # down: 25.5 / 37.6
    (256, 4096, 4096): GemmConfig(64, 128, 256, 4, 4),  # o: 10.5 / 14.4
    (256, 4096, 14336): GemmConfig(64, 128, 256, 4, 4),  # down: 28.0 / 38.0
}
ROW_BUCKETS = (64, 128, 256, 512)


def row_bucket(num_rows: int) -> int:
    """The smallest bucket holding num_rows (0 past the last)."""
    return next((b for b in ROW_BUCKETS if num_rows <= b), 0)


def choose_config(num_rows: int, n_out: int, k_in: int) -> GemmConfig | None:
    """The tuned config for this shape, or None: torch._scaled_mm is faster or the shape was not swept."""
    return _TUNED.get((row_bucket(num_rows), n_out, k_in))


def fits(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
         out_dtype: torch.dtype) -> bool:
    """What the kernel needs: TMA (sm_90+ and triton >= 3.4; Triton's interpreter on the CPU), rows contiguous
    with 16-byte aligned strides and bases, contiguous scales, 16-bit outputs."""
    device = x_q.device
    if TensorDescriptor is None:
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return False
    return (out_dtype in (torch.bfloat16, torch.float16) and weight.shape[0] % 8 == 0
            and all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
                    for t in (x_q, weight))
            and x_scale.is_contiguous() and weight_scale.is_contiguous())


@triton.jit
def _fp8_gemm_kernel(x_desc, w_desc, out_desc, x_scale_ptr, w_scale_ptr, bias_ptr, num_rows, n_out, k_in,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr, PROMOTE: tl.constexpr):
    row_tiles = tl.cdiv(num_rows, BLOCK_M)
    k_tiles = tl.cdiv(k_in, BLOCK_K)
    num_tiles = row_tiles * tl.cdiv(n_out, BLOCK_N)
    # Row tiles vary fastest: the programs working on one weight tile run together, so it leaves HBM once.
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m = tile % row_tiles
        pid_n = tile // row_tiles
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            x = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            if PROMOTE:  # (sm_90's e4m3 MMA keeps ~14 bits of its accumulator: to fp32 every BLOCK_K)
                acc = tl.dot(x, w.T, acc, max_num_imprecise_acc=BLOCK_K)
            else:  # fast accumulation (_scaled_mm's use_fast_accum): never promoted
                acc = tl.dot(x, w.T, acc)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        x_scale = tl.load(x_scale_ptr + rows, mask=rows < num_rows, other=0.0)
        w_scale = tl.load(w_scale_ptr + cols, mask=cols < n_out, other=0.0)
        acc = acc * x_scale[:, None] * w_scale[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < n_out, other=0.0).to(tl.float32)[None, :]
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))


def launch(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype, config: GemmConfig, *,
           fast_accum: bool) -> torch.Tensor:
    """x_q [M, K] e4m3 with float32 scales [M, 1] @ (weight [N, K] e4m3 x weight_scale [N])^T (+ bias)
    -> [M, N] in out_dtype. The caller checks fits()."""
    num_rows, k_in = x_q.shape
    n_out = weight.shape[0]
    out = torch.empty(num_rows, n_out, device=x_q.device, dtype=out_dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    num_tiles = triton.cdiv(num_rows, bm) * triton.cdiv(n_out, bn)
    num_programs = min(num_tiles, sm_count.num_sms(x_q.device))
    _fp8_gemm_kernel[(num_programs,)](
        TensorDescriptor.from_tensor(x_q, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), x_scale, weight_scale, bias if bias is not None else out,
        num_rows, n_out, k_in, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        NUM_PROGRAMS=num_programs, PROMOTE=not fast_accum, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out
