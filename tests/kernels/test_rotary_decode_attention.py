"""Triton rotary_decode_attention (rotary + KV write + decode attention in one launch) vs its reference.

Every request's new token is at position seq_len - 1. Its cache slot is NaN-poisoned before the call:
the kernel must take the new token from its inputs (writing it there when slot >= 0) and never read the
slot back, and a padding row (slot -1) leaves its slot NaN. Checks:
  * the output against reference.rotary_decode_attention run on float32 copies, with the decode
    tolerances (test_paged_decode_attention.TOL);
  * the caches against the reference run in the input dtype: V bit for bit, K within one ulp
    (rotary's fp32 math, rounded), every other slot untouched (poison included; the references run on
    copies of the blocks the tables name, and every other block must still be all NaN);
  * the inputs are not modified (the attention op declares no mutation).
With Qwen3's q/k norm weights (q and the new k RMS-normed per head before the rotation) the cached K may be
3 ulp off instead of one: a head's mean square summed in another order can flip a rounding of the norm.
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import reference_impl, triton_impl
from tests.kernels.kernel_testing import BF16, PagedKV, assert_close, gpu
from tests.kernels.test_paged_decode_attention import CASES, GPU_CASES, TOL, _tile_configs
from tests.kernels.test_rotary import NORM_EPS, _cos_sin_cache, qk_norm_weights


def _run(device, gen, dtype, seq_lens, hq, hkv, d, page, is_neox=True, padding=(), num_blocks=None,
         max_seq_len=None, num_splits=None, tile=None, offset_64=None, qk_norm=False):
    num_blocks = num_blocks or sum(-(-n // page) for n in seq_lens) + 8
    kv = PagedKV(seq_lens, num_blocks, page, hkv, d, dtype, device, gen)
    batch = len(seq_lens)
    # q, k and v as views of one fused qkv buffer, as the model passes them
    qkv = torch.randn(batch, (hq + 2 * hkv) * d + 8, generator=gen).to(device=device, dtype=dtype)
    query = qkv[:, : hq * d].view(batch, hq, d)
    key = qkv[:, hq * d: (hq + hkv) * d].view(batch, hkv, d)
    value = qkv[:, (hq + hkv) * d: (hq + 2 * hkv) * d].view(batch, hkv, d)
    before = qkv.clone()
    lens = torch.tensor(seq_lens)
    positions = (lens - 1).to(device)
    table = kv.block_tables.cpu().long()
    last = table[torch.arange(batch), (lens - 1) // page] * page + (lens - 1) % page  # position seq_len - 1
    for cache in (kv.key_cache, kv.value_cache):  # the new tokens' slots: never read
        cache.view(-1, hkv, d)[last.to(device)] = float("nan")
    slot_mapping = last.clone()
    slot_mapping[list(padding)] = -1
    slot_mapping = slot_mapping.to(device)
    cos_sin = _cos_sin_cache(int(lens.max()) + 1, d, device)
    max_seq_len = max_seq_len or int(lens.max())
    scale = d**-0.5
    # The references run on copies of the blocks the requests use (the poison block among them), renumbered:
    # whole copies of a GPU case's caches (2^31 elements each) took ~50 GB beside the kernel's own.
    used, ref_tables, ref_slots = _used_blocks(kv.block_tables, slot_mapping, page)
    ref_kc, ref_vc = kv.key_cache[used], kv.value_cache[used]
    up_kc, up_vc = ref_kc.float(), ref_vc.float()
    norm = (*qk_norm_weights(d, dtype, device, gen), NORM_EPS) if qk_norm else ()
    up_norm = (norm[0].float(), norm[1].float(), NORM_EPS) if qk_norm else ()

    common = (cos_sin, is_neox)
    tail = (slot_mapping, kv.block_tables, kv.seq_lens, max_seq_len, scale, None)  # (None: no window)
    ref_tail = (ref_slots, ref_tables, *tail[2:])
    if num_splits is None:
        out = triton_impl("rotary_decode_attention")(positions, query, key, value, *common, kv.key_cache,
                                                     kv.value_cache, *tail, *norm)
    else:
        from fastllm.kernels.paged_decode_attention import NewTokens, paged_decode_attention_splits

        block_n, num_warps, num_stages = tile or (None, 4, 2)
        out = paged_decode_attention_splits(
            query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, max_seq_len, scale, num_splits,
            block_n=block_n, num_warps=num_warps, num_stages=num_stages, offset_64=offset_64,
            append=NewTokens(positions, key, value, cos_sin, is_neox, slot_mapping, *norm))
    ref = reference_impl("rotary_decode_attention")
    up = ref(positions, query.float(), key.float(), value.float(), *common, up_kc, up_vc, *ref_tail, *up_norm)
    ref(positions, query, key, value, *common, ref_kc, ref_vc, *ref_tail, *norm)

    assert torch.equal(qkv, before), "an input was modified"
    assert out.dtype == dtype
    assert_close(out, up, *TOL[dtype], what=f"rotary decode lens={seq_lens} padding={padding}")
    torch.testing.assert_close(kv.value_cache[used], ref_vc, rtol=0, atol=0, equal_nan=True)
    eps = torch.finfo(dtype).eps * (3 if qk_norm else 1)
    torch.testing.assert_close(kv.key_cache[used], ref_kc, rtol=eps, atol=eps, equal_nan=True)
    for cache in (kv.key_cache, kv.value_cache):
        _assert_unused_blocks_nan(cache, used)
    return out


def _used_blocks(block_tables, slot_mapping, page):
    """(the blocks the table names, sorted; the table and the slots renumbered to index them)."""
    used = torch.unique(block_tables.long())
    index = torch.full((int(used.max()) + 1,), -1, dtype=torch.long, device=used.device)
    index[used] = torch.arange(len(used), device=used.device)
    slots = slot_mapping.long()
    written = slots.clamp(min=0)  # (a padding row's slot -1 stays -1 below)
    renumbered = index[written // page] * page + written % page
    return used, index[block_tables.long()].to(block_tables.dtype), torch.where(slots >= 0, renumbered, slots)


_CHECK_BLOCKS = 1024  # blocks a step of the check below (bounds its temporaries)


def _assert_unused_blocks_nan(cache, used):
    """Every block the table does not name is still all NaN: nothing was written outside the requests."""
    unused = torch.ones(cache.shape[0], dtype=torch.bool, device=cache.device)
    unused[used] = False
    for lo in range(0, cache.shape[0], _CHECK_BLOCKS):
        blocks = cache[lo:lo + _CHECK_BLOCKS][unused[lo:lo + _CHECK_BLOCKS]]
        assert torch.isnan(blocks).all(), f"a block outside the requests' tables was written ({lo}..)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("seq_lens,hq,hkv,d,page", CASES)
def test_rotary_decode_matches_reference(device, gen, dtype, seq_lens, hq, hkv, d, page):
    _run(device, gen, dtype, seq_lens, hq, hkv, d, page)


@pytest.mark.parametrize("seq_lens,hq,hkv,d,page", CASES + [([5, 1, 20], 4, 2, 256, 8)])
def test_rotary_decode_qk_norm(device, gen, seq_lens, hq, hkv, d, page):
    _run(device, gen, torch.float32, seq_lens, hq, hkv, d, page, qk_norm=True)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_decode_qk_norm_splits_and_padding(device, gen, num_splits, is_neox):
    # every split normalizes q; padding rows (slot -1) too, without writing their k
    _run(device, gen, torch.float32, [300, 1, 129, 40], 8, 2, 64, 16, is_neox=is_neox, padding=(1, 3),
         max_seq_len=300, num_splits=num_splits, qk_norm=True)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2)])  # GQA ratios 1, 4, 8
def test_rotary_decode_interleaved_layout(device, gen, hq, hkv):
    _run(device, gen, torch.float16, [16, 17, 1, 40], hq, hkv, 64, 16, is_neox=False)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_rotary_decode_forced_splits_and_padding(device, gen, num_splits):
    # the new token in the last split, in a split of its own (seq_len 129 = 2 x 64 + 1), alone (seq_len 1,
    # as CUDA-graph padding), and padding rows that must attend to their own token without writing it
    _run(device, gen, torch.float16, [300, 1, 64, 129, 1, 40], 8, 2, 64, 16, padding=(4, 5),
         max_seq_len=300, num_splits=num_splits)


@pytest.mark.parametrize("tile", [pytest.param(t, id="BN{}-w{}-s{}".format(*t)) for t in _tile_configs()])
def test_rotary_decode_every_tile_config(device, gen, tile):
    _run(device, gen, torch.float32, [300, 1, 129, 64], 8, 2, 64, 16, max_seq_len=300, num_splits=5, tile=tile)


def test_rotary_decode_int64_offsets(device, gen):
    # the int64 page-offset path, forced on a small cache
    _run(device, gen, torch.float16, [300, 1, 129, 64], 8, 2, 64, 16, max_seq_len=300, num_splits=3,
         offset_64=True)


# ---- full matrix on a real GPU ----

@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens", GPU_CASES, ids=lambda v: f"B{len(v)}max{max(v)}")
@pytest.mark.parametrize("hq,hkv,d,page",
                         [(32, 8, 128, 16), (32, 32, 128, 32), (16, 2, 64, 16), (28, 4, 128, 128)])
def test_rotary_decode_gpu(device, gen, dtype, seq_lens, hq, hkv, d, page):
    num_blocks = 32768 if hkv * page <= 256 else 16384
    _run(device, gen, dtype, seq_lens, hq, hkv, d, page, padding=(0,), num_blocks=num_blocks, max_seq_len=4096)


@gpu
@pytest.mark.parametrize("tile", [pytest.param(t, id="BN{}-w{}-s{}".format(*t)) for t in _tile_configs()])
@pytest.mark.parametrize("num_splits", [1, 16, 256])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_decode_gpu_every_config(device, gen, tile, num_splits, is_neox):
    _run(device, gen, torch.bfloat16, [1, 17, 512, 4095, 4096, 2000, 33, 64], 32, 8, 128, 16, is_neox=is_neox,
         padding=(1,), num_blocks=16384, max_seq_len=4096, num_splits=num_splits, tile=tile)


@gpu
@pytest.mark.parametrize("seq_lens", GPU_CASES, ids=lambda v: f"B{len(v)}max{max(v)}")
@pytest.mark.parametrize("hq,hkv,d,page", [(32, 8, 128, 16), (16, 8, 128, 16), (8, 1, 256, 32)])
def test_rotary_decode_qk_norm_gpu(device, gen, seq_lens, hq, hkv, d, page):
    # Qwen3-8B (32/8 heads) and -0.6B (16/8) shapes
    _run(device, gen, torch.bfloat16, seq_lens, hq, hkv, d, page, padding=(0,), num_blocks=32768,
         max_seq_len=4096, qk_norm=True)
