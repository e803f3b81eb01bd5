"""An FP8 KV cache (kv_cache_dtype="fp8"): every writer and reader kernel against its dequantizing reference.

Writers (kv_cache_write, rotary_kv_cache_write, rotary_decode_attention's append) must store the reference's
e4m3 bytes: x / scale (IEEE division), rounded to nearest even, saturated at +-448. Triton's interpreter
rounds float32 -> e4m3 wrongly where rounding carries into the next binade (31.9 -> 16 instead of 32) and
in the subnormals, so on the CPU an element may differ only those ways (below the reference's power of two,
or one subnormal step); on the GPU bytes are equal.
Readers (decode, prefill, cascade) load e4m3, fold k_scale into the softmax scale and v_scale into the
output: float32 queries within rel 1e-5 of the reference over the same cache (a NaN-poisoned PagedKV, so a
read outside a request's keys shows). A prefill chunk's rows come as rotary_kv_cache_write returns them, the
cache's e4m3 values in the activations' dtype. CPU scales are powers of two (0.5, 2); the GPU tests use
others.
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import reference as R
from fastllm.kernels import triton_impl
from fastllm.kernels.reference import FP8
from tests.kernels.kernel_testing import INTERPRET, PagedKV, assert_close, gpu
from tests.kernels.test_rotary import NORM_EPS, _cos_sin_cache, qk_norm_weights

SCALES = (0.5, 2.0)  # k_scale, v_scale (powers of two: exact on the interpreter)
GPU_SCALES = (0.37, 1.9)
# (the caches hold values up to ~40 times randn, times v_scale 2: outputs reach a few hundred. A float32 sum
# of 100 such values in another order than the reference's parts by up to ~100 x 2^-24 x 400 = 2.4e-3, and
# the interpreter (numpy's exp and matmul) met 2.07e-3 on [33, 100]; so 4e-3, still a millionth of the
# values: a wrong e4m3 step or scale would be off by tens)
TOL = {torch.float32: (1e-5, 4e-3), torch.bfloat16: (1e-2, 2.0)}


def assert_e4m3_equal(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == ref.dtype == FP8
    bad = out.view(torch.uint8) != ref.view(torch.uint8)
    if INTERPRET and bad.any():  # the interpreter's misroundings only (see the docstring)
        o, r = out.float()[bad], ref.float()[bad]
        carry = (torch.log2(r.abs()) % 1 == 0) & (o.abs() < r.abs()) & (o * r >= 0)  # below a power of two
        subnormal = (r.abs() < 2.0 ** -6) & ((o - r).abs() <= 2.0 ** -9)  # one step of e4m3's subnormals
        assert (carry | subnormal).all(), f"{what}: {o} vs {r}"
    else:
        assert not bad.any(), f"{what}: {int(bad.sum())} e4m3 bytes differ"


def _fp8_kv(seq_lens, hkv, d, page, gen, device="cpu"):
    num_blocks = sum(-(-n // page) for n in seq_lens) + 6
    kv = PagedKV(seq_lens, num_blocks, page, hkv, d, torch.float32, device, gen)
    kv.key_cache = (kv.key_cache * 40).to(FP8)  # NaN poison stays NaN in e4m3fn
    kv.value_cache = (kv.value_cache * 40).to(FP8)
    return kv


def _cache_rows(kv, q_lens, dtype):
    """The chunks' K/V rows as rotary_kv_cache_write returns them: the cache's e4m3 values in dtype."""
    slots = kv.chunk_slots(q_lens)
    hkv, d = kv.key_cache.shape[2:]
    return tuple(cache.view(-1, hkv, d)[slots].to(dtype) for cache in (kv.key_cache, kv.value_cache))


# (tokens, Hkv, head_dim, block size)
WRITE_CASES = [(7, 2, 64, 16), (33, 4, 128, 32), (5, 1, 8, 8)]


@pytest.mark.parametrize("t,hkv,d,page", WRITE_CASES)
def test_kv_cache_write_stores_the_references_e4m3(device, t, hkv, d, page):
    """Exactly representable inputs (e4m3 values times the scales), some saturating, some padding slots."""
    num_blocks = -(-t // page) + 3
    key, value = [(torch.randn(t, hkv, d) * 100).clamp(-448, 448).to(FP8).float() * s for s in SCALES]
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 448 * SCALES[0] * 1.5])  # saturate at +-448
    slots = torch.randperm(num_blocks * page)[:t]
    slots[1] = -1
    out = [torch.zeros(num_blocks, page, hkv, d, dtype=FP8, device=device) for _ in range(4)]
    args = (key.to(device), value.to(device))
    triton_impl("kv_cache_write")(*args, out[0], out[1], slots.to(device), *SCALES)
    R.kv_cache_write(*args, out[2], out[3], slots.to(device), *SCALES)
    assert_e4m3_equal(out[0], out[2], "key_cache")
    assert_e4m3_equal(out[1], out[3], "value_cache")
    assert out[0].float().abs().max() == 448


@pytest.mark.parametrize("t,hkv,d,page", WRITE_CASES[:2])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_kv_cache_write_fp8(device, gen, t, hkv, d, page, qk_norm):
    hq = 2 * hkv
    num_blocks = -(-t // page) + 3
    query, key, value = (torch.randn(t, h, d, device=device) * 3 for h in (hq, hkv, hkv))
    positions = torch.randint(0, 100, (t,), device=device)
    slots = torch.randperm(num_blocks * page)[:t].to(device)
    slots[2] = -1
    cos_sin = _cos_sin_cache(128, d, device)
    norm = qk_norm_weights(d, torch.float32, device, gen) + (NORM_EPS,) if qk_norm else ()
    caches = [torch.zeros(num_blocks, page, hkv, d, dtype=FP8, device=device) for _ in range(4)]
    args = (positions, query, key, value, cos_sin, True)
    write = triton_impl("rotary_kv_cache_write")
    q_out, k_out, v_out = write(*args, *caches[:2], slots, True, *norm, **_kw())
    q_ref, k_ref, v_ref = R.rotary_kv_cache_write(*args, *caches[2:], slots, True, *norm, **_kw())
    assert_close(q_out, q_ref, 1e-5, 1e-4, "q_out")
    assert k_out.dtype == v_out.dtype == torch.float32
    # the cache holds e4m3 of the kernel's own rotated key (what a float32 cache receives): compare bytes
    # against quantizing it, and key_out / value_out (every token's, padding's too) against the same bytes
    _, k_rotated, _ = write(*args, *(torch.zeros(num_blocks, page, hkv, d, device=device) for _ in range(2)),
                            slots, True, *norm)
    ref_cache = caches[2].clone()
    R.kv_cache_write(k_rotated, value, ref_cache, caches[3].clone(), slots, *SCALES)
    assert_e4m3_equal(caches[0], ref_cache, "key_cache")
    assert_e4m3_equal(caches[1], caches[3], "value_cache")
    assert_e4m3_equal(k_out.to(FP8), R.kv_to_cache(k_rotated, FP8, SCALES[0]), "key_out")
    assert_e4m3_equal(v_out.to(FP8), v_ref.to(FP8), "value_out")
    valid = slots >= 0
    for out, cache in ((k_out, caches[0]), (v_out, caches[1])):  # the rows returned are the rows stored
        assert torch.equal(out[valid], cache.view(-1, hkv, d)[slots[valid]].float())


ONE_WARP = {"block_n": 32, "num_warps": 1, "min_split_len": 32}  # the one-warp programs, shorter splits


def _kw(scales=SCALES):
    return dict(k_scale=scales[0], v_scale=scales[1])


# (seq_lens, Hq, Hkv, head_dim, block size)
READ_CASES = [
    ([1, 17, 40], 8, 2, 64, 16),  # GQA 4, a block and one past it
    ([33, 100], 16, 2, 128, 32),  # GQA 8, head dim 128, partial last blocks
    ([7, 70], 4, 4, 64, 8),  # MHA, small blocks
]


@pytest.mark.parametrize("seq_lens,hq,hkv,d,page", READ_CASES)
@pytest.mark.parametrize("num_splits,window", [(1, None), (3, None), (2, 9)])
@pytest.mark.parametrize("tile", [{}, ONE_WARP])
def test_paged_decode_attention_fp8(device, gen, seq_lens, hq, hkv, d, page, num_splits, window, tile):
    """tile: the table's one-warp 32-key programs (an FP8 cache from 1.5 programs a SM), whose minimum split
    length sends short requests to fewer splits."""
    from fastllm.kernels.paged_decode_attention import paged_decode_attention_splits

    kv = _fp8_kv(seq_lens, hkv, d, page, gen, device)
    query = torch.randn(len(seq_lens), hq, d, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, max(seq_lens), d ** -0.5)
    out = paged_decode_attention_splits(*args, num_splits, window=window, **tile, **_kw())
    ref = R.paged_decode_attention(*args, window, **_kw())
    assert_close(out, ref, *TOL[torch.float32], f"decode {seq_lens} splits {num_splits} window {window}")


@pytest.mark.parametrize("seq_lens,hq,hkv,d,page", READ_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tile", [{}, ONE_WARP])
def test_paged_decode_attention_fp8_16bit_queries(device, gen, seq_lens, hq, hkv, d, page, dtype, tile):
    """16-bit queries: the e4m3 tiles and q convert to fp16 for the dots (bf16 q too, so the interpreter's
    wrong bf16 tl.dot is not met), within the 16-bit output's rounding of the reference. ONE_WARP: the
    table's one-warp programs, whose dots are swapped (K @ q^T, V^T @ p^T; GQA 4 and 8, MHA)."""
    from fastllm.kernels.paged_decode_attention import paged_decode_attention_splits

    kv = _fp8_kv(seq_lens, hkv, d, page, gen, device)
    query = torch.randn(len(seq_lens), hq, d, device=device).to(dtype)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, max(seq_lens), d ** -0.5)
    for num_splits in (1, 3):
        out = paged_decode_attention_splits(*args, num_splits, **tile, **_kw())
        assert out.dtype == dtype
        assert_close(out, R.paged_decode_attention(*args, **_kw()), *TOL[torch.bfloat16], f"{dtype} decode")


