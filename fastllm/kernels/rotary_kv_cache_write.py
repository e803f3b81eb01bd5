"""Rotary embedding of q and k fused with the KV-cache write: what the attention layer runs first.

Math: exactly rotary.py's rotation (fp32, rounded back to the input dtype) followed by
kv_cache_write.py's scatter, for every token t with slot s = slot_mapping[t]:
    q_out[t] = rope(query[t], p_t)
    key_cache[s // page, s % page] = rope(key[t], p_t),  value_cache[...] = value[t]    (s >= 0 only)
    key_out[t], value_out[t] = those rows as the cache holds them                       (return_kv only)
With q/k norm weights (Qwen3) each q and k head is RMS-normed first, as rotary.py describes. An FP8 cache
stores e4m3 of the rotated key / k_scale and value / v_scale (kv_fp8.py); key_out and value_out are then
those e4m3 values in the activations' dtype (exact), and with a 16/32-bit cache the rotated key and value
itself. Prefill attention reads the chunk's keys and values from them (contiguous rows, rounded once here
rather than in every program that reads a tile); return_kv=False leaves them to the cache.
Out of place: query and key (views of the qkv projection) are left as they are, so the attention op
that calls this mutates none of its inputs. Plain decode steps no longer come here
(rotary_decode_attention does this inside decode attention); a speculative step's token rows (the verify,
the draft's first round) do, between the qkv projection and decode attention, so it launches with PDL as
they do.

Why fused: at decode a step ran a rotary and a KV-write kernel per layer, each launch-bound work for
one token's heads. One program per token reads q, k, v once and writes each once.

Memory traffic: read q, k, v and one cos/sin row, write q_out, the K/V cache rows (and key_out, with an
FP8 cache value_out too):
    bytes = T * (2 Hq + (3 + rows_out) Hkv) * D * x.element_size() + T * D * 4 + T * (pos + slot)
(valid tokens write the cache; see bytes_moved).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastllm.kernels import pdl
from fastllm.kernels.kv_fp8 import to_cache
from fastllm.kernels.reference import FP8, check_kv_scales
from fastllm.kernels.rotary import check_qk_norm, rotated_halves


@triton.jit
def _rotary_kv_write_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, slot_ptr, q_out_ptr, k_out_ptr, v_out_ptr, key_cache_ptr,
    value_cache_ptr,
    q_norm_ptr, k_norm_ptr, eps,  # HAS_NORM: each head's RMSNorm weight [HEAD_DIM] for q and for k
    k_scale, v_scale,  # an FP8 cache's scales
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_vot, stride_voh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    num_q_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, PAGE: tl.constexpr,
    IS_NEOX: tl.constexpr, RETURN_KV: tl.constexpr, RETURN_V: tl.constexpr, HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (pdl.py): positions and slots may be the step's outputs too
):
    pdl.wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64: block * stride_kcb can exceed 2^31
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0).to(tl.float32)

    qa, qb, h, off_a, off_b, mask = rotated_halves(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, i,
                                                    i_ok, q_norm_ptr, eps, HALF, BLOCK_HQ, IS_NEOX, HAS_NORM)
    q_out = q_out_ptr + t * stride_qot + h * stride_qoh
    tl.store(q_out + off_a, qa.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(q_out + off_b, qb.to(q_out_ptr.dtype.element_ty), mask=mask)

    ka, kb, h, off_a, off_b, mask = rotated_halves(k_ptr + t * stride_kt, stride_kh, num_kv_heads, cos, sin,
                                                    i, i_ok, k_norm_ptr, eps, HALF, BLOCK_HK, IS_NEOX,
                                                    HAS_NORM)
    # Round to the activations' dtype first, as rotary + kv_cache_write do, then to the cache's.
    cache_ty = key_cache_ptr.dtype.element_ty
    ka = to_cache(ka.to(k_ptr.dtype.element_ty), k_scale, cache_ty)
    kb = to_cache(kb.to(k_ptr.dtype.element_ty), k_scale, cache_ty)
    if RETURN_KV:  # the rows as the cache holds them, in the activations' dtype
        k_out = k_out_ptr + t * stride_kot + h * stride_koh
        tl.store(k_out + off_a, ka.to(k_out_ptr.dtype.element_ty), mask=mask)
        tl.store(k_out + off_b, kb.to(k_out_ptr.dtype.element_ty), mask=mask)
    hv = tl.arange(0, BLOCK_HK)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    v_mask = (hv < num_kv_heads) & (d < HEAD_DIM)
    if RETURN_V or slot >= 0:
        v = to_cache(tl.load(v_ptr + t * stride_vt + hv * stride_vh + d, mask=v_mask), v_scale, cache_ty)
        if RETURN_V:
            tl.store(v_out_ptr + t * stride_vot + hv * stride_voh + d, v.to(v_out_ptr.dtype.element_ty),
                     mask=v_mask)
        if slot >= 0:  # padding tokens write nothing
            block = slot // PAGE
            offset = slot % PAGE
            kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch
            tl.store(kc + off_a, ka, mask=mask)
            tl.store(kc + off_b, kb, mask=mask)
            vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs + hv * stride_vch + d
            tl.store(vc, v, mask=v_mask)


def bytes_moved(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                num_valid: int, return_kv: bool = False) -> int:
    """DRAM bytes of one call when num_valid slots are >= 0 (a 16-bit cache: key_out only)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, size = key.shape[1], query.element_size()
    row = num_kv_heads * head_dim * size
    return (2 * num_tokens * num_q_heads * head_dim * size  # q in and out
            + 2 * num_tokens * row + 2 * num_valid * row  # k and v in, the cache rows out
            + (num_tokens * row if return_kv else 0)
            + num_tokens * (head_dim * 4 + positions.element_size() + slot_mapping.element_size()))


