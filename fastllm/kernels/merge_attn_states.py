"""Merge partial attention states by their log-sum-exp: cascade attention's last step.

Query row t attended to two disjoint sets of keys: its suffix (out[t], lse[t] from a paged kernel with
kv_start) and its group's shared prefix, in S parts (prefix_o, prefix_lse from cascade_attention.py). Softmax
over the union is the weighted mean of the parts:
    out[t] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),   M = max_s lse_s   (base 2, as the kernels)
over the S + 1 states; an empty part (lse = -inf) weighs 0 and its o is never read. out is updated in place,
only at the listed rows (a row of -1 is padding). Grid: (R, Hq / _HEADS_PER_PROGRAM): a program merges a few
heads of one row, each from its S + 1 states of D floats.

Memory traffic: R * Hq * (S * (D + 1) * 4 + 2 * D * out.element_size() + 4) bytes.

`merge_prefix_states` is the merge itself, online over the splits: this launch calls it, and so does a decode
step's suffix kernel (cascade_attention.cascade_decode_attention), which folds each row's prefix states in as
it finishes the row, so that a decode step has no merge launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_HEADS_PER_PROGRAM = 4  # (row, head) states a program merges: about a GQA group, as the suffix kernel does


@triton.jit
def merge_prefix_states(out_rows, lse_rows, prefix_o_ptr, prefix_lse_ptr, states, num_splits, mask,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """For each masked row i: out_rows[i] (HEAD_DIM values; its suffix attention, lse at lse_rows[i]) <- the
    merge with its prefix states states[i] .. states[i] + num_splits - 1 of prefix_o / prefix_lse (the
    module docstring's math, online over the splits)."""
    d = tl.arange(0, BLOCK_D)
    io_mask = mask[:, None] & (d < HEAD_DIM)[None, :]
    own_lse = tl.load(lse_rows, mask=mask, other=float("-inf"))
    own = tl.load(out_rows[:, None] + d[None, :], mask=io_mask, other=0.0).to(tl.float32)
    m = tl.maximum(own_lse, -1.0e30)  # finite, so that no weight is exp2(-inf + inf) = NaN
    den = tl.exp2(own_lse - m)
    acc = own * den[:, None]
    for s in range(num_splits):
        part_lse = tl.load(prefix_lse_ptr + states + s, mask=mask, other=float("-inf"))
        m_new = tl.maximum(m, part_lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(part_lse - m_new)  # 0 for an empty split, whose o is never read
        part_o = tl.load(prefix_o_ptr + (states + s)[:, None] * HEAD_DIM + d[None, :],
                         mask=io_mask & (w > 0.0)[:, None], other=0.0)
        acc = acc * alpha[:, None] + w[:, None] * part_o
        den = den * alpha + w
        m = m_new
    merged = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(out_rows[:, None] + d[None, :], merged.to(out_rows.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_kernel(out_ptr, lse_ptr, prefix_o_ptr, prefix_lse_ptr, rows_ptr, stride_ot, stride_oh, stride_lt,
                  num_heads, num_splits,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t = tl.load(rows_ptr + r).to(tl.int64)
    if t < 0:  # padding (a CUDA graph's plan has room for more rows than a step uses)
        return
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    merge_prefix_states(out_ptr + t * stride_ot + h * stride_oh, lse_ptr + t * stride_lt + h, prefix_o_ptr,
                        prefix_lse_ptr, (r * num_heads + h) * num_splits, num_splits, h < num_heads, HEAD_DIM,
                        BLOCK_D)


def merge_attn_states(
    out: torch.Tensor,  # [T, Hq, D]: the suffix attention; the listed rows are overwritten
    lse: torch.Tensor,  # [T, Hq] float32
    prefix_o: torch.Tensor,  # [R, Hq, S, D] float32
    prefix_lse: torch.Tensor,  # [R, Hq, S] float32
    rows: torch.Tensor,  # [R] int32 (< 0: padding, skipped)
) -> None:
    num_rows, num_heads, num_splits, head_dim = prefix_o.shape
    assert out.shape[1:] == (num_heads, head_dim) and out.stride(2) == 1, (out.shape, prefix_o.shape)
    assert lse.shape == out.shape[:2] and lse.dtype == torch.float32 and lse.stride(1) == 1
    assert prefix_o.dtype == prefix_lse.dtype == torch.float32 and prefix_o.is_contiguous()
    assert prefix_lse.shape == (num_rows, num_heads, num_splits) and prefix_lse.is_contiguous()
    assert rows.shape == (num_rows,) and rows.is_contiguous()
    if num_rows == 0:
        return
    block_h = min(_HEADS_PER_PROGRAM, triton.next_power_of_2(num_heads))
    _merge_kernel[(num_rows, triton.cdiv(num_heads, block_h))](
        out, lse, prefix_o, prefix_lse, rows, out.stride(0), out.stride(1), lse.stride(0), num_heads,
        num_splits,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_H=block_h,
        num_warps=2 if head_dim <= 64 else 4,
    )