@pytest.mark.parametrize("seq_lens,hq,hkv,d,page", READ_CASES[:2])
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_decode_attention_fp8_one_warp(device, gen, seq_lens, hq, hkv, d, page, num_splits, qk_norm):
    """The engine's launch of the one-warp programs (dots swapped) under fp16 queries: the new token
    attended from registers starts the swapped accumulator; within the 16-bit output's rounding."""
    from fastllm.kernels.paged_decode_attention import NewTokens, paged_decode_attention_splits

    kv = _fp8_kv(seq_lens, hkv, d, page, gen, device)
    b, f16 = len(seq_lens), torch.float16
    query, key, value = (torch.randn(b, h, d, device=device).to(f16) for h in (hq, hkv, hkv))
    positions = kv.seq_lens.long() - 1
    slots = kv.chunk_slots([1] * b)
    cos_sin = _cos_sin_cache(max(seq_lens) + 1, d, device)
    norm = dict(zip(("q_norm_weight", "k_norm_weight"), qk_norm_weights(d, f16, device, gen)),
                norm_eps=NORM_EPS) if qk_norm else {}
    caches = (kv.key_cache.clone(), kv.value_cache.clone())
    out = paged_decode_attention_splits(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                        max(seq_lens), d ** -0.5, num_splits, **ONE_WARP,
                                        append=NewTokens(positions, key, value, cos_sin, True, slots, **norm),
                                        **_kw())
    ref = R.rotary_decode_attention(positions, query, key, value, cos_sin, True, *caches, slots,
                                    kv.block_tables, kv.seq_lens, max(seq_lens), d ** -0.5, **norm, **_kw())
    assert out.dtype == f16
    assert_close(out, ref, *TOL[torch.bfloat16], "one-warp rotary decode")


