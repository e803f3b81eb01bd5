"""Triton kv_cache_write vs reference.kv_cache_write.

Tolerance: none. The kernel is a copy with a dtype cast, so the written slots must be bitwise equal to
the reference's (same rounding of key.to(cache dtype)), and every other slot must keep its NaN poison.
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import reference_impl, triton_impl
from tests.kernels.kernel_testing import gpu


def _check(device, gen, num_tokens, hkv, d, page, num_blocks, dtype, cache_dtype=None, num_padding=0,
           strided=False, config=None):
    cache_dtype = cache_dtype or dtype
    total = num_tokens + num_padding
    key = torch.randn(total, hkv, d, device=device).to(dtype)
    value = torch.randn(total, hkv, d, device=device).to(dtype)
    if strided:  # k a slice of a fused qkv output, v with yet other strides
        key = torch.randn(total, 3 * hkv, d, device=device).to(dtype)[:, hkv : 2 * hkv]
        value = torch.randn(total, hkv, d + 16, device=device).to(dtype)[:, :, 8 : d + 8]
    # distinct random slots anywhere in the cache, padding (-1) entries scattered among them
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    slot_mapping = torch.cat([slots, torch.full((num_padding,), -1)])[torch.randperm(total, generator=gen)]
    slot_mapping = slot_mapping.to(device=device, dtype=torch.int64 if num_tokens % 2 else torch.int32)

    shape = (num_blocks, page, hkv, d)
    key_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=device)
    value_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=device)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    if config is None:
        triton_impl("kv_cache_write")(key, value, key_cache, value_cache, slot_mapping)
    else:
        from fastllm.kernels.kv_cache_write import kv_cache_write_config

        kv_cache_write_config(key, value, key_cache, value_cache, slot_mapping, config=config)
    reference_impl("kv_cache_write")(key, value, ref_k, ref_v, slot_mapping)

    written = torch.zeros(num_blocks * page, dtype=torch.bool, device=device)
    written[slot_mapping[slot_mapping >= 0].long()] = True
    for out, ref in ((key_cache, ref_k), (value_cache, ref_v)):
        flat_out, flat_ref = out.view(-1, hkv, d), ref.view(-1, hkv, d)
        assert torch.equal(flat_out[written], flat_ref[written]), "written slots differ from the reference"
        # written slots hold finite values, so the NaN count says whether any other slot was touched
        # (counting avoids copying the unwritten part of a multi-GiB cache)
        untouched = int((~written).sum()) * hkv * d
        assert int(torch.isnan(out).sum()) == untouched, "a slot outside slot_mapping was touched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hkv,d,page",
                         [(1, 1, 8, 8), (7, 2, 64, 16), (33, 8, 128, 16), (5, 3, 80, 32)])
def test_kv_cache_write(device, gen, dtype, num_tokens, hkv, d, page):
    _check(device, gen, num_tokens, hkv, d, page, num_blocks=11, dtype=dtype, num_padding=3)


def test_kv_cache_write_strided_inputs(device, gen):
    _check(device, gen, 9, 2, 64, 16, num_blocks=5, dtype=torch.float16, num_padding=2, strided=True)


def test_kv_cache_write_casts_to_cache_dtype(device, gen):
    _check(device, gen, 6, 2, 64, 16, num_blocks=4, dtype=torch.float32, cache_dtype=torch.float16)


def _candidates():
    from fastllm.kernels.kv_cache_write import CANDIDATES

    return [pytest.param(c, id=f"T{c.block_t}-w{c.num_warps}") for c in CANDIDATES]


@pytest.mark.parametrize("config", _candidates())
@pytest.mark.parametrize("num_tokens,hkv,d", [(37, 2, 64), (8, 3, 80)])
def test_kv_cache_write_every_candidate(device, gen, config, num_tokens, hkv, d):
    # T not a multiple of the tokens per program (a ragged last program), padding among the tokens,
    # non-power-of-2 heads / head dim (masked tiles), strided inputs
    _check(device, gen, num_tokens, hkv, d, 16, num_blocks=8, dtype=torch.float16, num_padding=5,
           strided=hkv == 2, config=config)


def test_kv_cache_write_table():
    from fastllm.kernels.kv_cache_write import CANDIDATES, choose_config

    for t in (1, 2, 7, 64, 100, 256, 512, 2048, 8192, 100000):
        assert choose_config(t, 2048) in CANDIDATES


def test_kv_cache_write_all_padding(device, gen):
    _check(device, gen, 0, 2, 64, 16, num_blocks=4, dtype=torch.float16, num_padding=4)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
@pytest.mark.parametrize("hkv,d,page", [(8, 128, 16), (4, 64, 32), (2, 256, 16)])
def test_kv_cache_write_gpu(device, gen, dtype, num_tokens, hkv, d, page):
    _check(device, gen, num_tokens, hkv, d, page, num_blocks=32768, dtype=dtype,
           num_padding=num_tokens // 8 + 1)


@gpu
@pytest.mark.parametrize("config", _candidates())
@pytest.mark.parametrize("num_tokens", [1, 63, 8191])
def test_kv_cache_write_gpu_every_candidate(device, gen, config, num_tokens):
    _check(device, gen, num_tokens, 8, 128, 16, num_blocks=32768, dtype=torch.bfloat16,
           num_padding=num_tokens // 8 + 1, config=config)


@gpu
def test_kv_cache_write_gpu_int64_offsets(device, gen):
    # 32768 x 128 x 8 x 128 = 2^32 elements per cache: slot * stride overflows int32
    _check(device, gen, 512, 8, 128, 128, num_blocks=32768, dtype=torch.bfloat16, num_padding=7)
