"""Rotary position embedding, applied in place to query and key.

Math, for token t at position p, with c_i = cos_sin_cache[p, i], s_i = cos_sin_cache[p, D/2 + i]
(i < D/2), every head vector x is rotated pairwise in fp32 and rounded back to its dtype:
    y_a = x_a c_i - x_b s_i,    y_b = x_b c_i + x_a s_i
where (a, b) = (i, i + D/2) for the neox / HF rotate_half layout and (2i, 2i + 1) for GPT-J.
Rope scaling variants (Llama-3.1, YaRN...) only change how the cache is built, not this kernel.

With q/k norm weights (Qwen3) every head vector is first RMS-normed over its D elements, as transformers'
Qwen3RMSNorm does followed by a separate rotary:
    x <- to_dtype(w * to_dtype(x * rsqrt(mean(x^2) + eps)))    (x, mean, rsqrt and the product in fp32)
so the norm costs no launch of its own (it reads the head the rotation reads anyway).

One program rotates all heads of one token, q then k, reading the cos/sin row once. query and key may
be strided views of a fused qkv output: head dim contiguous, token and head strides arbitrary.

Memory traffic: read and write q and k once, plus one cache row per token:
    bytes = 2 * T * (Hq + Hkv) * D * x.element_size() + T * D * 4 + T * positions.element_size()
(see bytes_moved). The interleaved layout reads with stride 2, but both halves of a pair share cache
lines, so DRAM traffic is the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def head_rms_norm(x, w, inv_rms, DTYPE: tl.constexpr):
    """to_dtype(w * to_dtype(x * inv_rms)) in fp32: Qwen3RMSNorm's two roundings (inv_rms [rows, 1])."""
    normed = (x.to(tl.float32) * inv_rms).to(DTYPE).to(tl.float32)
    return (w.to(tl.float32) * normed).to(DTYPE).to(tl.float32)


@triton.jit
def rotated_halves(base, stride_h, num_heads, cos, sin, i, i_ok, norm_w_ptr, eps,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr):
    """The rotated pair halves (fp32) of every head at `base`, each head RMS-normed first with the weight
    at norm_w_ptr if HAS_NORM: (y_a, y_b, head index column, offsets of a and b in a head, mask)."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & i_ok[None, :]  # [BLOCK_H, BLOCK_HALF]
    if IS_NEOX:
        off_a, off_b = i, i + HALF
    else:
        off_a, off_b = 2 * i, 2 * i + 1
    xa = tl.load(base + h[:, None] * stride_h + off_a[None, :], mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(base + h[:, None] * stride_h + off_b[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # the two halves are the whole head: its mean square from both
        inv_rms = tl.rsqrt((tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)) / (2 * HALF) + eps)[:, None]
        dtype = base.dtype.element_ty
        xa = head_rms_norm(xa, tl.load(norm_w_ptr + off_a, mask=i_ok, other=0.0)[None, :], inv_rms, dtype)
        xb = head_rms_norm(xb, tl.load(norm_w_ptr + off_b, mask=i_ok, other=0.0)[None, :], inv_rms, dtype)
    ya = xa * cos[None, :] - xb * sin[None, :]
    yb = xb * cos[None, :] + xa * sin[None, :]
    return ya, yb, h[:, None], off_a[None, :], off_b[None, :], mask


@triton.jit
def _rotate_heads(base, stride_h, num_heads, cos, sin, i, i_ok, norm_w_ptr, eps,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr):
    ya, yb, h, off_a, off_b, mask = rotated_halves(base, stride_h, num_heads, cos, sin, i, i_ok, norm_w_ptr,
                                                   eps, HALF, BLOCK_H, IS_NEOX, HAS_NORM)
    head = base + h * stride_h
    tl.store(head + off_a, ya.to(base.dtype.element_ty), mask=mask)
    tl.store(head + off_b, yb.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_kv_heads, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i_ok, other=0.0).to(tl.float32)  # [BLOCK_HALF]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, i, i_ok, q_norm_ptr, eps,
                  HALF, BLOCK_HQ, IS_NEOX, HAS_NORM)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_kv_heads, cos, sin, i, i_ok, k_norm_ptr, eps,
                  HALF, BLOCK_HK, IS_NEOX, HAS_NORM)


def check_qk_norm(q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                  head_dim: int) -> bool:
    """Whether q/k norm weights were given: both (contiguous [head_dim]) or neither."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together: got only one of them")
    if q_norm_weight is None:
        return False
    for w in (q_norm_weight, k_norm_weight):
        assert w.shape == (head_dim,) and w.is_contiguous(), (w.shape, head_dim)
    return True


def bytes_moved(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor) -> int:
    num_tokens, _, head_dim = query.shape
    heads = query.shape[1] + key.shape[1]
    return (2 * num_tokens * heads * head_dim * query.element_size() + num_tokens * head_dim * 4
            + positions.numel() * positions.element_size())


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq, D], rotated in place (strided view allowed)
    key: torch.Tensor,  # [T, Hkv, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_positions, D]: cos in [:, :D/2], sin in [:, D/2:]
    is_neox: bool = True,
    q_norm_weight: torch.Tensor | None = None,  # [D]: RMS-norm each q head first (Qwen3), with k_norm_weight
    k_norm_weight: torch.Tensor | None = None,  # [D]
    norm_eps: float = 1e-6,
) -> None:
    num_tokens, num_q_heads, head_dim = query.shape
    has_norm = check_qk_norm(q_norm_weight, k_norm_weight, head_dim)
    assert key.dim() == 3 and key.shape[0] == num_tokens and key.shape[2] == head_dim, key.shape
    assert head_dim % 2 == 0 and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim
    assert positions.shape == (num_tokens,) and not positions.is_floating_point()
    assert query.stride(2) == 1 and key.stride(2) == 1, "head dim must be contiguous"
    assert cos_sin_cache.stride(1) == 1 and positions.is_contiguous()
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache,
        *((q_norm_weight, k_norm_weight) if has_norm else (cos_sin_cache,) * 2),  # (unused without)
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        num_q_heads, key.shape[1], norm_eps,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(key.shape[1]),
        IS_NEOX=is_neox, HAS_NORM=has_norm, num_warps=4,
    )
