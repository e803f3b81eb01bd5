"""Hopper (sm_90) prefill attention in Gluon: prefill_attention's math, with the software pipeline written out.

Same problem, layout, tiles and output as prefill_attention.py (read its docstring first): a program owns
BLOCK_M = 64 rows (BLOCK_Q query tokens x the GROUP heads of one KV head) and walks key tiles of BLOCK_N = 64,
first the cached prefix, then the chunk up to the diagonal. What Gluon adds is control of the schedule,
which Triton's pipeliner does not reach for attention:

  * Every K / V tile arrives by TMA into a two-stage ring, signalled by an mbarrier: the chunk's tiles from
    its contiguous rows, the prefix's tiles as BLOCK_N / block_size page copies through the block table
    (the Triton kernel gathers the prefix with pointer loads).
  * FlashAttention-3's in-warpgroup overlap. In step t the warpgroup issues S(t) = Q K(t)^T and
    O += P(t-1) V(t-1) as asynchronous wgmma, waits for S(t) only, runs the softmax of tile t while
    P(t-1) V(t-1) is still on the tensor cores, then waits for it and rescales O.
  * Q sits in registers as the wgmma A operand, so S reads only K from shared memory.
  * The next K tile's TMA is issued between the softmax and the wait for P V. ptxas hoists a wgmma wait to
    the top of its basic block; the branch around that load ends the block, which keeps the wait (and so
    the overlap) where the source puts it.

Masked tiles (the prefix's partial last tile; chunk tiles on the diagonal) mask S per row. A tile whose
keys run past their end (into unused cache slots, a neighbour's rows or padding, any of which may hold
NaN) also has those V rows zeroed in shared memory before P V reads them: p = 0 times NaN is NaN.

Two programs share an SM (80 KB of shared memory, <= 255 registers each). On an H100 (bf16, D 128, GQA 4)
this ran 1.06x the Triton kernel at 8 x 2048 tokens, 1.10-1.15x for chunks over a cached prefix, and
1.19x at 16 x 512 (benchmarks/kernels/run_all.py has the current numbers). BLOCK_N 128 spills registers;
BLOCK_N 32 with three programs a SM, and 8-warp BLOCK_M 128 tiles, were slower.

No interpreter runs Gluon, so this kernel is tested on the GPU only; the Triton kernel remains the path for
every other device, dtype (fp32) and head size, and for steps too small to pay for four TMA descriptors.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton

logger = logging.getLogger("fastllm.kernels")

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover (triton without Gluon: `unsupported` sends every call to Triton)
    gluon = None

BLOCK_M, BLOCK_N, STAGES, NUM_WARPS = 64, 64, 2, 4
HEAD_DIMS = (64, 128)  # tuned and tested; a 256-wide fp32 accumulator would not fit beside S and Q
_LOG2E = 1.4426950408889634


if gluon is not None:
    # triton 3.6 (the GPU image) and later releases name two builtins differently
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    @gluon.jit
    def _tile_keys(t, n_pre, context, seq_len, diagonal, BLOCK_N: gl.constexpr):
        """Key tile t as (position of its first key, end of the keys it may use, whether it needs a mask:
        it runs past that end or past `diagonal`, the tile's first query position); prefix tiles first."""
        is_prefix = t < n_pre
        base = gl.where(is_prefix, t * BLOCK_N, context + (t - n_pre) * BLOCK_N)
        kend = gl.where(is_prefix, context, seq_len)
        return base, kend, (base + BLOCK_N > kend) | (base + BLOCK_N - 1 > diagonal)

    @gluon.jit
    def _load_tile(t, n_pre, context, q_start, col, chunk_desc, cache_desc, bt_row, bar, dst,
                   BLOCK_N: gl.constexpr, PAGE: gl.constexpr, BOX: gl.constexpr, NBYTES: gl.constexpr):
        """TMA the K (or V) rows of key tile t into dst and signal bar: the chunk's contiguous rows, or the
        prefix's pages through the block table (BLOCK_N // BOX copies of BOX rows)."""
        mbarrier.expect(bar, NBYTES)
        if t < n_pre:
            n0 = t * BLOCK_N
            for i in gl.static_range(BLOCK_N // BOX):
                n = n0 + i * BOX
                # past the prefix: any real block (block 0); those keys are masked, their V rows zeroed
                page = gl.load(bt_row + n // PAGE, mask=n < context, other=0)
                _tma_load(cache_desc, [page * PAGE + n % PAGE, col], bar, dst.slice(i * BOX, BOX))
        else:
            _tma_load(chunk_desc, [q_start + (t - n_pre) * BLOCK_N, col], bar, dst)

    @gluon.jit
    def _zero_v_past(v_stage, base, kend, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """Zero the V rows at or past kend of a loaded tile, before the tensor cores read it."""
        v = v_stage.load(layout)
        rows = base + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        v_stage.store(gl.where((rows < kend)[:, None], v, gl.zeros_like(v)))
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _softmax(s, m_i, l_i, base, kend, qpos, scale_log2, masked, BLOCK_N: gl.constexpr,
                 s_layout: gl.constexpr):
        """Online-softmax step (base 2) on raw scores s; `masked` (a runtime flag) applies key < kend and
        key position <= the row's position."""
        if masked:
            kpos = base + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            ok = (kpos[None, :] <= qpos[:, None]) & (kpos < kend)[None, :]
            s = gl.where(ok, s, gl.full_like(s, float("-inf")))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
        p = gl.exp2(s * scale_log2 - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha

    @gluon.jit
    def _prefill_kernel(
        q_ptr, out_ptr, k_desc, v_desc, kc_desc, vc_desc, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):
        BLOCK_Q: gl.constexpr = BLOCK_M // GROUP
        BOX: gl.constexpr = min(BLOCK_N, PAGE)
        NBYTES: gl.constexpr = BLOCK_N * HEAD_DIM * 2  # one K or V tile (16-bit types)
        dtype: gl.constexpr = k_desc.dtype
        tile = gl.num_programs(0) - 1 - gl.program_id(0)  # longest-running tiles first
        b = gl.program_id(1)
        kv_head = gl.program_id(2)
        q_start = gl.load(query_start_loc_ptr + b)
        q_len = gl.load(query_start_loc_ptr + b + 1) - q_start
        tok0 = tile * BLOCK_Q
        if tok0 >= q_len:
            return
        seq_len = gl.load(seq_lens_ptr + b)
        context = seq_len - q_len

        # S and O in wgmma accumulator layouts; P as the register A operand of P V; rows for loads / stores
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        LANES_D: gl.constexpr = HEAD_DIM // 8
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_D, LANES_D], [num_warps, 1], [1, 0])

        # Q: BLOCK_Q tokens x GROUP heads as rows, gathered once, through shared memory into registers
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
        tok = tok0 + r // GROUP
        heads = kv_head * GROUP + r % GROUP
        row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
        row_t = (q_start + tok).to(gl.int64)
        q = gl.load(q_ptr + (row_t * stride_qt + heads * stride_qh)[:, None] + d[None, :], mask=row_ok[:, None],
                    other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], k_desc.layout, q)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bar.index(i), count=1)
            mbarrier.init(v_bar.index(i), count=1)
        fence_async_shared()
        q_op = q_smem.load(q_layout)

        qpos = context + tok0 + gl.arange(0, BLOCK_M, layout=row_layout) // GROUP  # each row's position
        n_pre = gl.cdiv(context, BLOCK_N)
        n_tiles = n_pre + gl.cdiv(gl.minimum(tok0 + BLOCK_Q, q_len), BLOCK_N)
        bt_row = block_tables_ptr + b.to(gl.int64) * stride_bt
        col = kv_head * HEAD_DIM
        diagonal = context + tok0  # a tile reaching past this position needs the causal mask

        for u in range(gl.minimum(STAGES, n_tiles)):
            _load_tile(u, n_pre, context, q_start, col, k_desc, kc_desc, bt_row, k_bar.index(u), k_smem.index(u),
                       BLOCK_N, PAGE, BOX, NBYTES)
            _load_tile(u, n_pre, context, q_start, col, v_desc, vc_desc, bt_row, v_bar.index(u), v_smem.index(u),
                       BLOCK_N, PAGE, BOX, NBYTES)

        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # S's registers; use_acc=False ignores them
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_layout)  # finite: a fully masked row gets p = 0
        l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

        # tile 0: S and its softmax
        mbarrier.wait(k_bar.index(0), 0)
        s_tok = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        if STAGES < n_tiles:
            _load_tile(STAGES, n_pre, context, q_start, col, k_desc, kc_desc, bt_row, k_bar.index(0),
                       k_smem.index(0), BLOCK_N, PAGE, BOX, NBYTES)
        base, kend, masked = _tile_keys(0, n_pre, context, seq_len, diagonal, BLOCK_N)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, base, kend, qpos, scale_log2, masked, BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

        # step t: S(t) and P(t-1) V(t-1) in flight; the softmax of t overlaps P(t-1) V(t-1)
        for t in range(1, n_tiles):
            st = t % STAGES
            mbarrier.wait(k_bar.index(st), (t // STAGES) & 1)
            s_tok = warpgroup_mma(q_op, k_smem.index(st).permute((1, 0)), s, use_acc=False, is_async=True)
            sp = (t - 1) % STAGES
            mbarrier.wait(v_bar.index(sp), ((t - 1) // STAGES) & 1)
            if base + BLOCK_N > kend:  # tile t-1's keys run past their end
                _zero_v_past(v_smem.index(sp), base, kend, BLOCK_N, io_layout)
            o_tok = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            base, kend, masked = _tile_keys(t, n_pre, context, seq_len, diagonal, BLOCK_N)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, base, kend, qpos, scale_log2, masked, BLOCK_N, s_layout)
            if t + STAGES < n_tiles:  # K stage st is free (S(t) is done); also ends the basic block, see above
                _load_tile(t + STAGES, n_pre, context, q_start, col, k_desc, kc_desc, bt_row, k_bar.index(st),
                           k_smem.index(st), BLOCK_N, PAGE, BOX, NBYTES)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            if t - 1 + STAGES < n_tiles:  # V stage sp is free (P(t-1) V(t-1) is done)
                _load_tile(t - 1 + STAGES, n_pre, context, q_start, col, v_desc, vc_desc, bt_row, v_bar.index(sp),
                           v_smem.index(sp), BLOCK_N, PAGE, BOX, NBYTES)

        sp = (n_tiles - 1) % STAGES
        mbarrier.wait(v_bar.index(sp), ((n_tiles - 1) // STAGES) & 1)
        if base + BLOCK_N > kend:
            _zero_v_past(v_smem.index(sp), base, kend, BLOCK_N, io_layout)
        o_tok = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bar.index(i))
            mbarrier.invalidate(v_bar.index(i))

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = gl.convert_layout((acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]).to(dtype), io_layout)
        gl.store(out_ptr + (row_t * stride_ot + heads * stride_oh)[:, None] + d[None, :], out, mask=row_ok[:, None])


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9  # wgmma is sm_90 only


def unsupported(query, key, value, key_cache, value_cache) -> str | None:
    """Why this kernel cannot take the call (None: it can), apart from the K/V rows' TMA layout, which
    prefill_attention.py checks for both kernels. The caller logs the reason once."""
    head_dim = query.shape[2]
    if gluon is None:
        return "triton has no Gluon"
    if not query.is_cuda or not _is_hopper(query.device.index if query.device.index is not None
                                           else torch.cuda.current_device()):
        return "not an sm_90 GPU"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {query.dtype}"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}"
    page = key_cache.shape[1]
    if page & (page - 1):
        return f"block size {page} (page copies need a power of 2)"
    group = query.shape[1] // key.shape[1]
    if group > BLOCK_M:
        return f"{group} query heads per KV head"
    width = key.shape[1] * head_dim
    for cache in (key_cache, value_cache):  # [num_blocks * block_size, Hkv * D] row views
        if cache.stride() != (page * width, width, head_dim, 1) or cache.data_ptr() % 16:
            return f"KV cache not contiguous (strides {cache.stride()})"
    return None


_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def prefill_attention_hopper(query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                             max_query_len: int, scale: float) -> torch.Tensor:
    """prefill_attention on an H100-class GPU; the caller checks `unsupported` first."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, page, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or seq_lens.shape[0] == 0 or max_query_len <= 0:
        return out
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], getattr(gl, _GL_DTYPES[query.dtype]))
    width = num_kv_heads * head_dim
    tile, box = [BLOCK_N, head_dim], [min(page, BLOCK_N), head_dim]
    k_desc = TensorDescriptor(key, [num_tokens, width], [key.stride(0), 1], tile, layout)
    v_desc = TensorDescriptor(value, [num_tokens, width], [value.stride(0), 1], tile, layout)
    kc_desc = TensorDescriptor(key_cache, [num_blocks * page, width], [width, 1], box, layout)
    vc_desc = TensorDescriptor(value_cache, [num_blocks * page, width], [width, 1], box, layout)
    grid = (triton.cdiv(max_query_len, BLOCK_M // group), seq_lens.shape[0], num_kv_heads)
    _prefill_kernel[grid](
        query, out, k_desc, v_desc, kc_desc, vc_desc, block_tables, seq_lens, query_start_loc, scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES,
        num_warps=NUM_WARPS)
    return out
