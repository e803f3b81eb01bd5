"""Triton silu_and_mul vs reference.silu_and_mul.

Checks:
  * against the reference on float32-upcast inputs (||out - ref|| / ||ref||, max |out - ref| / max |ref|):
        float32   rel 1e-6   abs 1e-6   (exp ulps)
        float16   rel 2e-3   abs 2e-3   (silu rounded to fp16, then the product: two roundings)
        bfloat16  rel 1e-2   abs 1e-2   (the same in bf16); GPU only (the interpreter truncates casts)
  * against the reference in the input dtype (same rounding points): within 2 eps relative. exp ulps can
    flip the rounding of silu(gate) near a tie (1 ulp of silu), which the product rounding can take to
    ~1.5 ulp of the output; in fp16/bf16 at most 1% of elements may differ at all.
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import fp8_quantize, reference_impl, triton_impl
from fastllm.kernels.reference import FP8
from tests.kernels.kernel_testing import BF16, gpu, rel_err

TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}


def _check(device, dtype, shape):
    x = (3 * torch.randn(shape, device=device)).to(dtype)
    x.view(-1)[:2] = torch.tensor([-80.0, 80.0])  # exp overflow / underflow must stay finite
    out = triton_impl("silu_and_mul")(x)
    ref_same = reference_impl("silu_and_mul")(x)
    ref_up = reference_impl("silu_and_mul")(x.float())
    assert out.dtype == dtype and out.shape == ref_same.shape
    assert torch.isfinite(out).all()
    rel, abs_ = TOL[dtype]
    assert rel_err(out, ref_up) <= rel, rel_err(out, ref_up)
    scale = ref_up.abs().max().item()
    assert (out.double() - ref_up.double()).abs().max().item() <= abs_ * scale
    ulp = torch.finfo(dtype).eps
    bound = 2 * ulp * ref_same.double().abs() + (1e-6 * scale if dtype == torch.float32 else 0.0)
    assert ((out.double() - ref_same.double()).abs() <= bound).all(), "beyond a flipped intermediate rounding"
    if dtype != torch.float32:  # same rounding points: flips are rare (skipping one flips ~25%)
        assert (out != ref_same).float().mean().item() <= 0.01, "rounds differently from the reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("shape", [(1, 16), (5, 246), (33, 2000), (2, 3, 128), (3, 2 * 1500)])
def test_silu_and_mul(device, dtype, shape):
    _check(device, dtype, shape)


def test_silu_and_mul_strided_rows(device):
    # rows of a wider buffer: token stride != 2I
    buf = torch.randn(6, 300, device=device).half()
    x = buf[:, :256]
    out = triton_impl("silu_and_mul")(x)
    assert rel_err(out, reference_impl("silu_and_mul")(x.float())) <= TOL[torch.float16][0]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2 * 14336), (8192, 2 * 14336), (777, 2 * 18944), (64, 2 * 3072)])
def test_silu_and_mul_gpu(device, dtype, shape):
    _check(device, dtype, shape)


@pytest.mark.parametrize("one_pass_max_k", [16384, 64], ids=["one-pass", "two-launches"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("shape", [(1, 16), (5, 246), (2, 3, 128)])
def test_fp8_variant_quantizes_what_silu_and_mul_writes(device, dtype, shape, one_pass_max_k, monkeypatch):
    """Before an FP8 down projection: bitwise silu_and_mul's output quantized by fp8_quantize.py, in one kernel
    or (rows wider than ONE_PASS_MAX_K: 64 here) as those two launches."""
    monkeypatch.setattr(fp8_quantize, "ONE_PASS_MAX_K", one_pass_max_k)
    x = (3 * torch.randn(shape, device=device)).to(dtype)
    x[0] = 0  # the smallest scale for the first row
    q, scale = triton_impl("silu_and_mul_fp8")(x)
    out = triton_impl("silu_and_mul")(x)
    want_q, want_scale = fp8_quantize.quantize_fp8_per_token(out.reshape(-1, out.shape[-1]))
    assert q.dtype == FP8 and q.shape == out.shape and scale.shape == (*out.shape[:-1], 1)
    assert torch.equal(scale.reshape(-1, 1), want_scale)
    assert torch.equal(q.reshape(want_q.shape).view(torch.uint8), want_q.view(torch.uint8))
