"""Scatter this step's new K/V rows into the paged KV cache.

Math: for every token t with slot s = slot_mapping[t] >= 0,
    key_cache[s // block_size, s % block_size] = key[t]      (and the same for value)
Tokens with s < 0 are padding (e.g. CUDA-graph filler rows) and write nothing. An FP8 cache stores
e4m3 of key / k_scale and value / v_scale, saturated (kv_fp8.py).

Memory traffic: a pure copy. Per valid token it reads Hkv * D elements of key and value and writes
the same count into each cache, plus one slot index per token:
    bytes = T_valid * Hkv * D * 2 * (key.element_size() + cache.element_size()) + T * slot.element_size()
(see bytes_moved). A program moves a [BLOCK_T tokens, Hkv, D] tile of key and of value: each token's row
is contiguous along D (16-byte vector accesses) and lands as one contiguous Hkv x D run in the cache, and
several tokens per program keep more bytes in flight than one 4 KiB token row did.

Launch config (tokens per program, warps) is a host-side table on T and the row size (`choose_config`),
never triton.autotune: this kernel runs inside captured decode CUDA graphs, whose warm-up calls are all
padding (slot -1), so timings taken there would mean nothing. The table was measured on an H100 with
benchmarks/kernels/tune.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastllm.kernels.kv_fp8 import to_cache
from fastllm.kernels.reference import check_kv_scales


class KVWriteConfig(NamedTuple):
    block_t: int  # tokens per program
    num_warps: int


LEGACY_CONFIG = KVWriteConfig(1, 4)  # one token per program, as before tuning
# What choose_config can return (the first two) and what else tune.py times. In tune.py --explore (1-32
# tokens per program x 1-8 warps) every config moved T = 8192 random-slot rows at the same rate: the 2 KiB
# scattered writes, not the launch shape, set it (README, "Kernel choices"); small T is launch-bound.
CANDIDATES = [LEGACY_CONFIG, KVWriteConfig(4, 4), KVWriteConfig(2, 4), KVWriteConfig(8, 4), KVWriteConfig(16, 8)]


@triton.jit(do_not_specialize=["num_tokens"])  # one variant for every step's token count (no JIT mid-serving)
def _kv_cache_write_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, num_tokens, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,  # key/value [T, Hkv, D], last dim contiguous
    stride_kcb, stride_kcs, stride_kch,  # key_cache [num_blocks, block_size, Hkv, D]
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    t_ok = t < num_tokens
    # int64: block * stride_kcb exceeds 2^31 for caches over 2G elements (e.g. 32768 blocks of 128 tokens).
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    ok = slot >= 0  # padding tokens (and tokens past T) write nothing
    block = slot // PAGE
    offset = slot % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    if NUM_HEADS == BLOCK_H and HEAD_DIM == BLOCK_D:
        mask = ok[:, None, None]  # constant along D: the accesses stay 16-byte vectors
    else:
        mask = ok[:, None, None] & (h < NUM_HEADS)[None, :, None] & (d < HEAD_DIM)[None, None, :]
    hd_k = h[None, :, None] * stride_kh + d[None, None, :]  # [1, BLOCK_H, BLOCK_D]
    hd_v = h[None, :, None] * stride_vh + d[None, None, :]
    k = tl.load(key_ptr + t[:, None, None] * stride_kt + hd_k, mask=mask)
    v = tl.load(value_ptr + t[:, None, None] * stride_vt + hd_v, mask=mask)
    kc = key_cache_ptr + (block * stride_kcb + offset * stride_kcs)[:, None, None] \
        + h[None, :, None] * stride_kch + d[None, None, :]
    vc = value_cache_ptr + (block * stride_vcb + offset * stride_vcs)[:, None, None] \
        + h[None, :, None] * stride_vch + d[None, None, :]
    tl.store(kc, to_cache(k, k_scale, key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, to_cache(v, v_scale, value_cache_ptr.dtype.element_ty), mask=mask)


def choose_config(num_tokens: int, row_bytes: int) -> KVWriteConfig:
    """Tokens per program and warps from T and the bytes of one token's K row (host ints only)."""
    if num_tokens < 512:
        return LEGACY_CONFIG  # latency-bound: one token per program spreads over the most SMs
    return CANDIDATES[1]  # 4 tokens (16 KiB of K and V) per program: a quarter of the programs, same speed


def bytes_moved(key: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor,
                num_valid: int) -> int:
    """DRAM bytes one call moves when num_valid of the slot_mapping entries are >= 0."""
    row = key.shape[1] * key.shape[2]
    return num_valid * row * 2 * (key.element_size() + key_cache.element_size()) + (
        slot_mapping.numel() * slot_mapping.element_size()
    )


def kv_cache_write(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32/int64; < 0 means skip
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> None:
    kv_cache_write_config(key, value, key_cache, value_cache, slot_mapping, config=None, k_scale=k_scale,
                          v_scale=v_scale)


def kv_cache_write_config(key, value, key_cache, value_cache, slot_mapping, config: KVWriteConfig | None,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """kv_cache_write with config None (choose_config) or one explicit candidate (tests, tune.py)."""
    check_kv_scales(key_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape
    assert key_cache.shape[2:] == (num_heads, head_dim), (key_cache.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,) and not slot_mapping.is_floating_point()
    assert key.stride(2) == 1 and value.stride(2) == 1, "head dim must be contiguous"
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    assert slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    cfg = config or choose_config(num_tokens, num_heads * head_dim * key.element_size())
    _kv_cache_write_kernel[(triton.cdiv(num_tokens, cfg.block_t),)](
        key, value, key_cache, value_cache, slot_mapping, num_tokens, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, PAGE=key_cache.shape[1],
        BLOCK_T=cfg.block_t, BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=cfg.num_warps,
    )
