"""A small model's decode forward in one persistent kernel: the draft model's rounds of speculative decoding.

A one-token decode round of a small model (Qwen3-0.6B drafting for an 8B) is ~150 launches of a few
microseconds' work each, and launch gaps, not bytes, set its time. Here one launch runs every layer: its
programs (one per SM, a cooperative launch so all are resident) step through the phases of each layer
and meet at a grid barrier (a global counter) between phases:

  QKV      rms_norm(h) @ W_qkv^T (+ bias) -> qkv        (the first layer's h: the embedding row)
  ATTN     per (row, KV head, split): q/k norm and rotary of the new token, its k/v into the cache, an
           online softmax over the split's cached keys (the last split also over the new token); the last
           split of a (row, KV head) to finish merges the splits -> attn
  O        h += attn @ W_o^T
  GATE_UP  rms_norm(h) @ W_gate_up^T -> act = silu(gate) * up
  DOWN     h += act @ W_down^T
and after the last layer FINAL: out = rms_norm(h). It takes one row (a batch-1 step's rounds; larger
batches run the forward, where a tl.dot version of this kernel lost: docs/speculative_decoding.md).
Programs stride over the attention splits. Each program owns a contiguous share of every projection's
output columns and loads the whole share, in registers, right after it arrives at the barrier before the
phase (with its attention item's cached keys, which no phase writes), so the share streams in while the
slowest programs finish: loading before arriving held every arrival back by the stream's time. W is read
as [K / 8, columns, 8] (the vectors of K outermost): a warp's threads lie across the columns, the products
sum within threads, and x is loaded in W's layout, so no shuffles move it.

Each value is rounded where the model's own kernels round it (skinny_linear.py's prologues, rotary.py's
norm, the fused add-norm), so the result is theirs up to the order of sums.

Weights are stacked per layer ([L, N, K]); DraftDecoder makes the model's parameters views of the stacks,
so they cost no memory twice. The KV cache is the CacheEngine's one tensor [L, 2, blocks, block, Hkv, D].
The row is one new token at positions[0] (seq_lens[0] counts it); a slot < 0 writes nothing.

Under the Triton interpreter (CPU tests) programs run one after another and cannot wait for each other, so
one program runs there (SYNC=False): every phase's work in order, the same code between the barriers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastllm.kernels import sm_count
from fastllm.kernels.rotary import head_rms_norm, rotated_halves

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _arrive(counter_ptr):
    """This program is done with the phase: its stores are visible to whoever sees the count (release)."""
    tl.debug_barrier()  # every thread's stores before the arrival
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(counter_ptr, target):
    """Until every program has arrived (the count reaches target); then their stores are visible here."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _key_tile(k_cache, v_cache, table_ptr, stride_table, block_size, row, kvh, t0, hi, off_a, off_b,
              HKV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Cached keys t0 .. t0 + BLOCK_T (below hi) of a (row, KV head): their k halves and v, in fp32."""
    t = t0 + tl.arange(0, BLOCK_T)
    t_ok = t < hi
    block = tl.load(table_ptr + row * stride_table + t // block_size, mask=t_ok, other=0)
    slot = (block.to(tl.int64) * block_size + t % block_size) * (HKV * D) + kvh * D
    ka = tl.load(k_cache + slot[:, None] + off_a, mask=t_ok[:, None], other=0.0).to(tl.float32)
    kb = tl.load(k_cache + slot[:, None] + off_b, mask=t_ok[:, None], other=0.0).to(tl.float32)
    d = tl.arange(0, D)
    v = tl.load(v_cache + slot[:, None] + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    return ka, kb, v


@triton.jit
def _item_keys(item, num_rows, pos_ptr, seq_len_ptr, table_ptr, stride_table, cos_sin, stride_cs, k_cache,
               v_cache, block_size, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
               BLOCK_T: tl.constexpr, IS_NEOX: tl.constexpr):
    """What an attention item (row, KV head, split) reads that no phase of this launch writes: its position,
    cached keys, their range lo .. hi in this split, the rotary cos/sin and the first tile of keys. Loaded for
    a program's first item before the barrier that ends QKV."""
    HALF: tl.constexpr = D // 2
    row = item // (HKV * SPLITS)
    kvh = (item // SPLITS) % HKV
    split = item % SPLITS
    row_ok = row < num_rows  # (a program with no item: nothing to load)
    pos = tl.load(pos_ptr + row, mask=row_ok, other=0).to(tl.int64)
    # keys in the cache; the new token is the last
    cached = tl.load(seq_len_ptr + row, mask=row_ok, other=1) - 1
    i = tl.arange(0, HALF)
    cos = tl.load(cos_sin + pos * stride_cs + i).to(tl.float32)
    sin = tl.load(cos_sin + pos * stride_cs + HALF + i).to(tl.float32)
    per_split = tl.cdiv(tl.cdiv(cached, SPLITS), BLOCK_T) * BLOCK_T
    lo = split * per_split
    hi = tl.minimum(cached, lo + per_split)
    off_a, off_b = _pair_offsets(HALF, IS_NEOX)
    ka, kb, v = _key_tile(k_cache, v_cache, table_ptr, stride_table, block_size, row, kvh, lo, hi, off_a,
                          off_b, HKV, D, BLOCK_T)
    return pos, cached, lo, hi, cos, sin, ka, kb, v


@triton.jit
def _pair_offsets(HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """A head's rotary pair halves as offsets [1, HALF] (rotary.py's layouts)."""
    i = tl.arange(0, HALF)
    if IS_NEOX:
        off_a, off_b = i, i + HALF
    else:
        off_a, off_b = 2 * i, 2 * i + 1
    return off_a[None, :], off_b[None, :]


@triton.jit
def _attention(qkv, pos_ptr, slot_ptr, table_ptr, stride_table, seq_len_ptr, num_rows, q_norm, k_norm, eps,
               cos_sin, stride_cs, k_cache, v_cache, block_size, part, ml, counters, attn, scale, pid, nprog,
               pre_pos, pre_cached, pre_lo, pre_hi, pre_cos, pre_sin, pre_ka, pre_kb, pre_v,
               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, IS_NEOX: tl.constexpr,
               HAS_QK_NORM: tl.constexpr):
    """The ATTN phase: work items (row, KV head, split); the first one's keys already loaded (pre_*,
    _item_keys)."""
    G: tl.constexpr = HQ // HKV
    HALF: tl.constexpr = D // 2
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    dtype = qkv.dtype.element_ty
    i = tl.arange(0, HALF)
    i_ok = i < HALF
    d = tl.arange(0, D)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    for item in range(pid, num_rows * HKV * SPLITS, nprog):
        row = item // (HKV * SPLITS)
        kvh = (item // SPLITS) % HKV
        split = item % SPLITS
        if item == pid:
            pos, cached, lo, hi = pre_pos, pre_cached, pre_lo, pre_hi
            cos, sin, ka0, kb0, v0 = pre_cos, pre_sin, pre_ka, pre_kb, pre_v
        else:
            pos, cached, lo, hi, cos, sin, ka0, kb0, v0 = _item_keys(
                item, num_rows, pos_ptr, seq_len_ptr, table_ptr, stride_table, cos_sin, stride_cs, k_cache,
                v_cache, block_size, HKV, D, SPLITS, BLOCK_T, IS_NEOX)
        src = qkv + row * NQKV
        qa, qb, _heads, off_a, off_b, _mask = rotated_halves(
            src + kvh * G * D, D, G, cos, sin, i, i_ok, q_norm, eps, HALF, BLOCK_G, IS_NEOX, HAS_QK_NORM)
        qa, qb = qa.to(dtype).to(tl.float32), qb.to(dtype).to(tl.float32)  # [BLOCK_G, HALF]
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        qk_scale = scale * _LOG2E
        for t0 in range(lo, hi, BLOCK_T):
            t_ok = t0 + tl.arange(0, BLOCK_T) < hi
            if t0 == lo:
                ka, kb, v = ka0, kb0, v0
            else:
                ka, kb, v = _key_tile(k_cache, v_cache, table_ptr, stride_table, block_size, row, kvh, t0, hi,
                                      off_a, off_b, HKV, D, BLOCK_T)
            s = tl.sum(qa[:, None, :] * ka[None, :, :], axis=2)
            s += tl.sum(qb[:, None, :] * kb[None, :, :], axis=2)
            s = tl.where(t_ok[None, :], s * qk_scale, float("-inf"))  # [BLOCK_G, BLOCK_T], base 2
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        if split == SPLITS - 1:  # the new token: rotated (and normed) here, written for later rounds
            new_ka, new_kb, _head, _off_a, _off_b, _new_mask = rotated_halves(
                src + (HQ + kvh) * D, D, 1, cos, sin, i, i_ok, k_norm, eps, HALF, 1, IS_NEOX, HAS_QK_NORM)
            new_ka, new_kb = new_ka.to(dtype), new_kb.to(dtype)  # [1, HALF]
            new_v = tl.load(src + (HQ + HKV + kvh) * D + d[None, :])  # [1, D]
            s_new = tl.sum(qa * new_ka.to(tl.float32), axis=1) + tl.sum(qb * new_kb.to(tl.float32), axis=1)
            s_new = s_new * qk_scale
            m_last = tl.maximum(m, s_new)
            p_new = tl.exp2(s_new - m_last)
            alpha_last = tl.exp2(m - m_last)
            l = l * alpha_last + p_new
            acc = acc * alpha_last[:, None] + p_new[:, None] * new_v.to(tl.float32)
            m = m_last
            new_slot = tl.load(slot_ptr + row)
            if new_slot >= 0:
                dst = new_slot * (HKV * D) + kvh * D
                tl.store(k_cache + dst + off_a, new_ka.to(k_cache.dtype.element_ty))
                tl.store(k_cache + dst + off_b, new_kb.to(k_cache.dtype.element_ty))
                tl.store(v_cache + dst + d[None, :], new_v.to(v_cache.dtype.element_ty))
        # This split's state, then the last split of the (row, KV head) to count itself done merges.
        heads = row * HQ + kvh * G + g  # [BLOCK_G]
        tl.store(part + (heads[:, None] * SPLITS + split) * D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(ml + (heads * SPLITS + split) * 2, m, mask=g_ok)
        tl.store(ml + (heads * SPLITS + split) * 2 + 1, l, mask=g_ok)
        tl.debug_barrier()  # every thread's partial stores before the count's release
        counter = counters + row * HKV + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            tl.store(counter, 0)
            s_idx = tl.arange(0, SPLITS)
            states = ml + (heads[:, None] * SPLITS + s_idx[None, :]) * 2  # [BLOCK_G, SPLITS]
            m_s = tl.load(states, mask=g_ok[:, None], other=0.0, cache_modifier=".cg")
            l_s = tl.load(states + 1, mask=g_ok[:, None], other=0.0, cache_modifier=".cg")
            m_all = tl.max(m_s, axis=1)
            w_s = tl.exp2(m_s - m_all[:, None])  # empty splits (m = -inf) weigh 0
            states = heads[:, None, None] * SPLITS + s_idx[None, :, None]
            parts = tl.load(part + states * D + d[None, None, :], mask=g_ok[:, None, None], other=0.0,
                            cache_modifier=".cg")
            o = tl.sum(w_s[:, :, None] * parts, axis=1) / tl.sum(w_s * l_s, axis=1)[:, None]
            tl.store(attn + heads[:, None] * D + d[None, :], o.to(dtype), mask=g_ok[:, None])


@triton.jit
def _final_norm(h, final_norm, out, eps, pid, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """out = rms_norm(h) with the final norm's weight (program 0), rounded where the norm kernel rounds."""
    if pid == 0:
        hs = tl.arange(0, BLOCK_H)
        h_ok = hs < H
        x = tl.load(h + hs, mask=h_ok, other=0.0, cache_modifier=".cg")
        xf = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
        w = tl.load(final_norm + hs, mask=h_ok, other=0.0)
        tl.store(out + hs, head_rms_norm(xf, w, inv_rms, x.dtype).to(x.dtype), mask=h_ok)


@triton.jit
def _arrive_phase(counter, epoch, nprog, trace, t_layer, SYNC: tl.constexpr, TRACE: tl.constexpr):
    """The first half of the grid barrier that ends a phase (none in the interpreter, whose one program runs
    the phases in order): this program is done (its stores released to the others). What it issues before
    _await_phase (the next phase's weights) streams in while the others finish. TRACE: this program's ns
    since its layer began, at its arrival and when it passes, into trace[layer, phase, program, 0/1] (the
    epoch counts the phases)."""
    if TRACE:
        tl.store(trace + ((epoch - 1) * nprog + tl.program_id(0)) * 2, _now() - t_layer)
    if SYNC:
        _arrive(counter)


@triton.jit
def _await_phase(counter, epoch, nprog, trace, t_layer, SYNC: tl.constexpr, TRACE: tl.constexpr):
    """The second half: until every program has arrived. Returns the next epoch."""
    if SYNC:
        _wait(counter, epoch * nprog)
    if TRACE:
        tl.store(trace + ((epoch - 1) * nprog + tl.program_id(0)) * 2 + 1, _now() - t_layer)
    return epoch + 1


@triton.jit
def _share_cols(n_out, pid, nprog, start, BN: tl.constexpr):
    """Columns start .. start + BN of this program's share of n_out (its contiguous 1 / nprog of them), and
    which of them are in the share."""
    lo = pid * n_out // nprog
    hi = (pid + 1) * n_out // nprog
    cols = lo + start + tl.arange(0, BN)
    return cols, cols < hi


_VEC = tl.constexpr(8)  # elements a load of a thread (16 bytes of bf16)


@triton.jit
def _k3(BK: tl.constexpr):
    """K as [BK / VEC, 1, VEC] offsets: the vectors of K outermost, so that a W piece [BK / VEC, BN, VEC]
    puts a warp's threads across its columns and its products sum within threads, not across them."""
    return tl.arange(0, BK // _VEC)[:, None, None] * _VEC + tl.arange(0, _VEC)[None, None, :]


@triton.jit
def _share_piece(w, n_out, k_in, pid, nprog, start, BN: tl.constexpr, BK: tl.constexpr):
    cols, col_ok = _share_cols(n_out, pid, nprog, start, BN)
    ks = _k3(BK)
    return tl.load(w + cols.to(tl.int64)[None, :, None] * k_in + ks,
                   mask=col_ok[None, :, None] & (ks < k_in), other=0.0, eviction_policy="evict_first")


@triton.jit
def _inv_rms3(x_ptr, k_in, eps, BK: tl.constexpr):
    """1 / rms of one row's k_in columns."""
    ks = _k3(BK)
    x = tl.load(x_ptr + ks, mask=ks < k_in, other=0.0, cache_modifier=".cg").to(tl.float32)
    return tl.rsqrt(tl.sum(tl.sum(tl.sum(x * x, axis=2), axis=1), axis=0) / k_in + eps)


@triton.jit
def _input_for(x_ptr, k_in, norm_w, inv_rms, NORM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One row's k_in columns as [BK / VEC, BN, VEC], the same along BN: loaded in the layout of a W piece's
    (a warp's threads across BN read the same address: one transaction), so the product needs no shuffles
    to bring x to W. x, or its rms_norm (weight norm_w, inv_rms) rounded where the norm kernel rounds."""
    ks = _k3(BK)
    k_ok = ks < k_in
    shape: tl.constexpr = [BK // _VEC, BN, _VEC]
    x = tl.load(tl.broadcast_to(x_ptr + ks, shape), mask=k_ok, other=0.0, cache_modifier=".cg")
    if NORM:
        w = tl.load(tl.broadcast_to(norm_w + ks, shape), mask=k_ok, other=0.0)
        x = head_rms_norm(x.to(tl.float32), w, inv_rms, x.dtype).to(x.dtype)
    return x


@triton.jit
def _dot3(x, w):
    """x . w over K (both [K / VEC, BN, VEC], x from _input_for) in fp32: [BN]."""
    return tl.sum(tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=2), axis=0)


@triton.jit
def _share(w, n_out, k_in, pid, nprog, BN_A: tl.constexpr, BN_B: tl.constexpr, BK: tl.constexpr):
    """This program's rows of W [n_out, k_in] (its columns of the output), whole K, in two pieces of BN_A and
    BN_B (a share need not be a power of two), as [K / VEC, columns, VEC] (_k3)."""
    return (_share_piece(w, n_out, k_in, pid, nprog, 0, BN_A, BK),
            _share_piece(w, n_out, k_in, pid, nprog, BN_A, BN_B, BK))


@triton.jit
def _share_out(x, w, bias, out, n_out, pid, nprog, start, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
               BN: tl.constexpr):
    """out[piece's columns] = x @ w^T (+ bias), or += it (RESIDUAL, rounded as the residual add); x from
    _input_for."""
    dtype = out.dtype.element_ty
    cols, col_ok = _share_cols(n_out, pid, nprog, start, BN)
    dst = out + cols
    if RESIDUAL:
        residual = tl.load(dst, mask=col_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = _dot3(x, w)
    if HAS_BIAS:
        y += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        y = y.to(dtype).to(tl.float32) + residual
    tl.store(dst, y.to(dtype), mask=col_ok)


@triton.jit
def _residual_share(x_ptr, k_in, w_a, w_b, h, n_out, pid, nprog, BN_A: tl.constexpr, BN_B: tl.constexpr,
                    BK: tl.constexpr):
    """h[share] += x @ W[share]^T over both pieces of the share (O and down), x the row at x_ptr."""
    _share_out(_input_for(x_ptr, k_in, x_ptr, 1.0, False, BN_A, BK), w_a, h, h, n_out, pid, nprog, 0, False,
               True, BN_A)
    _share_out(_input_for(x_ptr, k_in, x_ptr, 1.0, False, BN_B, BK), w_b, h, h, n_out, pid, nprog, BN_A, False,
               True, BN_B)


@triton.jit
def _share_gated_out(x, gate_w, up_w, out, n_out, pid, nprog, start, BN: tl.constexpr):
    """out[piece's columns] = silu(x @ gate_w^T) * (x @ up_w^T), rounded where the projection and the
    SiLU kernel round."""
    dtype = out.dtype.element_ty
    cols, col_ok = _share_cols(n_out, pid, nprog, start, BN)
    gate = _dot3(x, gate_w).to(dtype).to(tl.float32)
    up = _dot3(x, up_w).to(dtype).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(out + cols, y.to(dtype), mask=col_ok)


@triton.jit
def _decoder_kernel(
    ids_ptr, pos_ptr, slot_ptr, table_ptr, stride_table, seq_len_ptr, num_rows,  # the row
    embed, norm1, w_qkv, b_qkv, q_norm, k_norm, w_o, norm2, w_gate_up, w_down, final_norm,  # weights
    cos_sin, stride_cs, kv_cache, stride_kv_layer, stride_kv_kv, block_size,
    h, qkv, part, ml, attn, act, out, counters, barrier, trace,  # scratch, output and the optional trace
    num_layers, eps, scale,
    H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
    BLOCK_H: tl.constexpr, BK_QD: tl.constexpr, BK_I: tl.constexpr,
    BN_QKV: tl.constexpr, BN_QKV_B: tl.constexpr, BN_O: tl.constexpr, BN_O_B: tl.constexpr,
    BN_GATE_UP: tl.constexpr, BN_GATE_UP_B: tl.constexpr, BN_DOWN: tl.constexpr, BN_DOWN_B: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_BIAS: tl.constexpr, IS_NEOX: tl.constexpr, HAS_QK_NORM: tl.constexpr,
    SYNC: tl.constexpr, TRACE: tl.constexpr,
):
    """Each program computes its contiguous share of every projection's columns, the share loaded whole after
    it arrives at the barrier before the phase (_share); gate/up's, the largest, at the barrier that ends
    attention (whose slowest programs merge splits while the others' loads stream)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    QD: tl.constexpr = HQ * D
    epoch = 1
    t_layer = tl.full([], 0, tl.int64)
    qkv_a, qkv_b = _share(w_qkv, NQKV, H, pid, nprog, BN_QKV, BN_QKV_B, BLOCK_H)
    for layer in range(0, num_layers):
        l64 = tl.full([], layer, tl.int64)  # (a cache layer is past int32)
        gate_up = w_gate_up + l64 * 2 * INTER * H
        if TRACE:
            t_layer = _now()
        # QKV: rms_norm(h) @ W_qkv^T; the first layer's h is the embedding row (program 0 stores it in h)
        x = h
        if layer == 0:
            x = embed + tl.load(ids_ptr).to(tl.int64) * H
            if pid == 0:
                hs = tl.arange(0, BLOCK_H)
                tl.store(h + hs, tl.load(x + hs, mask=hs < H), mask=hs < H)
        inv_rms = _inv_rms3(x, H, eps, BLOCK_H)
        n1, b = norm1 + layer * H, b_qkv + layer * NQKV
        _share_out(_input_for(x, H, n1, inv_rms, True, BN_QKV, BLOCK_H), qkv_a, b, qkv, NQKV, pid, nprog, 0,
                   HAS_BIAS, False, BN_QKV)
        _share_out(_input_for(x, H, n1, inv_rms, True, BN_QKV_B, BLOCK_H), qkv_b, b, qkv, NQKV, pid, nprog,
                   BN_QKV, HAS_BIAS, False, BN_QKV_B)
        _arrive_phase(barrier, epoch, nprog, trace, t_layer, SYNC, TRACE)
        o_a, o_b = _share(w_o + l64 * H * QD, H, QD, pid, nprog, BN_O, BN_O_B, BK_QD)
        kv = kv_cache + l64 * stride_kv_layer
        pos, cached, lo, hi, cos, sin, ka, kb, v = _item_keys(
            pid, num_rows, pos_ptr, seq_len_ptr, table_ptr, stride_table, cos_sin, stride_cs, kv,
            kv + stride_kv_kv, block_size, HKV, D, SPLITS, BLOCK_T, IS_NEOX)
        epoch = _await_phase(barrier, epoch, nprog, trace, t_layer, SYNC, TRACE)
        # ATTN
        _attention(qkv, pos_ptr, slot_ptr, table_ptr, stride_table, seq_len_ptr, num_rows, q_norm + layer * D,
                   k_norm + layer * D, eps, cos_sin, stride_cs, kv, kv + stride_kv_kv, block_size, part, ml,
                   counters, attn, scale, pid, nprog, pos, cached, lo, hi, cos, sin, ka, kb, v, HQ, HKV, D,
                   SPLITS, BLOCK_G, BLOCK_T, IS_NEOX, HAS_QK_NORM)
        _arrive_phase(barrier, epoch, nprog, trace, t_layer, SYNC, TRACE)
        gate_a, gate_b = _share(gate_up, INTER, H, pid, nprog, BN_GATE_UP, BN_GATE_UP_B, BLOCK_H)
        up_a, up_b = _share(gate_up + INTER * H, INTER, H, pid, nprog, BN_GATE_UP, BN_GATE_UP_B, BLOCK_H)
        epoch = _await_phase(barrier, epoch, nprog, trace, t_layer, SYNC, TRACE)
        # O: h += attn @ W_o^T
        _residual_share(attn, QD, o_a, o_b, h, H, pid, nprog, BN_O, BN_O_B, BK_QD)
        _arrive_phase(barrier, epoch, nprog, trace, t_layer, SYNC, TRACE)
        epoch = _await_phase(barrier, epoch, nprog, trace, t_layer, SYNC, TRACE)
        # GATE_UP: act = silu(gate) * up of rms_norm(h)
        inv_rms = _inv_rms3(h, H, eps, BLOCK_H)
        n2 = norm2 + layer * H
        x = _input_for(h, H, n2, inv_rms, True, BN_GATE_UP, BLOCK_H)
        _share_gated_out(x, gate_a, up_a, act, INTER, pid, nprog, 0, BN_GATE_UP)
        x = _input_for(h, H, n2, inv_rms, True, BN_GATE_UP_B, BLOCK_H)
        _share_gated_out(x, gate_b, up_b, act, INTER, pid, nprog, BN_GATE_UP, BN_GATE_UP_B)
        _arrive_phase(barrier, epoch, nprog, trace, t_layer, SYNC, TRACE)
        down_a, down_b = _share(w_down + l64 * H * INTER, H, INTER, pid, nprog, BN_DOWN, BN_DOWN_B, BK_I)
        epoch = _await_phase(barrier, epoch, nprog, trace, t_layer, SYNC, TRACE)
        # DOWN: h += act @ W_down^T
        _residual_share(act, INTER, down_a, down_b, h, H, pid, nprog, BN_DOWN, BN_DOWN_B, BK_I)
        _arrive_phase(barrier, epoch, nprog, trace, t_layer, SYNC, TRACE)
        next_qkv = w_qkv + tl.minimum(l64 + 1, num_layers - 1) * NQKV * H
        qkv_a, qkv_b = _share(next_qkv, NQKV, H, pid, nprog, BN_QKV, BN_QKV_B, BLOCK_H)
        epoch = _await_phase(barrier, epoch, nprog, trace, t_layer, SYNC, TRACE)
    _final_norm(h, final_norm, out, eps, pid, H, BLOCK_H)


class Weights(NamedTuple):
    """A decoder's weights stacked per layer (L layers); None where the model has none."""
    embed: torch.Tensor  # [V, H]
    norm1: torch.Tensor  # [L, H]: input_layernorm
    w_qkv: torch.Tensor  # [L, (Hq + 2 Hkv) D, H]
    b_qkv: torch.Tensor | None  # [L, (Hq + 2 Hkv) D]
    q_norm: torch.Tensor | None  # [L, D] (Qwen3)
    k_norm: torch.Tensor | None  # [L, D]
    w_o: torch.Tensor  # [L, H, Hq D]
    norm2: torch.Tensor  # [L, H]: post_attention_layernorm
    w_gate_up: torch.Tensor  # [L, 2 I, H]: [gate | up]
    w_down: torch.Tensor  # [L, H, I]
    final_norm: torch.Tensor  # [H]


class Shape(NamedTuple):
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


MAX_SPLITS = 32
_BLOCK_T = 16  # keys a step of a split's loop
_NUM_WARPS = 8
# Weights a program of the one-row kernel holds in registers at once (held_share_bytes): Qwen3-0.6B's on 132
# SMs, 36 + 96 KiB, compile without spills (test_persistent_decoder.py); larger shares would spill.
MAX_SHARE_BYTES = 132 << 10


def num_splits(rows: int, num_kv_heads: int, programs: int) -> int:
    """Attention splits a (row, KV head): about one work item a program."""
    per = max(1, programs // (rows * num_kv_heads))
    return min(MAX_SPLITS, 1 << (per.bit_length() - 1))


def grid(device: torch.device) -> int:
    """Programs a launch: one a SM on a GPU; one in the interpreter, which runs programs one after another (so
    one program runs the phases in order, with no barriers)."""
    return sm_count.num_sms(device) if device.type == "cuda" else 1


# The interpreter's attention splits are counted as if for this many programs: several splits a KV head,
# so the tests cover the merge.
INTERPRETER_SPLIT_PROGRAMS = 32


class Scratch:
    """The kernel's working buffers for its row, and its counters (zero between launches)."""

    def __init__(self, shape: Shape, dtype: torch.dtype, device: torch.device):
        s = shape
        programs = grid(device) if device.type == "cuda" else INTERPRETER_SPLIT_PROGRAMS
        splits = num_splits(1, s.num_kv_heads, programs)
        self.h = torch.zeros(1, s.hidden, dtype=dtype, device=device)
        nqkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        self.qkv = torch.zeros(1, nqkv, dtype=dtype, device=device)
        self.part = torch.zeros(s.num_heads * splits * s.head_dim, dtype=torch.float32, device=device)
        self.ml = torch.zeros(s.num_heads * splits * 2, dtype=torch.float32, device=device)
        self.attn = torch.zeros(1, s.num_heads * s.head_dim, dtype=dtype, device=device)
        self.act = torch.zeros(1, s.intermediate, dtype=dtype, device=device)
        self.counters = torch.zeros(s.num_kv_heads, dtype=torch.int32, device=device)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=device)


def share_pieces(n_out: int, programs: int) -> tuple[int, int]:
    """A program's share of n_out columns (at most cdiv(n_out, programs)) as two power-of-two pieces: the
    largest that fits, and what is left rounded up (1 when nothing is: a piece whose columns are all out)."""
    need = triton.cdiv(n_out, programs)
    first = 1 << (need.bit_length() - 1)
    rest = need - first
    return first, triton.next_power_of_2(rest) if rest else 1


def held_share_bytes(shape: Shape, programs: int, itemsize: int) -> int:
    """The most bytes of weights a program of the one-row kernel holds in registers at once: a share's
    pieces with K rounded up to a power of two, O's beside gate/up's (which load as attention ends)."""
    s = shape
    qd, nqkv = s.num_heads * s.head_dim, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim

    def share(n_out: int, k_in: int) -> int:
        return sum(share_pieces(n_out, programs)) * triton.next_power_of_2(k_in) * itemsize

    return max(share(nqkv, s.hidden), share(s.hidden, qd) + 2 * share(s.intermediate, s.hidden),
               share(s.hidden, s.intermediate))


def constexprs(shape: Shape, programs: int, splits: int, has_bias: bool, is_neox: bool, has_qk_norm: bool,
               sync: bool, trace: bool) -> dict:
    """The kernel's launch constexprs (and warps) on `programs` programs."""
    s = shape
    qd, nqkv = s.num_heads * s.head_dim, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    pieces = {}
    for name, n_out in (("QKV", nqkv), ("O", s.hidden), ("GATE_UP", s.intermediate), ("DOWN", s.hidden)):
        pieces[f"BN_{name}"], pieces[f"BN_{name}_B"] = share_pieces(n_out, programs)
    return dict(
        H=s.hidden, HQ=s.num_heads, HKV=s.num_kv_heads, D=s.head_dim, INTER=s.intermediate,
        BLOCK_H=triton.next_power_of_2(s.hidden), BK_QD=triton.next_power_of_2(qd),
        BK_I=triton.next_power_of_2(s.intermediate), **pieces,
        SPLITS=splits, BLOCK_G=triton.next_power_of_2(s.num_heads // s.num_kv_heads), BLOCK_T=_BLOCK_T,
        HAS_BIAS=has_bias, IS_NEOX=is_neox, HAS_QK_NORM=has_qk_norm, SYNC=sync, TRACE=trace,
        num_warps=_NUM_WARPS)


def launch(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, weights: Weights, shape: Shape,
           kv_cache: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool, scale: float, scratch: Scratch,
           out: torch.Tensor, trace: torch.Tensor | None = None) -> torch.Tensor:
    """out [1, H] = the final norm of the decoder's output for one new token (input_ids [1] at positions [1];
    seq_lens [1] count the new token), writing its k/v at slot_mapping [1] (< 0: nothing) of kv_cache [L, 2,
    blocks, block_size, Hkv, D]. trace (GPU): int64 [L, 5, programs, 2] to receive each program's ns into
    its layer at each phase's end and barrier (phase_times)."""
    s, rows, w = shape, input_ids.shape[0], weights
    assert rows == 1 and out.shape == (1, s.hidden), (rows, out.shape)
    assert kv_cache.shape[0] == s.num_layers and kv_cache.shape[1] == 2 and kv_cache.is_contiguous()
    device = input_ids.device
    sync = device.type == "cuda"
    programs = grid(device)
    assert trace is None or (sync and trace.shape == (s.num_layers, len(PHASES), programs, 2)
                             and trace.dtype == torch.int64)
    splits = num_splits(1, s.num_kv_heads, programs if sync else INTERPRETER_SPLIT_PROGRAMS)
    scratch.barrier.zero_()
    unused = w.norm1  # (a placeholder pointer for the weights a model lacks)
    # One launch; on a GPU every program resident (cooperative), meeting at the barriers.
    _decoder_kernel[(programs,)](
        input_ids, positions, slot_mapping, block_tables, block_tables.stride(0), seq_lens, rows,
        w.embed, w.norm1, w.w_qkv, unused if w.b_qkv is None else w.b_qkv,
        unused if w.q_norm is None else w.q_norm, unused if w.k_norm is None else w.k_norm, w.w_o, w.norm2,
        w.w_gate_up, w.w_down, w.final_norm,
        cos_sin, cos_sin.stride(0), kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[3],
        scratch.h, scratch.qkv, scratch.part, scratch.ml, scratch.attn, scratch.act, out, scratch.counters,
        scratch.barrier, scratch.barrier if trace is None else trace, s.num_layers, s.eps, scale,
        launch_cooperative_grid=sync,
        **constexprs(s, programs, splits, w.b_qkv is not None, is_neox, w.q_norm is not None, sync,
                     trace is not None))
    return out


PHASES = ("qkv", "attention", "o", "gate_up", "down")


def phase_times(trace: torch.Tensor) -> dict[str, tuple[float, float, float]]:
    """A traced launch's microseconds a layer per phase (means over the layers): (the mean program's work,
    the slowest program's work, the phase with its barrier)."""
    t = trace.double() / 1e3  # [layer, phase, program, (work done, barrier passed)]
    passed = t[..., 1]
    began = torch.cat([torch.zeros_like(passed[:, :1]), passed[:, :-1]], dim=1)
    work = t[..., 0] - began
    whole = passed - began
    return {name: (work[:, i].mean().item(), work[:, i].max(-1).values.mean().item(),
                   whole[:, i].mean().item()) for i, name in enumerate(PHASES)}
