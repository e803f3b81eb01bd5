"""Triton rotary_embedding (in place) vs reference.rotary_embedding.

Checks:
  * against the reference on float32 copies (||out - ref|| / ||ref||, max |out - ref| / max |ref|):
        float32   rel 1e-6   abs 1e-6   (fma contraction only)
        float16   rel 1e-3   abs 1e-3   (one rounding to fp16, u = 4.9e-4)
        bfloat16  rel 8e-3   abs 8e-3   (one rounding to bf16, u = 3.9e-3); GPU only (interpreter truncates)
  * against the reference run in the input dtype: within one ulp (an fma can flip a rounding), and in
    fp16/bf16 at most 1% of the elements differ at all;
  * bytes of the parent buffer outside the q/k views (v, row padding: NaN) are untouched.
With Qwen3's q/k norm weights (each head RMS-normed before the rotation, rounded to the input dtype twice
on the way, as transformers does) the tolerances against float32 grow to three roundings (TOL_QK_NORM),
and against the input dtype a head's mean square summed in another order may flip one rounding of the norm,
so there at most 1% of the elements (fp16/bf16) differ, by at most 2 ulp of the largest element.
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import reference_impl, triton_impl
from tests.kernels.kernel_testing import BF16, gpu, rel_err

TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
TOL_QK_NORM = {torch.float32: (2e-6, 2e-6), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2.4e-2, 2.4e-2)}
NORM_EPS = 1e-6


def qk_norm_weights(d, dtype, device, gen=None):
    """Random q and k norm weights [d] in the model's dtype, far from 1 so that a mix-up shows."""
    return tuple((torch.rand(d, generator=gen) + 0.5).to(device=device, dtype=dtype) for _ in range(2))


def assert_rotated(out, up, same, dtype, name, qk_norm=False):
    """out (the kernel's) against the reference on float32 copies (up) and in the input dtype (same)."""
    rel, abs_ = (TOL_QK_NORM if qk_norm else TOL)[dtype]
    assert out.dtype == dtype and torch.isfinite(out).all(), name
    assert rel_err(out, up) <= rel, f"{name}: rel err {rel_err(out, up):.3g}"
    scale = up.abs().max().item()
    assert (out.double() - up.double()).abs().max().item() <= abs_ * scale, name
    ulp = torch.finfo(dtype).eps
    diff = (out.double() - same.double()).abs()
    if qk_norm:
        assert diff.max().item() <= 2 * ulp * scale + 1e-6 * scale, f"{name}: more than 2 ulp off"
        if dtype != torch.float32:  # (in float32 every element of a head moves with its mean square)
            assert (diff > 0).float().mean().item() <= 0.01, f"{name}: rounds differently"
        return
    # 1 ulp of the result, plus fp32 rounding of the two products before they cancel: the GPU
    # contracts x1*cos - x2*sin into an FMA, PyTorch rounds each product first.
    bound = ulp * same.double().abs() + 1e-6 * scale
    assert (diff <= bound).all(), f"{name}: more than 1 ulp off"
    if dtype != torch.float32:
        assert (out != same).float().mean().item() <= 0.01, f"{name}: rounds differently"


