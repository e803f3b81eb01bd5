"""Triton rotary_kv_cache_write vs its reference (reference rotary on copies, then reference kv_cache_write).

Checks, with q/k/v views of one fused qkv buffer and a NaN-poisoned cache:
  * rotated q, k (returned, and k as written to the cache) against the reference on float32 copies,
    with rotary's tolerances (float32 1e-6, float16 1e-3, bfloat16 8e-3 relative and absolute), and
    within one ulp of the reference run in the input dtype;
  * v lands in the cache bit for bit; every slot outside slot_mapping (padding rows: -1) keeps its NaN;
  * the inputs are not modified (the attention op declares no mutation).
With Qwen3's q/k norm weights, q and k are compared as test_rotary compares them (assert_rotated).
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import reference_impl, triton_impl
from tests.kernels.kernel_testing import BF16, gpu
from tests.kernels.test_rotary import NORM_EPS, _cos_sin_cache, assert_rotated, qk_norm_weights


def _check(device, gen, dtype, num_tokens, hq, hkv, d, page, is_neox, return_kv, num_padding=2,
           num_blocks=13, max_pos=4096, qk_norm=False):
    total = num_tokens + num_padding
    qkv = torch.randn(total, (hq + 2 * hkv) * d + 8, generator=gen).to(device=device, dtype=dtype)
    query = qkv[:, : hq * d].view(total, hq, d)
    key = qkv[:, hq * d: (hq + hkv) * d].view(total, hkv, d)
    value = qkv[:, (hq + hkv) * d: (hq + 2 * hkv) * d].view(total, hkv, d)
    before = qkv.clone()
    positions = torch.randint(0, max_pos, (total,), generator=gen).to(device)
    positions[0] = max_pos - 1
    # distinct slots, always including the cache's first (a kernel testing slot > 0 would skip it) and last
    last = num_blocks * page - 1
    middle = torch.randperm(last - 1, generator=gen)[:max(0, num_tokens - 2)] + 1
    slots = torch.cat([torch.tensor([0, last])[:num_tokens], middle])
    slot_mapping = torch.cat([slots, torch.full((num_padding,), -1)])[torch.randperm(total, generator=gen)]
    slot_mapping = slot_mapping.to(device=device, dtype=torch.int32 if num_tokens % 2 else torch.int64)
    cos_sin = _cos_sin_cache(max_pos, d, device)
    shape = (num_blocks, page, hkv, d)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    ref_kc, ref_vc = key_cache.clone(), value_cache.clone()
    up_kc, up_vc = key_cache.float(), value_cache.float()
    norm = (*qk_norm_weights(d, dtype, device, gen), NORM_EPS) if qk_norm else ()
    up_norm = (norm[0].float(), norm[1].float(), NORM_EPS) if qk_norm else ()

    write = triton_impl("rotary_kv_cache_write")
    q_out, k_out, v_out = write(positions, query, key, value, cos_sin, is_neox, key_cache, value_cache,
                                slot_mapping, return_kv, *norm)
    ref = reference_impl("rotary_kv_cache_write")
    same_q, same_k, _ = ref(positions, query, key, value, cos_sin, is_neox, ref_kc, ref_vc, slot_mapping,
                            True, *norm)
    up_q, up_k, _ = ref(positions, query.float(), key.float(), value.float(), cos_sin, is_neox, up_kc, up_vc,
                        slot_mapping, True, *up_norm)
    assert torch.equal(qkv, before), "an input was modified"
    assert (k_out is not None) == return_kv
    assert v_out is (value if return_kv else None), "a 16/32-bit cache holds value as it is"

    valid = slot_mapping >= 0
    written = torch.zeros(num_blocks * page, dtype=torch.bool, device=device)
    written[slot_mapping[valid].long()] = True
    cached_k = key_cache.view(-1, hkv, d)[slot_mapping[valid].long()]  # in token order
    outs = [(q_out, up_q, same_q, "q"), (cached_k, up_k[valid], same_k[valid], "cached k")]
    if return_kv:
        outs.append((k_out, up_k, same_k, "k_out"))
    for out, up, same, name in outs:
        assert_rotated(out, up, same, dtype, name, qk_norm)
    assert torch.equal(value_cache.view(-1, hkv, d)[written], ref_vc.view(-1, hkv, d)[written]), "v"
    untouched = int((~written).sum()) * hkv * d
    for cache in (key_cache, value_cache):
        assert int(torch.isnan(cache).sum()) == untouched, "a slot outside slot_mapping was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("num_tokens,hq,hkv,d,page", [(1, 4, 4, 8, 8), (5, 8, 2, 64, 16), (9, 6, 2, 80, 32)])
def test_rotary_kv_cache_write(device, gen, dtype, is_neox, num_tokens, hq, hkv, d, page):
    _check(device, gen, dtype, num_tokens, hq, hkv, d, page, is_neox, return_kv=num_tokens != 1)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("num_tokens,hq,hkv,d,page", [(1, 4, 4, 8, 8), (5, 8, 2, 64, 16), (9, 6, 2, 80, 32),
                                                      (4, 16, 2, 128, 16), (3, 2, 1, 256, 8)])
def test_rotary_kv_cache_write_qk_norm(device, gen, is_neox, num_tokens, hq, hkv, d, page):
    _check(device, gen, torch.float32, num_tokens, hq, hkv, d, page, is_neox, return_kv=num_tokens != 1,
           qk_norm=True)


def test_rotary_kv_cache_write_no_tokens(device):
    cache = torch.zeros(2, 4, 1, 8, device=device)
    q, k, v = triton_impl("rotary_kv_cache_write")(
        torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, 2, 8, device=device),
        torch.zeros(0, 1, 8, device=device), torch.zeros(0, 1, 8, device=device), torch.zeros(16, 8, device=device),
        True, cache, cache.clone(), torch.zeros(0, dtype=torch.long, device=device), True)
    assert q.shape == (0, 2, 8) and k.shape == v.shape == (0, 1, 8)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("num_tokens,hq,hkv,d,page", [(1, 32, 8, 128, 16), (256, 32, 8, 128, 16),
                                                      (4099, 32, 8, 128, 16), (77, 28, 4, 128, 128),
                                                      (64, 16, 8, 64, 16), (33, 8, 1, 256, 32)])
@pytest.mark.parametrize("return_kv", [False, True])
def test_rotary_kv_cache_write_gpu(device, gen, dtype, is_neox, num_tokens, hq, hkv, d, page, return_kv):
    _check(device, gen, dtype, num_tokens, hq, hkv, d, page, is_neox, return_kv,
           num_padding=5, num_blocks=-(-(num_tokens + 8) // page) + 3, max_pos=131072)


@gpu
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("num_tokens,hq,hkv,d,page", [(1, 32, 8, 128, 16), (640, 32, 8, 128, 16),
                                                      (4099, 16, 8, 128, 16), (33, 8, 1, 256, 32)])
def test_rotary_kv_cache_write_qk_norm_gpu(device, gen, is_neox, num_tokens, hq, hkv, d, page):
    _check(device, gen, torch.bfloat16, num_tokens, hq, hkv, d, page, is_neox, return_kv=True, num_padding=5,
           num_blocks=-(-(num_tokens + 8) // page) + 3, max_pos=131072, qk_norm=True)
