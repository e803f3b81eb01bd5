"""Row-wise argmax of the logits: greedy sampling on the device.

Math: out[b] = the first j with x[b, j] = max_j x[b, j], as torch.argmax. NaN counts as +inf, so a row
holding both NaN and +inf gives the first of either where torch gives the first NaN.

Why a kernel: torch.argmax walks a row with one thread block, which made it a decode step's largest
non-GEMM cost after attention at batch 1 (README, "Kernel choices", has the timings).
Here each row is cut into `num_parts` contiguous chunks. Pass 1 (grid B x parts) scans one chunk,
BLOCK columns at a time, keeping per lane the running max and the first column that reached it
(a strict > keeps the earlier one), then writes the chunk's (max, first index). Pass 2 (grid B)
takes the max over the parts and, among equal maxima, the lowest index, which is the first
occurrence because the chunks are in column order. With one part, pass 1 writes `out` directly.

Launch config is a host-side choice on B and the row length only (CUDA-graph safe, no autotune). A
chunk's scan is a chain of dependent 2 KiB loads, so the launch wants many short chunks and many warps:
8 warps at 16 programs per SM won a sweep of 1024-4096 columns a step x 4-64 programs per SM x 4/8 warps
at every batch size (README, "Kernel choices").

Memory traffic: one read of the logits, plus B * parts * 8 bytes of partials written and read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastllm.kernels import pdl, sm_count

_BLOCK = 1024  # columns per step of a chunk scan
_PROGRAMS_PER_SM = 16
_NUM_WARPS = 8


@triton.jit(do_not_specialize=["n_cols", "chunk"])
def _argmax_part_kernel(
    x_ptr, part_val_ptr, part_idx_ptr, out_ptr, stride_xb, n_cols, chunk,
    BLOCK: tl.constexpr, DIRECT_OUT: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl.wait(USE_PDL)  # launched with PDL (pdl.py)
    b = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    num_parts = tl.num_programs(1)
    start = part * chunk
    end = tl.minimum(start + chunk, n_cols)
    lane = tl.arange(0, BLOCK)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)  # lanes that never see a column keep INT_MAX
    row = x_ptr + b * stride_xb
    for c0 in range(start, end, BLOCK):
        cols = c0 + lane
        ok = cols < end
        v = tl.load(row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)  # NaN counts as +inf
        # A lane's first column always enters (so an all -inf row still names a real column).
        take = ok & ((v > best_val) | (best_idx == 2147483647))
        best_val = tl.where(take, v, best_val)
        best_idx = tl.where(take, cols, best_idx)
    top = tl.max(best_val, axis=0)
    first = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    if DIRECT_OUT:
        tl.store(out_ptr + b, first.to(tl.int64))
    else:
        tl.store(part_val_ptr + b * num_parts + part, top)
        tl.store(part_idx_ptr + b * num_parts + part, first)


@triton.jit
def _argmax_merge_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_parts, BLOCK_P: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    ok = p < num_parts
    val = tl.load(part_val_ptr + b * num_parts + p, mask=ok, other=float("-inf"))
    idx = tl.load(part_idx_ptr + b * num_parts + p, mask=ok, other=2147483647)
    top = tl.max(val, axis=0)
    tl.store(out_ptr + b, tl.min(tl.where(val == top, idx, 2147483647), axis=0).to(tl.int64))


def choose_num_parts(batch: int, n_cols: int, num_sms: int) -> int:
    """Chunks per row: ~_PROGRAMS_PER_SM programs per SM over the whole batch, each >= one BLOCK."""
    return max(1, min(triton.cdiv(n_cols, _BLOCK), triton.cdiv(_PROGRAMS_PER_SM * num_sms, max(batch, 1))))


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> int64 [B] (into `out` when given)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    batch, n_cols = logits.shape
    assert n_cols > 0, "argmax of an empty row"
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    assert out.shape == (batch,) and out.dtype == torch.int64 and out.is_contiguous()
    if batch == 0:
        return out
    parts = choose_num_parts(batch, n_cols, sm_count.num_sms(logits.device))
    chunk = triton.cdiv(triton.cdiv(n_cols, parts), _BLOCK) * _BLOCK
    parts = triton.cdiv(n_cols, chunk)  # no empty chunk
    if parts == 1:
        part_val = part_idx = out  # unused
    else:
        part_val = torch.empty(batch, parts, dtype=torch.float32, device=logits.device)
        part_idx = torch.empty(batch, parts, dtype=torch.int32, device=logits.device)
    _argmax_part_kernel[(batch, parts)](
        logits, part_val, part_idx, out, logits.stride(0), n_cols, chunk,
        BLOCK=_BLOCK, DIRECT_OUT=parts == 1, num_warps=_NUM_WARPS, **pdl.launch_options(logits.device),
    )
    if parts > 1:
        _argmax_merge_kernel[(batch,)](part_val, part_idx, out, parts,
                                       BLOCK_P=triton.next_power_of_2(parts), num_warps=1,
                                       **pdl.launch_options(logits.device))
    return out
