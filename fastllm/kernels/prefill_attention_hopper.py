"""Hopper (sm_90) prefill attention in Gluon: prefill_attention's math, warp-specialized.

Same problem, layout and output as prefill_attention.py (read its docstring first). Rows are packed the same
way (BLOCK_Q query tokens x the GROUP heads of one KV head), but a program is three partitions, the
FlashAttention-3 structure, which Triton's own pipeliner does not reach for attention:

  * a producer warp that only moves data: every K and V tile arrives by TMA in a two-stage ring, the
    chunk's tiles from its contiguous rows, the prefix's as BLOCK_N / block_size page copies through the
    block table. A `ready` mbarrier per stage says a tile has landed, an `empty` one that both consumers
    are done with it;
  * two consumer warpgroups of BLOCK_M = 64 rows each (so 128 rows share every K/V tile) with all of the
    registers (240 each; the producer gives its back): S = Q K^T and O += P V on wgmma, with FA3's
    in-warpgroup overlap. In step t a consumer issues S(t) and P(t-1) V(t-1) asynchronously, waits for
    S(t) only, and runs the softmax of tile t while P(t-1) V(t-1) is still on the tensor cores.

Key tiles are 128 wide for steps with a long query (max_query_len >= LONG_QUERY), 64 otherwise: at 16 x 512
tokens the wider tiles were slower (the causal waste on the diagonal tiles grows with their width), from
1024-token queries on as fast or faster. Q sits in registers as the wgmma A operand with
64-key tiles; with 128-key tiles it stays in shared memory, as registers run out.

Masked tiles (the prefix's partial last tile; chunk tiles on the diagonal) mask S per row. A tile whose
keys run past their end (into unused cache slots, a neighbour's rows or padding, any of which may hold NaN)
also has those V rows zeroed in shared memory before P V reads them, since p = 0 times NaN is NaN: consumer 0
zeroes, consumer 1 waits on an mbarrier for it (at most two such tiles per program, one barrier each).

It is faster than the single-warpgroup Gluon kernel it replaced (two programs an SM, the in-warpgroup
overlap alone) and than the Triton kernel at every step shape tried; README's kernel table has its rate
against cuDNN. Slower, measured: the consumers taking turns at the tensor cores (FA3's pingpong), three
K/V stages, Q in shared memory with 64-key tiles, and half of the exponentials as a polynomial on the
FMA pipe.

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

BLOCK_M, STAGES = 64, 2  # rows per consumer warpgroup; K/V ring depth
LONG_QUERY = 1024  # steps whose longest query reaches this use 128-key tiles
HEAD_DIMS = (64, 128)  # tuned and tested; a 256-wide fp32 accumulator would not fit beside S and Q
# Registers: 3 warpgroups x 128 threads x 168 at launch = 64,512 of the SM's 65,536; the producer's
# warpgroup drops to 24 and each consumer rises to 240 (CONSUMER_REGS, PRODUCER_REGS below).
MAXNREG = 168
_LOG2E = 1.4426950408889634


if gluon is not None:
    # triton 3.6 (the GPU image) and later releases name two builtins differently
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _warpgroup_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # inside a partition: its warps
    CONSUMER_REGS, PRODUCER_REGS = gl.constexpr(240), gl.constexpr(24)

    @gluon.jit
    def _tile_keys(t, n_pre, context, seq_len, diagonal, BLOCK_N: gl.constexpr):
        """Key tile t as (position of its first key, end of the keys it may use, whether it needs a mask:
        it runs past that end or past `diagonal`, the rows' first query position); prefix tiles first."""
        is_prefix = t < n_pre
        base = gl.where(is_prefix, t * BLOCK_N, context + (t - n_pre) * BLOCK_N)
        kend = gl.where(is_prefix, context, seq_len)
        return base, kend, (base + BLOCK_N > kend) | (base + BLOCK_N - 1 > diagonal)

    @gluon.jit
    def _load_tile(t, n_pre, context, q_start, col, chunk_desc, cache_desc, bt_row, bar, dst,
                   BLOCK_N: gl.constexpr, PAGE: gl.constexpr, HEAD_DIM: gl.constexpr):
        """TMA the K (or V) rows of key tile t into dst and signal bar: the chunk's contiguous rows, or the
        prefix's pages through the block table (BLOCK_N // BOX copies of BOX rows)."""
        BOX: gl.constexpr = min(BLOCK_N, PAGE)
        mbarrier.expect(bar, BLOCK_N * HEAD_DIM * 2)  # 16-bit types
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
    def _producer(descs, k_smem, v_smem, bars, bt_row, n_pre, n_tiles, context, q_start, col,
                  BLOCK_N: gl.constexpr, PAGE: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """One warp: load K(t) and V(t) for every key tile into the ring, each once both consumers have
        released the stage's previous tile."""
        k_desc, v_desc, kc_desc, vc_desc = descs
        k_ready, v_ready, k_empty, v_empty, _ = bars
        for t in range(n_tiles):
            st = t % STAGES
            free = ((t // STAGES) & 1) ^ 1  # a fresh mbarrier passes a wait on parity 1
            mbarrier.wait(k_empty.index(st), free)
            _load_tile(t, n_pre, context, q_start, col, k_desc, kc_desc, bt_row, k_ready.index(st),
                       k_smem.index(st), BLOCK_N, PAGE, HEAD_DIM)
            mbarrier.wait(v_empty.index(st), free)
            _load_tile(t, n_pre, context, q_start, col, v_desc, vc_desc, bt_row, v_ready.index(st),
                       v_smem.index(st), BLOCK_N, PAGE, HEAD_DIM)

    @gluon.jit
    def _zero_v_past(WG: gl.constexpr, v_stage, zeroed, base, kend, context, BLOCK_N: gl.constexpr,
                     layout: gl.constexpr):
        """Zero the V rows at or past kend of a loaded tile, once for both consumers: consumer 0 writes
        (64 rows at a time), consumer 1 waits for it. One barrier for the prefix's tile, one for the
        chunk's."""
        done = zeroed.index((base >= context).to(gl.int32))
        if WG == 0:
            for i in gl.static_range(BLOCK_N // 64):
                rows_smem = v_stage.slice(i * 64, 64)
                v = rows_smem.load(layout)
                rows = base + i * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
                rows_smem.store(gl.where((rows < kend)[:, None], v, gl.zeros_like(v)))
            fence_async_shared()
            _warpgroup_barrier()
            mbarrier.arrive(done, count=1)
        else:
            mbarrier.wait(done, 0)

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
    def _consumer(WG: gl.constexpr, q_ptr, out_ptr, q_smem, k_smem, v_smem, bars, scale_log2,
                  stride_qt, stride_qh, stride_ot, stride_oh, q_start, q_len, tok0, context, seq_len, n_pre,
                  n_tiles, kv_head, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, Q_IN_REGS: gl.constexpr):
        """One warpgroup: attention for its BLOCK_M rows (tokens tok0 + WG * BLOCK_Q onwards) over all key
        tiles, releasing each K / V stage as soon as its MMA is done."""
        k_ready, v_ready, k_empty, v_empty, zeroed = bars
        HEAD_DIM: gl.constexpr = q_smem.shape[1]
        BLOCK_Q: gl.constexpr = BLOCK_M // GROUP
        dtype: gl.constexpr = q_smem.dtype
        # S and O in wgmma accumulator layouts; P (and Q) as the register A operand; rows for loads / stores
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        LANES_D: gl.constexpr = HEAD_DIM // 8
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_D, LANES_D], [4, 1], [1, 0])

        # Q: BLOCK_Q tokens x GROUP heads as rows, gathered once into shared memory
        my_tok0 = tok0 + WG * BLOCK_Q
        r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
        tok = my_tok0 + r // GROUP
        heads = kv_head * GROUP + r % GROUP
        row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
        row_t = (q_start + tok).to(gl.int64)
        q_smem.store(gl.load(q_ptr + (row_t * stride_qt + heads * stride_qh)[:, None] + d[None, :],
                             mask=row_ok[:, None], other=0.0))
        fence_async_shared()
        _warpgroup_barrier()
        if Q_IN_REGS:
            q_op = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            q_op = q_smem

        qpos = context + my_tok0 + gl.arange(0, BLOCK_M, layout=row_layout) // GROUP  # each row's position
        diagonal = context + my_tok0  # a tile reaching past this position needs the causal mask
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # S's registers; use_acc=False ignores them
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_layout)  # finite: a fully masked row gets p = 0
        l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

        # tile 0: S and its softmax
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(0), count=1)
        base, kend, masked = _tile_keys(0, n_pre, context, seq_len, diagonal, BLOCK_N)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, base, kend, qpos, scale_log2, masked, BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

        # step t: S(t) and P(t-1) V(t-1) in flight; the softmax of t overlaps P(t-1) V(t-1)
        for t in range(1, n_tiles):
            st = t % STAGES
            sp = (t - 1) % STAGES
            mbarrier.wait(k_ready.index(st), (t // STAGES) & 1)
            mbarrier.wait(v_ready.index(sp), ((t - 1) // STAGES) & 1)
            s_tok = warpgroup_mma(q_op, k_smem.index(st).permute((1, 0)), s, use_acc=False, is_async=True)
            if base + BLOCK_N > kend:  # tile t-1's keys run past their end
                _zero_v_past(WG, v_smem.index(sp), zeroed, base, kend, context, BLOCK_N, io_layout)
            o_tok = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(st), count=1)
            base, kend, masked = _tile_keys(t, n_pre, context, seq_len, diagonal, BLOCK_N)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, base, kend, qpos, scale_log2, masked, BLOCK_N, s_layout)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
            mbarrier.arrive(v_empty.index(sp), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)

        sp = (n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(sp), ((n_tiles - 1) // STAGES) & 1)
        if base + BLOCK_N > kend:
            _zero_v_past(WG, v_smem.index(sp), zeroed, base, kend, context, BLOCK_N, io_layout)
        o_tok = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = gl.convert_layout((acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]).to(dtype), io_layout)
        gl.store(out_ptr + (row_t * stride_ot + heads * stride_oh)[:, None] + d[None, :], out, mask=row_ok[:, None])

    @gluon.jit
    def _prefill_kernel(
        q_ptr, out_ptr, k_desc, v_desc, kc_desc, vc_desc, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):
        BLOCK_Q: gl.constexpr = BLOCK_M // GROUP  # tokens per consumer; a program takes 2 * BLOCK_Q
        dtype: gl.constexpr = k_desc.dtype
        tile = gl.num_programs(0) - 1 - gl.program_id(0)  # longest-running tiles first
        b = gl.program_id(1)
        kv_head = gl.program_id(2)
        q_start = gl.load(query_start_loc_ptr + b)
        q_len = gl.load(query_start_loc_ptr + b + 1) - q_start
        tok0 = tile * (2 * BLOCK_Q)
        if tok0 >= q_len:
            return
        seq_len = gl.load(seq_lens_ptr + b)
        context = seq_len - q_len
        n_pre = gl.cdiv(context, BLOCK_N)
        # Both consumers walk all of the program's tiles (they share the ring and the zeroing barriers);
        # a last tile past consumer 0's rows is fully masked for it, so adds nothing.
        n_tiles = n_pre + gl.cdiv(gl.minimum(tok0 + 2 * BLOCK_Q, q_len), BLOCK_N)

        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], k_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        zeroed = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)  # the producer's expect; the TMA bytes complete it
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one arrive per consumer
            mbarrier.init(v_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(zeroed.index(i), count=1)
        fence_async_shared()

        bars = (k_ready, v_ready, k_empty, v_empty, zeroed)
        bt_row = block_tables_ptr + b.to(gl.int64) * stride_bt
        Q_IN_REGS: gl.constexpr = BLOCK_N == 64
        gl.warp_specialize([
            (_consumer, (0, q_ptr, out_ptr, q_smem.index(0), k_smem, v_smem, bars, scale_log2, stride_qt,
                         stride_qh, stride_ot, stride_oh, q_start, q_len, tok0, context, seq_len, n_pre, n_tiles,
                         kv_head, GROUP, BLOCK_M, BLOCK_N, STAGES, Q_IN_REGS)),
            (_consumer, (1, q_ptr, out_ptr, q_smem.index(1), k_smem, v_smem, bars, scale_log2, stride_qt,
                         stride_qh, stride_ot, stride_oh, q_start, q_len, tok0, context, seq_len, n_pre, n_tiles,
                         kv_head, GROUP, BLOCK_M, BLOCK_N, STAGES, Q_IN_REGS)),
            (_producer, ((k_desc, v_desc, kc_desc, vc_desc), k_smem, v_smem, bars, bt_row, n_pre, n_tiles,
                         context, q_start, kv_head * HEAD_DIM, BLOCK_N, PAGE, HEAD_DIM, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


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
    if key_cache.dtype != query.dtype:  # (FP8 KV caches: the Triton kernel reads them)
        return f"a {key_cache.dtype} KV cache (it reads caches of the activations' dtype only)"
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


def key_tile(max_query_len: int) -> int:
    """Keys per tile for a step: 128 when its longest query reaches LONG_QUERY, else 64."""
    return 128 if max_query_len >= LONG_QUERY else 64


def prefill_attention_hopper(query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                             max_query_len: int, scale: float) -> torch.Tensor:
    """prefill_attention on an H100-class GPU; the caller checks `unsupported` first."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, page, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or seq_lens.shape[0] == 0 or max_query_len <= 0:
        return out
    block_n = key_tile(max_query_len)
    layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], getattr(gl, _GL_DTYPES[query.dtype]))
    width = num_kv_heads * head_dim
    tile, box = [block_n, head_dim], [min(page, block_n), head_dim]
    k_desc = TensorDescriptor(key, [num_tokens, width], [key.stride(0), 1], tile, layout)
    v_desc = TensorDescriptor(value, [num_tokens, width], [value.stride(0), 1], tile, layout)
    kc_desc = TensorDescriptor(key_cache, [num_blocks * page, width], [width, 1], box, layout)
    vc_desc = TensorDescriptor(value_cache, [num_blocks * page, width], [width, 1], box, layout)
    grid = (triton.cdiv(max_query_len, 2 * (BLOCK_M // group)), seq_lens.shape[0], num_kv_heads)
    _prefill_kernel[grid](
        query, out, k_desc, v_desc, kc_desc, vc_desc, block_tables, seq_lens, query_start_loc, scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=STAGES,
        num_warps=4, maxnreg=MAXNREG)
    return out
