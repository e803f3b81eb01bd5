"""Scatter this step's new K/V rows into the paged KV cache.

Math: for every token t with slot s = slot_mapping[t] >= 0,
    key_cache[s // block_size, s % block_size] = key[t]      (and the same for value)
Tokens with s < 0 are padding (e.g. CUDA-graph filler rows) and write nothing.

Memory traffic: a pure copy. Per valid token it reads Hkv * D elements of key and value and writes
the same count into each cache, plus one slot index per token:
    bytes = T_valid * Hkv * D * 2 * (key.element_size() + cache.element_size()) + T * slot.element_size()
(see bytes_moved). One program per token moves 2 * Hkv * D elements (4 KiB for Hkv=8, D=128, bf16),
which is big enough to keep the copy bandwidth-bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_cache_write_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,  # key/value [T, Hkv, D], last dim contiguous
    stride_kcb, stride_kcs, stride_kch,  # key_cache [num_blocks, block_size, Hkv, D]
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    # int64: block * stride_kcb exceeds 2^31 for caches over 2G elements (e.g. 32768 blocks of 128 tokens).
    block = slot // PAGE
    offset = slot % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]  # [BLOCK_H, BLOCK_D]

    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


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
) -> None:
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
    _kv_cache_write_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, PAGE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