@pytest.mark.parametrize("seq_lens,hq,hkv,d,page", READ_CASES[:2])
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_decode_attention_fp8(device, gen, seq_lens, hq, hkv, d, page, num_splits, qk_norm):
    """The new token's k/v stored as e4m3 and attended as stored: the output equals the reference's
    attention over the cache the kernel wrote (and its bytes the reference's); a padding row writes none.
    qk_norm: Qwen3's per-head q/k RMSNorm before the rotation, in the same kernel."""
    from fastllm.kernels.paged_decode_attention import NewTokens, paged_decode_attention_splits

    kv = _fp8_kv(seq_lens, hkv, d, page, gen, device)
    b = len(seq_lens)
    query, key, value = (torch.randn(b, h, d, device=device) * 3 for h in (hq, hkv, hkv))
    positions = kv.seq_lens.long() - 1
    slots = kv.chunk_slots([1] * b)
    slots[0] = -1  # a padding row
    cos_sin = _cos_sin_cache(max(seq_lens) + 1, d, device)
    ref_k, ref_v = kv.key_cache.clone(), kv.value_cache.clone()
    norm = dict(zip(("q_norm_weight", "k_norm_weight"), qk_norm_weights(d, torch.float32, device, gen)),
                norm_eps=NORM_EPS) if qk_norm else {}
    append = NewTokens(positions, key, value, cos_sin, True, slots, **norm)
    out = paged_decode_attention_splits(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                        max(seq_lens), d ** -0.5, num_splits, append=append, **_kw())
    ref = R.rotary_decode_attention(positions, query, key, value, cos_sin, True, ref_k, ref_v, slots,
                                    kv.block_tables, kv.seq_lens, max(seq_lens), d ** -0.5, **norm, **_kw())
    written = slots >= 0
    for cache, ref_cache in ((kv.key_cache, ref_k), (kv.value_cache, ref_v)):
        flat, ref_flat = cache.view(-1, hkv, d), ref_cache.view(-1, hkv, d)
        assert_e4m3_equal(flat[slots[written]], ref_flat[slots[written]], "the new token's cache row")
    q_rot = R.rotary_kv_cache_write(positions, query, key, value, cos_sin, True, ref_k.clone(), ref_v.clone(),
                                    torch.full_like(slots, -1), False, **norm)[0]
    over_written = R.paged_decode_attention(q_rot[1:], kv.key_cache, kv.value_cache, kv.block_tables[1:],
                                            kv.seq_lens[1:], max(seq_lens), d ** -0.5, **_kw())
    assert_close(out[1:], over_written, *TOL[torch.float32], "decode over the kernel's cache")
    if not INTERPRET:
        assert_close(out, ref, *TOL[torch.float32], "rotary decode")