def _cos_sin_cache(max_pos, d, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(device)  # [max_pos, D]


def _check(device, dtype, num_tokens, hq, hkv, d, is_neox, max_pos=4096, pad=8, qk_norm=False):
    # q and k are views of one fused qkv buffer [T, (Hq + 2 Hkv) * D + pad]; v and the pad are NaN
    width = (hq + 2 * hkv) * d
    qkv = torch.full((num_tokens, width + pad), float("nan"), device=device, dtype=dtype)
    qkv[:, : (hq + hkv) * d] = torch.randn(num_tokens, (hq + hkv) * d, device=device).to(dtype)
    query = qkv[:, : hq * d].view(num_tokens, hq, d)
    key = qkv[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
    positions = torch.randint(0, max_pos, (num_tokens,), device=device)
    if num_tokens > 2:
        positions[:2] = torch.tensor([0, max_pos - 1])  # both ends of the cache
    cache = _cos_sin_cache(max_pos, d, device)
    norm = (*qk_norm_weights(d, dtype, device), NORM_EPS) if qk_norm else ()

    up_q, up_k = query.float().clone(), key.float().clone()
    same_q, same_k = query.clone(), key.clone()
    up_norm = (norm[0].float(), norm[1].float(), NORM_EPS) if qk_norm else ()
    reference_impl("rotary_embedding")(positions, up_q, up_k, cache, is_neox, *up_norm)
    reference_impl("rotary_embedding")(positions, same_q, same_k, cache, is_neox, *norm)
    pos = positions.int() if num_tokens % 2 else positions  # int32 and int64 positions
    triton_impl("rotary_embedding")(pos, query, key, cache, is_neox, *norm)

    for out, up, same, name in ((query, up_q, same_q, "q"), (key, up_k, same_k, "k")):
        assert_rotated(out, up, same, dtype, name, qk_norm)
    assert torch.isnan(qkv[:, (hq + hkv) * d :]).all(), "v / row padding was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("num_tokens,hq,hkv,d",
                         [(1, 4, 4, 8), (5, 8, 2, 64), (33, 16, 2, 128), (7, 6, 2, 80)])
def test_rotary(device, dtype, is_neox, num_tokens, hq, hkv, d):
    _check(device, dtype, num_tokens, hq, hkv, d, is_neox)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("num_tokens,hq,hkv,d",
                         [(1, 4, 4, 8), (5, 8, 2, 64), (3, 16, 2, 128), (7, 6, 2, 80), (2, 3, 1, 256)])
def test_rotary_qk_norm(device, is_neox, num_tokens, hq, hkv, d):
    _check(device, torch.float32, num_tokens, hq, hkv, d, is_neox, qk_norm=True)


def test_rotary_qk_norm_needs_both_weights(device):
    x, cache = torch.randn(2, 2, 8, device=device), _cos_sin_cache(4, 8, device)
    for impl in (triton_impl, reference_impl):
        with pytest.raises(ValueError, match="k_norm_weight"):
            impl("rotary_embedding")(torch.arange(2, device=device), x, x.clone(), cache, True,
                                     torch.ones(8, device=device))


def test_rotary_contiguous_inputs(device):
    t, hq, hkv, d = 9, 4, 2, 64
    query = torch.randn(t, hq, d, device=device).half()
    key = torch.randn(t, hkv, d, device=device).half()
    positions = torch.randint(0, 128, (t,), device=device)
    cache = _cos_sin_cache(128, d, device)
    ref_q, ref_k = query.float(), key.float()
    reference_impl("rotary_embedding")(positions, ref_q, ref_k, cache)
    triton_impl("rotary_embedding")(positions, query, key, cache)
    assert rel_err(query, ref_q) <= TOL[torch.float16][0] and rel_err(key, ref_k) <= TOL[torch.float16][0]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("num_tokens,hq,hkv,d", [(1, 32, 8, 128), (8192, 32, 8, 128), (333, 28, 4, 128),
                                                 (64, 16, 8, 64), (100, 8, 1, 256)])
def test_rotary_gpu(device, dtype, is_neox, num_tokens, hq, hkv, d):
    _check(device, dtype, num_tokens, hq, hkv, d, is_neox, max_pos=131072)


@gpu
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("num_tokens,hq,hkv,d", [(1, 32, 8, 128), (4096, 32, 8, 128), (333, 16, 8, 128),
                                                 (100, 8, 1, 256)])
def test_rotary_qk_norm_gpu(device, is_neox, num_tokens, hq, hkv, d):
    _check(device, torch.bfloat16, num_tokens, hq, hkv, d, is_neox, max_pos=131072, qk_norm=True)
