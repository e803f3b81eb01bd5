"""Triton rms_norm / fused_add_rms_norm vs the reference.

Two checks per output:
  * against the reference on float32-upcast inputs (||out - ref|| / ||ref||, max |out - ref| / max |ref|):
        float32   rel 1e-5   abs 1e-5    (reduction order, rsqrt ulps)
        float16   rel 2e-3   abs 2e-3    (two roundings to fp16: normed, then weight * normed)
        bfloat16  rel 1e-2   abs 1e-2    (the same in bf16)
  * against the reference run in the input dtype (same rounding points): the residual sum is bitwise
    equal, and out is within one unit of rounding of the dtype (|out - ref| <= 2 eps |ref|), the only
    difference being rsqrt / summation-order ulps that can flip a rounding; in fp16/bf16 at most 1% of
    the elements may differ at all (a missing rounding step makes ~25% differ).
bf16 runs on the GPU only: the triton interpreter truncates fp32 -> bf16 casts.
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import reference, reference_impl, triton_impl
from fastllm.kernels.fp8_quantize import quantize_fp8_per_token
from fastllm.kernels.reference import FP8
from tests.kernels.kernel_testing import BF16, gpu, rel_err

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
EPS = 1e-6


def _compare(out, ref_up, ref_same, what):
    dtype = out.dtype
    rel, abs_ = TOL[dtype]
    assert torch.isfinite(out).all(), what
    assert rel_err(out, ref_up) <= rel, f"{what}: rel err {rel_err(out, ref_up):.3g}"
    scale = ref_up.abs().max().item()
    assert (out.double() - ref_up.double()).abs().max().item() <= abs_ * scale, what
    ulp = torch.finfo(dtype).eps
    bound = 2 * ulp * ref_same.double().abs() + (1e-6 if dtype == torch.float32 else 0.0) * scale
    assert ((out.double() - ref_same.double()).abs() <= bound).all(), f"{what}: more than 1 ulp off"
    if dtype != torch.float32:  # same rounding points: flips are rare (skipping one flips ~25%)
        assert (out != ref_same).float().mean().item() <= 0.01, f"{what}: rounds differently"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 123), (3, 4096), (17, 64)])
@pytest.mark.parametrize("fused_residual", [False, True], ids=["rms_norm_fp8", "fused_add_rms_norm_fp8"])
def test_fp8_variants_quantize_what_the_norm_writes(device, dtype, shape, fused_residual):
    """Before an FP8 projection: the unfused pair, this kernel's output quantized by fp8_quantize.py (17 x 64:
    17 rows in one program; an all-zero row takes the smallest scale). Bitwise on the CPU. On a GPU the two
    kernels can round a row differently by an ulp (H200: float32 scales apart at 3 x 4096 and 17 x 64, one
    e4m3 code in 262,144 at fp16 64 x 4096), though their PTX does the same arithmetic in the same order
    (sm_90, Triton 3.6): ptxas need not make the same machine code of it. Held there to the norm's own
    1-ulp contract: each scale within two ulps of the dtype, at most 1% of the codes one step off."""
    n = shape[-1]
    x = (2 * torch.randn(shape, device=device)).to(dtype)
    residual = torch.randn(shape, device=device).to(dtype)
    x[0], residual[0] = 0, 0
    weight = _weight(n, dtype, device)
    if fused_residual:
        q, scale, res = triton_impl("fused_add_rms_norm_fp8")(x, residual, weight, EPS)
        normed, want_res = triton_impl("fused_add_rms_norm")(x, residual, weight, EPS)
        assert torch.equal(res, want_res)
    else:
        q, scale = triton_impl("rms_norm_fp8")(x, weight, EPS)
        normed = triton_impl("rms_norm")(x, weight, EPS)
    want_q, want_scale = quantize_fp8_per_token(normed.reshape(-1, n))
    assert q.dtype == FP8 and q.shape == shape and scale.shape == (*shape[:-1], 1) and scale.dtype == torch.float32
    codes, want_codes = q.reshape(-1, n).view(torch.uint8).int(), want_q.view(torch.uint8).int()
    if q.device.type == "cpu":
        assert torch.equal(scale.reshape(-1, 1), want_scale) and torch.equal(codes, want_codes)
    else:
        ulp = torch.finfo(dtype).eps
        assert ((scale.reshape(-1, 1) - want_scale).abs() <= 2 * ulp * want_scale).all()
        assert ((codes - want_codes).abs() <= 1).all() and (codes != want_codes).float().mean().item() <= 0.01
    assert scale[0].item() == reference.fp8_scale(torch.zeros(())).item() and not q[0].float().any()


def _weight(n, dtype, device):
    return (1.0 + 0.5 * torch.randn(n, device=device)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("shape", [(1, 8), (5, 123), (7, 4096), (3, 1000), (2, 3, 64)])
def test_fused_add_rms_norm(device, dtype, shape):
    x = (2 * torch.randn(shape, device=device)).to(dtype)
    residual = torch.randn(shape, device=device).to(dtype)
    weight = _weight(shape[-1], dtype, device)
    x0, r0 = x.clone(), residual.clone()
    out, res = triton_impl("fused_add_rms_norm")(x, residual, weight, EPS)
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs must not be modified"
    ref_out, ref_res = reference_impl("fused_add_rms_norm")(x, residual, weight, EPS)
    up_out, _ = reference_impl("fused_add_rms_norm")(x.float(), residual.float(), weight.float(), EPS)
    assert res.dtype == dtype and torch.equal(res, ref_res), "residual sum must match bitwise"
    assert out.dtype == ref_out.dtype and out.shape == shape
    _compare(out, up_out, ref_out, f"fused_add_rms_norm {shape}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("shape", [(1, 16), (5, 123), (6, 4, 128), (2, 3, 5, 64), (2048,)])
def test_rms_norm(device, dtype, shape):
    x = (3 * torch.randn(shape, device=device)).to(dtype)
    weight = _weight(shape[-1], dtype, device)
    out = triton_impl("rms_norm")(x, weight, EPS)
    ref = reference_impl("rms_norm")(x, weight, EPS)
    up = reference_impl("rms_norm")(x.float(), weight.float(), EPS)
    assert out.dtype == dtype and out.shape == shape
    _compare(out, up, ref, f"rms_norm {shape}")


def test_rms_norm_strided_heads(device):
    # Qwen3 q/k norm: [T, H, D] views of a fused qkv output, weight [D]; the rest of qkv is untouched
    t, hq, hkv, d = 6, 4, 2, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 8, device=device).half()  # +8: a row stride no view folds
    before = qkv.clone()
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    weight = _weight(d, torch.float16, device)
    for x in (q, k):
        out = triton_impl("rms_norm")(x, weight, EPS)
        _compare(out, reference_impl("rms_norm")(x.float(), weight.float(), EPS),
                 reference_impl("rms_norm")(x, weight, EPS), "strided heads")
    assert torch.equal(qkv, before)


def test_rms_norm_fp32_weight_promotes(device):
    # HF keeps some norm weights in fp32: `weight * normed.to(fp16)` is then fp32
    x = torch.randn(4, 96, device=device).half()
    weight = _weight(96, torch.float32, device)
    out = triton_impl("rms_norm")(x, weight, EPS)
    ref = reference_impl("rms_norm")(x, weight, EPS)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, rtol=2e-3, atol=0)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 4096), (8192, 4096), (513, 5120), (64, 8192), (4096, 32, 128)])
def test_norms_gpu(device, dtype, shape):
    test_fused_add_rms_norm(device, dtype, shape)
    test_rms_norm(device, dtype, shape)