@pytest.mark.parametrize("seq_lens,hq,hkv,d,page", READ_CASES)
@pytest.mark.parametrize("window", [None, 11])
def test_prefill_attention_fp8(device, gen, seq_lens, hq, hkv, d, page, window):
    """Chunks over a cached prefix (and whole prompts); the chunk's rows are the cache's e4m3 values."""
    from fastllm.kernels.prefill_attention import prefill_attention_config

    kv = _fp8_kv(seq_lens, hkv, d, page, gen, device)
    q_lens = [min(n, 20) for n in seq_lens]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), hq, d, device=device)
    key, value = _cache_rows(kv, q_lens, torch.float32)
    args = (query, key, value, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, max(q_lens),
            d ** -0.5)
    out = prefill_attention_config(*args, window=window, **_kw())
    ref = R.prefill_attention(*args, window, **_kw())
    assert_close(out, ref, *TOL[torch.float32], f"prefill {seq_lens} window {window}")


@pytest.mark.parametrize("hq,hkv,d,page", [(8, 2, 64, 16), (4, 4, 128, 8)])
def test_cascade_prefix_attention_fp8(device, gen, hq, hkv, d, page):
    prefix = 37
    kv = _fp8_kv([prefix + 5, prefix + 9], hkv, d, page, gen, device)
    kv.block_tables[1, : prefix // page] = kv.block_tables[0, : prefix // page]  # (reads the leader's table)
    i32 = dict(dtype=torch.int32, device=device)
    query = torch.randn(4, hq, d, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, torch.tensor([0], **i32),
            torch.tensor([prefix], **i32), torch.tensor([0, 1, 3], **i32), torch.tensor([0, 3], **i32), 3, prefix,
            d ** -0.5)
    o, lse = triton_impl("cascade_prefix_attention")(*args, **_kw())
    o_ref, lse_ref = R.cascade_prefix_attention(*args, **_kw())
    from fastllm.kernels.merge_attn_states import merge_attn_states  # noqa: F401  (S splits -> 1 to compare)
    out = torch.zeros(4, hq, d, device=device)
    lse_out = torch.full((4, hq), float("-inf"), device=device)
    ref = out.clone()
    R.merge_attn_states(out, lse_out, o, lse, torch.tensor([0, 1, 3], device=device))
    R.merge_attn_states(ref, lse_out.clone(), o_ref, lse_ref, torch.tensor([0, 1, 3], device=device))
    assert_close(out, ref, *TOL[torch.float32], "cascade prefix")


@pytest.mark.parametrize("hq,hkv,d,page", [(8, 2, 64, 16), (4, 4, 128, 8)])
def test_cascade_decode_attention_fp8(device, gen, hq, hkv, d, page):
    # a decode step's cascade: requests 0 and 1 share a 37-token prefix, request 2 shares nothing; both
    # kernels read e4m3 with the scales, and the suffix kernel merges
    prefix = 37
    kv = _fp8_kv([prefix + 5, prefix + 9, 20], hkv, d, page, gen, device)
    kv.block_tables[1, : prefix // page] = kv.block_tables[0, : prefix // page]  # (reads the leader's table)
    i32 = dict(dtype=torch.int32, device=device)
    query = torch.randn(3, hq, d, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
            torch.tensor([prefix, prefix, 0], **i32), torch.tensor([0], **i32), torch.tensor([prefix], **i32),
            torch.tensor([0, 1], **i32), torch.tensor([0, 2], **i32), 2, prefix, 20, d ** -0.5)
    out = triton_impl("cascade_decode_attention")(*args, **_kw())
    assert_close(out, R.cascade_decode_attention(*args, **_kw()), *TOL[torch.float32], "cascade decode")


def test_scales_with_a_16bit_cache_are_an_error(device):
    cache = torch.zeros(2, 4, 1, 8, device=device)
    with pytest.raises(ValueError, match="k_scale"):
        triton_impl("kv_cache_write")(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), cache, cache.clone(),
                                      torch.zeros(1, dtype=torch.long), 0.5, 1.0)


# GPU: bf16 activations, arbitrary scales and inputs: bytes equal, outputs within bf16 tolerances.

@gpu
@pytest.mark.parametrize("t,hkv,d,page", WRITE_CASES)
def test_kv_cache_write_fp8_gpu(gen, t, hkv, d, page):
    num_blocks = -(-t // page) + 3
    key, value = (torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16) * 60 for _ in range(2))
    slots = torch.randperm(num_blocks * page)[:t].cuda()
    out = [torch.zeros(num_blocks, page, hkv, d, dtype=FP8, device="cuda") for _ in range(4)]
    triton_impl("kv_cache_write")(key, value, out[0], out[1], slots, *GPU_SCALES)
    R.kv_cache_write(key, value, out[2], out[3], slots, *GPU_SCALES)
    assert_e4m3_equal(out[0], out[2], "key_cache")
    assert_e4m3_equal(out[1], out[3], "value_cache")


@gpu
@pytest.mark.parametrize("seq_lens,hq,hkv,d,page", READ_CASES)
def test_fp8_readers_gpu(gen, seq_lens, hq, hkv, d, page):
    """bf16 queries over an FP8 cache: decode (with and without the append), prefill, against the references."""
    kv = _fp8_kv(seq_lens, hkv, d, page, gen, "cuda")
    bf16, b = torch.bfloat16, len(seq_lens)
    query = torch.randn(b, hq, d, device="cuda", dtype=bf16)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, max(seq_lens), d ** -0.5)
    assert_close(triton_impl("paged_decode_attention")(*args, **_kw(GPU_SCALES)),
                 R.paged_decode_attention(*args, **_kw(GPU_SCALES)), *TOL[bf16], "decode")
    q_lens = [min(n, 20) for n in seq_lens]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    query = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=bf16)
    key, value = _cache_rows(kv, q_lens, bf16)
    args = (query, key, value, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, max(q_lens),
            d ** -0.5)
    assert_close(triton_impl("prefill_attention")(*args, **_kw(GPU_SCALES)),
                 R.prefill_attention(*args, **_kw(GPU_SCALES)), *TOL[bf16], "prefill")
    positions = kv.seq_lens.long() - 1
    slots = kv.chunk_slots([1] * b)
    new = [torch.randn(b, h, d, device="cuda", dtype=bf16) for h in (hq, hkv, hkv)]
    cos_sin = _cos_sin_cache(max(seq_lens) + 1, d, "cuda")
    caches = (kv.key_cache.clone(), kv.value_cache.clone())
    out = triton_impl("rotary_decode_attention")(positions, *new, cos_sin, True, kv.key_cache, kv.value_cache,
                                                  slots, kv.block_tables, kv.seq_lens, max(seq_lens), d ** -0.5,
                                                  **_kw(GPU_SCALES))
    ref = R.rotary_decode_attention(positions, *new, cos_sin, True, *caches, slots, kv.block_tables, kv.seq_lens,
                                    max(seq_lens), d ** -0.5, **_kw(GPU_SCALES))
    assert_close(out, ref, *TOL[bf16], "rotary decode")
    assert_e4m3_equal(kv.key_cache, caches[0], "the new keys")