def rotary_kv_cache_write(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq, D] (strided view allowed; not modified)
    key: torch.Tensor,  # [T, Hkv, D] (not modified)
    value: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32: cos in [:, :D/2], sin in [:, D/2:]
    is_neox: bool,
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; < 0 means skip
    return_kv: bool,  # also return the key and value rows as the cache holds them (prefill reads those)
    q_norm_weight: torch.Tensor | None = None,  # [D]: RMS-norm each q head first (Qwen3), with k_norm_weight
    k_norm_weight: torch.Tensor | None = None,  # [D]
    norm_eps: float = 1e-6,
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(rotated query, key_out, value_out); the last two None without return_kv, value_out `value` itself
    with a 16/32-bit cache (what it holds)."""
    check_kv_scales(key_cache, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    has_norm = check_qk_norm(q_norm_weight, k_norm_weight, head_dim)
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim), (key.shape, value.shape)
    assert head_dim % 2 == 0 and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (key_cache.shape, key.shape)
    assert positions.shape == slot_mapping.shape == (num_tokens,)
    assert not positions.is_floating_point() and not slot_mapping.is_floating_point()
    assert positions.is_contiguous() and slot_mapping.is_contiguous() and cos_sin_cache.stride(1) == 1
    assert query.stride(2) == key.stride(2) == value.stride(2) == 1, "head dim must be contiguous"
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=key.dtype, device=key.device) \
        if return_kv else None
    return_v = return_kv and key_cache.dtype == FP8  # (a 16/32-bit cache holds value as it is)
    v_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=value.dtype, device=value.device) \
        if return_v else (value if return_kv else None)
    if num_tokens == 0:
        return q_out, k_out, v_out
    half = head_dim // 2
    k_out_arg = k_out if k_out is not None else q_out  # unused
    v_out_arg = v_out if return_v else q_out  # unused
    _rotary_kv_write_kernel[(num_tokens,)](
        positions, query, key, value, cos_sin_cache, slot_mapping, q_out, k_out_arg, v_out_arg, key_cache,
        value_cache,
        *((q_norm_weight, k_norm_weight) if has_norm else (cos_sin_cache,) * 2), norm_eps,  # (unused without)
        k_scale, v_scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_sin_cache.stride(0),
        q_out.stride(0), q_out.stride(1), k_out_arg.stride(0), k_out_arg.stride(1),
        v_out_arg.stride(0), v_out_arg.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_q_heads, num_kv_heads,
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        PAGE=key_cache.shape[1], IS_NEOX=is_neox, RETURN_KV=return_kv, RETURN_V=return_v, HAS_NORM=has_norm,
        num_warps=4, **pdl.launch_options(query.device),
    )
    return q_out, k_out, v_out