@gpu
@pytest.mark.parametrize("append", [False, True])
def test_one_warp_programs_a_sm_gpu(append):
    """The programs a SM the FP8 table's split counts rest on (_FP8_SPLIT_PROGRAMS_PER_SM, the unsplit
    _FP8_UNSPLIT_PROGRAMS_PER_SM) are what this machine's Triton compiles the one-warp programs to."""
    from fastllm.bench.occupancy import decode_attention
    from fastllm.kernels import paged_decode_attention as P

    split, unsplit = (decode_attention(True, *P.TILE_CONFIGS[4], splits, append) for splits in (2, 1))
    assert split.programs_per_sm() == P._FP8_SPLIT_PROGRAMS_PER_SM, split
    assert unsplit.programs_per_sm() == P._FP8_UNSPLIT_PROGRAMS_PER_SM, unsplit


@gpu
@pytest.mark.parametrize("batch,bound", [(128, 1024), (256, 4096), (96, 384), (32, 4096), (64, 2048),
                                         (192, 4096)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fp8_decode_gpu_one_warp_tiles(gen, batch, bound, qk_norm):
    """Batches the table gives one-warp 32-key programs over an FP8 cache (from 5 programs a SM, and from
    1.5 under a long bound; 192 x 4096: one split a request, launched as two): decode, and the engine's
    rotary decode (Qwen3's q/k norms too), against the references; requests of 1 key to the bound, so some
    use one split and some several."""
    from fastllm.kernels import sm_count
    from fastllm.kernels.paged_decode_attention import TILE_CONFIGS, choose_config

    hq, hkv, d, page, bf16 = 32, 8, 128, 16, torch.bfloat16
    assert choose_config(bound, batch, hkv, d, sm_count.num_sms(torch.device("cuda")),
                         fp8_cache=True)[1:4] == TILE_CONFIGS[4]
    seq_lens = torch.randint(1, bound + 1, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    seq_lens[0] = bound
    kv = _fp8_kv(seq_lens, hkv, d, page, gen, "cuda")
    query = torch.randn(batch, hq, d, device="cuda", dtype=bf16)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, bound, d ** -0.5)
    assert_close(triton_impl("paged_decode_attention")(*args, **_kw(GPU_SCALES)),
                 R.paged_decode_attention(*args, **_kw(GPU_SCALES)), *TOL[bf16], "decode")
    positions = kv.seq_lens.long() - 1
    slots = kv.chunk_slots([1] * batch)
    new = [torch.randn(batch, h, d, device="cuda", dtype=bf16) for h in (hq, hkv, hkv)]
    cos_sin = _cos_sin_cache(bound + 1, d, "cuda")
    norm = dict(zip(("q_norm_weight", "k_norm_weight"), qk_norm_weights(d, bf16, "cuda", gen)),
                norm_eps=NORM_EPS) if qk_norm else {}
    caches = (kv.key_cache.clone(), kv.value_cache.clone())
    tail = (slots, kv.block_tables, kv.seq_lens, bound, d ** -0.5)
    out = triton_impl("rotary_decode_attention")(positions, *new, cos_sin, True, kv.key_cache, kv.value_cache,
                                                  *tail, **norm, **_kw(GPU_SCALES))
    ref = R.rotary_decode_attention(positions, *new, cos_sin, True, *caches, *tail, **norm, **_kw(GPU_SCALES))
    assert_close(out, ref, *TOL[bf16], "rotary decode")
    assert_e4m3_equal(kv.key_cache, caches[0], "the new keys")
