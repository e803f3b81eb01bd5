"""Triton paged decode attention vs reference.paged_decode_attention (float32 oracle on upcast inputs).

Tolerances (||out - ref|| / ||ref||, and max |out - ref|; outputs are O(1)):
    float32   rel 1e-5   abs 1e-4   fp32 dots run with input_precision="ieee" (tf32 would be ~1e-3)
    float16   rel 2e-3   abs 1e-2   p is rounded to fp16 for the PV dot, out rounded to fp16
    bfloat16  rel 1e-2   abs 5e-2   same in bf16 (8-bit mantissa); GPU only (interpreter: bf16 tl.dot broken)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fastllm.kernels import triton_impl
from tests.kernels.kernel_testing import BF16, PagedKV, assert_close, decode_oracle, gpu

TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1e-2, 5e-2)}
DTYPES = [torch.float32, torch.float16, BF16]


def _run(device, gen, dtype, seq_lens, hq, hkv, d, page, num_blocks=None, max_seq_len=None, num_splits=None,
         strided_query=False, tile=None, offset_64=None, return_kv=False):
    num_blocks = num_blocks or sum(-(-n // page) for n in seq_lens) + 8
    kv = PagedKV(seq_lens, num_blocks, page, hkv, d, dtype, device, gen)
    max_seq_len = max_seq_len or max(max(seq_lens), 1)
    if strided_query:  # a slice of a fused qkv-like buffer: token stride != Hq * D
        query = torch.randn(len(seq_lens), hq + 2, d, device=device).to(dtype)[:, 1 : hq + 1]
    else:
        query = torch.randn(len(seq_lens), hq, d, device=device).to(dtype)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, max_seq_len, d**-0.5)
    if num_splits is None:
        out = triton_impl("paged_decode_attention")(*args)
    else:
        from fastllm.kernels.paged_decode_attention import paged_decode_attention_splits

        block_n, num_warps, num_stages, *min_split_len = tile or (None, 4, 2)  # or a DecodeConfig's tail
        out = paged_decode_attention_splits(*args, num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                                            num_stages=num_stages, min_split_len=min_split_len[0] if min_split_len else 0,
                                            offset_64=offset_64)
    ref = decode_oracle(query, kv, max_seq_len)
    assert out.dtype == dtype
    assert_close(out, ref, *TOL[dtype], what=f"decode lens={seq_lens}")
    return (out, kv) if return_kv else out


def _tile_configs():
    from fastllm.kernels.paged_decode_attention import TILE_CONFIGS

    return TILE_CONFIGS


# (seq_lens, Hq, Hkv, head_dim, block_size)
CASES = [
    ([1], 4, 4, 64, 16),  # one token, MHA
    ([16, 17, 5], 8, 2, 64, 16),  # exactly one block, one past it, GQA 4
    ([33, 1, 100, 64], 16, 2, 128, 32),  # GQA 8, head dim 128, several lengths in one launch
    ([7, 70], 4, 1, 8, 8),  # head dim 8, block size 8 (tiny test model)
    ([50, 3], 6, 2, 80, 16),  # head dim 80, group of 3 (not a power of 2)
    ([40, 9], 4, 2, 96, 32),  # head dim 96
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,hq,hkv,d,page", CASES)
def test_decode_matches_reference(device, gen, dtype, seq_lens, hq, hkv, d, page):
    _run(device, gen, dtype, seq_lens, hq, hkv, d, page)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("d", [8, 64, 128])
def test_decode_grid(device, gen, dtype, hq, hkv, page, d):
    # lengths around the block boundaries of this block size, plus an odd long one
    _run(device, gen, dtype, [page, page + 1, 1, 2 * page - 1, 3 * page + 5], hq, hkv, d, page)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_decode_forced_splits(device, gen, dtype, num_splits):
    # lengths chosen so some splits are empty for the short requests and the long one spans all of them
    _run(device, gen, dtype, [300, 1, 64, 129], 8, 2, 64, 16, max_seq_len=300, num_splits=num_splits)


def test_decode_heuristic_splits_with_loose_bound(device, gen):
    # max_seq_len (the CUDA-graph bound) far above the real length: the heuristic still splits it
    from fastllm.kernels.paged_decode_attention import choose_num_splits

    assert choose_num_splits(2048, 1, 2, num_sms=4) > 1
    _run(device, gen, torch.float16, [200], 8, 2, 64, 16, max_seq_len=2048)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_padding_rows(device, gen, num_splits):
    # CUDA-graph padding: seq_len 0 (nothing to attend: zeros) and 1, with all-zero block-table rows
    kv = PagedKV([0, 1, 25], 16, 16, 2, 64, torch.float16, device, gen)
    kv.block_tables[0].zero_()
    kv.key_cache[0].normal_()  # block 0 is real data for the seq_len-1 padding row below
    kv.value_cache[0].normal_()
    kv.block_tables[1].zero_()
    query = torch.randn(3, 8, 64, device=device).half()
    from fastllm.kernels.paged_decode_attention import paged_decode_attention_splits

    out = paged_decode_attention_splits(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                        128, 0.125, num_splits=num_splits)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()
    ref = decode_oracle(query, kv, 128)
    assert_close(out, ref, *TOL[torch.float16])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_int64_offsets(device, gen, num_splits):
    # the int64 page-offset path, forced on a small cache (a real one needs 2^31 elements: GPU test below)
    _run(device, gen, torch.float16, [300, 1, 64, 129], 8, 2, 64, 16, max_seq_len=300, num_splits=num_splits,
         offset_64=True)


def test_decode_strided_query(device, gen):
    _run(device, gen, torch.float16, [20, 45], 8, 2, 64, 16, strided_query=True)


@pytest.mark.parametrize("tile", [pytest.param(t, id="BN{}-w{}-s{}".format(*t)) for t in _tile_configs()])
@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode_every_tile_config(device, gen, tile, num_splits):
    # every (BLOCK_N, warps, stages) the host table can pick: tiles past a split's end, partial last tiles
    _run(device, gen, torch.float16, [300, 1, 129, 64], 8, 2, 64, 16, max_seq_len=300, num_splits=num_splits,
         tile=tile)


def test_decode_many_splits_multi_chunk_reduce(device, gen):
    # 35 non-empty splits of 32 tokens (> the reduce's 32 splits per step), the rest empty (skipped by both
    # passes); the short requests use only the first few splits
    _run(device, gen, torch.float16, [1100, 5, 40], 4, 2, 32, 16, max_seq_len=4096, num_splits=64,
         tile=(16, 4, 2))


def test_decode_loose_bound_max_splits(device, gen):
    # the CUDA-graph case: a max_seq_len bound far above the lengths makes the table pick many splits,
    # almost all empty for these requests
    from fastllm.kernels.paged_decode_attention import choose_config

    cfg = choose_config(32768, 1, 2, 64, num_sms=132)
    assert cfg.num_splits > 32
    _run(device, gen, torch.float16, [70], 8, 2, 64, 16, max_seq_len=32768, num_splits=cfg.num_splits,
         tile=cfg[1:])


def test_cascade_suffix_takes_the_small_tile_from_fewer_programs():
    # beside the prefix kernel's programs the 16-key 2-warp tile pays from ~3 programs a SM
    from fastllm.kernels.paged_decode_attention import TILE_CONFIGS, choose_config

    small = TILE_CONFIGS[3]
    assert choose_config(8192, 64, 8, 128, num_sms=132, beside_prefix=True)[1:4] == small  # 3.9 a SM
    beside_few = choose_config(8192, 32, 8, 128, num_sms=132, beside_prefix=True)  # 1.9 a SM
    assert beside_few[1:4] == TILE_CONFIGS[0]
    for batch in (64, 128, 256):  # alone, never
        assert choose_config(8192, batch, 8, 128, num_sms=132)[1:4] != small


def test_decode_merge_in_second_kernel(device, gen):
    # the two-pass layout (a separate merge kernel) that tune.py still times against the in-kernel merge
    from fastllm.kernels.paged_decode_attention import paged_decode_attention_splits

    kv = PagedKV([1100, 5, 40, 0], 90, 16, 2, 32, torch.float16, device, gen)
    query = torch.randn(4, 4, 32, device=device).half()
    out = paged_decode_attention_splits(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                        4096, 32**-0.5, num_splits=64, block_n=16, merge_in_kernel=False)
    assert_close(out, decode_oracle(query, kv, 4096), *TOL[torch.float16])


def test_decode_split_counters_left_zero(device, gen):
    # the last split of each (request, KV head) resets its counter: the next launch (or graph replay)
    # starts from zero; a request of seq_len 0 counts nothing
    from fastllm.kernels.paged_decode_attention import _split_counters

    for _ in range(2):
        _run(device, gen, torch.float16, [300, 0, 64, 129, 1], 8, 2, 64, 16, max_seq_len=300, num_splits=5)
        # the device as the kernels' tensors carry it ("cuda:0", not "cuda")
        assert not _split_counters(torch.empty(0, device=device).device, 1).any()


@pytest.mark.parametrize("merge_in_kernel", [True, False])
def test_decode_min_split_len(device, gen, merge_in_kernel):
    # with a 256-key floor on the split length: 600 keys use 3 of the 8 splits, 100 and 256 one (written
    # straight to out, no merge), 2000 all 8 (250 rounded up to 256), 0 none
    from fastllm.kernels.paged_decode_attention import paged_decode_attention_splits

    lens = [600, 100, 256, 1, 0, 2000]
    kv = PagedKV(lens, 240, 16, 2, 32, torch.float16, device, gen)
    query = torch.randn(len(lens), 4, 32, device=device).half()
    out = paged_decode_attention_splits(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                        2048, 32**-0.5, num_splits=8, block_n=64, merge_in_kernel=merge_in_kernel,
                                        min_split_len=256)
    assert_close(out, decode_oracle(query, kv, 2048), *TOL[torch.float16])


def test_decode_min_split_len_splits_used(device, gen, monkeypatch):
    # which splits hold keys, read off the partial-lse buffer (NaN-filled here, so unwritten rows show):
    # 600 keys -> 256-key splits 0-2, 2000 -> all 8 (250 rounded up to 256); 100, 256 and 1 fit one split
    # and are written straight to out, 0 has no keys
    from fastllm.kernels.paged_decode_attention import paged_decode_attention_splits

    lens = [600, 100, 256, 1, 0, 2000]
    kv = PagedKV(lens, 240, 16, 2, 32, torch.float16, device, gen)
    query = torch.randn(len(lens), 4, 32, device=device).half()
    made, real_empty = [], torch.empty

    def nan_empty(*shape, **kwargs):
        t = real_empty(*shape, **kwargs)
        if t.dtype == torch.float32 and t.dim() == 3:  # part_lse [B, Hq, splits]
            made.append(t.fill_(float("nan")))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
    out = paged_decode_attention_splits(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                        2048, 32**-0.5, num_splits=8, block_n=64, min_split_len=256)
    monkeypatch.undo()
    [part_lse] = made
    used = (~torch.isnan(part_lse[:, 0])).sum(-1).tolist()  # splits written, per request (head 0)
    assert used == [3, 0, 0, 0, 0, 8], used
    assert_close(out, decode_oracle(query, kv, 2048), *TOL[torch.float16])


def test_decode_table_tiles():
    from fastllm.kernels.paged_decode_attention import TILE_CONFIGS, choose_config

    small = choose_config(4096, 1, 8, 128, num_sms=132)
    assert small[1:4] == TILE_CONFIGS[5] and small.min_split_len == 0  # few programs: split down to one tile
    busy = choose_config(4096, 32, 8, 128, num_sms=132)
    assert busy.num_splits == 2 and busy.min_split_len >= 512  # long requests split, short ones do not
    assert choose_config(4096, 41, 8, 128, num_sms=132).num_splits == 2
    assert choose_config(4096, 42, 8, 128, num_sms=132).num_splits == 1  # 336 programs: 2.5 a SM
    # 16-bit caches by programs (B x 8 KV heads) a SM: < 1, < 5, < 8.5, < 10, more
    for batches, tile in (((1, 16), 5), ((17, 82), 0), ((83, 140), 6), ((141, 164), 3), ((165, 1024), 6)):
        for batch in batches:
            assert choose_config(4096, batch, 8, 128, num_sms=132)[1:4] == TILE_CONFIGS[tile], batch
    assert choose_config(4096, 8, 8, 128, num_sms=132, element_size=4)[1:4] == TILE_CONFIGS[0]  # fp32
    assert choose_config(4096, 256, 8, 128, num_sms=132, element_size=4)[1:4] == TILE_CONFIGS[0]
    assert choose_config(4096, 8, 8, 256, num_sms=132)[1:4] == TILE_CONFIGS[2]  # head_dim 256
    assert choose_config(4096, 48, 8, 256, num_sms=132).num_splits == 2  # its splits as before (unmeasured)
    long = choose_config(32768, 1, 8, 128, num_sms=132)  # long context, few programs: 128-key tiles, ~2 a SM
    assert long[:4] == (33, *TILE_CONFIGS[1]), long
    assert choose_config(8192, 1, 8, 128, num_sms=132)[1:4] == TILE_CONFIGS[5]  # below the long-context bound
    assert choose_config(32768, 32, 8, 128, num_sms=132)[1:4] == TILE_CONFIGS[0]  # B x Hkv covers the SMs
    assert choose_config(32768, 1, 8, 128, num_sms=132, element_size=4)[1:4] == TILE_CONFIGS[0]  # fp32


def test_decode_table_fp8_cache():
    """An FP8 cache under 16-bit queries: one-warp 32-key programs from 5 programs a SM (B x Hkv), and from
    1.5 under a bound of 2048 or more, in as many splits of >= 128 keys as fit one wave of split programs
    (12 a SM: 1,584 on 132 SMs); where two do not fit, one split, launched as two of the bound's length
    (every request in one) where the merge's variant (12 a SM against the unsplit one's 11) saves a wave.
    Everything else as the 16-bit cache's table (fewer programs, shorter bounds, fp32 queries, head_dim
    256, a cascade's suffix), but for its 2-warp 64-key tile (TILE_CONFIGS[5], measured over 16-bit caches
    only), whose place an FP8 cache's 4-warp one (TILE_CONFIGS[0]) keeps."""
    from fastllm.kernels.paged_decode_attention import TILE_CONFIGS, choose_config

    def table(bound, batch, head_dim=128, **kw):
        return [choose_config(bound, batch, 8, head_dim, num_sms=132, fp8_cache=fp8, **kw)
                for fp8 in (False, True)]

    one_wave = ((4096, 25, 7), (4096, 32, 6), (2048, 48, 4), (4096, 64, 3), (32768, 64, 3), (4096, 80, 2),
                (4096, 99, 2), (384, 83, 2), (256, 96, 2), (32768, 32, 6))
    for bound, batch, splits in one_wave:
        assert batch * 8 * splits <= 1584 < batch * 8 * (splits + 1) or splits * 128 == bound
        plain, fp8 = table(bound, batch)
        assert plain[1:4] != TILE_CONFIGS[4], (bound, batch)
        assert fp8 == (splits, *TILE_CONFIGS[4], 128), (bound, batch)
    unsplit = ((4096, 100), (4096, 128), (1024, 128), (512, 256), (4096, 181), (4096, 199), (4096, 256),
               (384, 512))
    for bound, batch in unsplit:  # 800 .. 4,096 programs: not one more wave as 11 a SM than as 12
        assert table(bound, batch)[1] == (1, *TILE_CONFIGS[4], 0), (bound, batch)
    for bound, batch in ((4096, 182), (1024, 198), (4096, 384)):  # 1,456 / 1,584 / 3,072 programs
        assert table(bound, batch)[1] == (2, *TILE_CONFIGS[4], bound), (bound, batch)
    for bound, batch, kw in ((2047, 64, {}), (4096, 24, {}), (384, 32, {}), (384, 82, {}), (8192, 1, {}),
                             (4096, 64, {"element_size": 4}), (4096, 64, {"head_dim": 256}),
                             (4096, 64, {"beside_prefix": True}), (4096, 256, {"element_size": 4}),
                             (4096, 256, {"head_dim": 256}), (4096, 256, {"beside_prefix": True})):
        plain, fp8 = table(bound, batch, **kw)
        if plain[1:4] == TILE_CONFIGS[5]:
            plain = plain._replace(**dict(zip(("block_n", "num_warps", "num_stages"), TILE_CONFIGS[0])))
        assert fp8 == plain, (bound, batch, kw)


def test_append_keeps_the_program_count_a_sm():
    """The engine's decode attention (APPEND: rotate, write and attend to the new token) over an FP8 cache
    needs at most 8 registers a thread more than the kernel without it, and spills nothing, at the 64-key
    4-warp tile and the one-warp split tile: holding the new token's k/v across the key loop took 34 more,
    a program a SM fewer and 1.76x the time at B64 x 3840 (H200). sm_90 machine code, compiled here."""
    code = ("import json; from fastllm.bench.occupancy import decode_attention as d; print(json.dumps("
            "[[d(True, *tile, splits, append) for append in (False, True)] "
            "for tile, splits in (((64, 4, 2), 1), ((32, 1, 2), 2))]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (interpreted: no compile)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    for plain, append in json.loads(out.stdout.splitlines()[-1]):
        registers, spilled = append[:2]
        assert registers <= plain[0] + 8 and spilled == 0, (plain, append)


def test_split_count_is_host_only():
    from fastllm.kernels.paged_decode_attention import choose_num_splits

    assert choose_num_splits(32768, 1, 8, num_sms=132) > 8  # long single request: spread over the SMs
    assert choose_num_splits(4096, 64, 8, num_sms=132) == 1  # batch x heads already fills the GPU
    assert choose_num_splits(100, 1, 8, num_sms=132) == 1  # too short to be worth splitting


# ---- full matrix on a real GPU ----
GPU_CASES = [
    [1],
    [4096],
    [1, 17, 512, 4095, 4096, 2000, 33, 64],
    [int(x) for x in torch.randint(1, 4097, (64,), generator=torch.Generator().manual_seed(0))],
    [int(x) for x in torch.randint(1, 300, (32,), generator=torch.Generator().manual_seed(1))],
]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens", GPU_CASES, ids=lambda v: f"B{len(v)}max{max(v)}")
@pytest.mark.parametrize("hq,hkv,d,page",
                         [(32, 8, 128, 16), (32, 32, 128, 32), (16, 2, 64, 16), (28, 4, 128, 128)])
def test_decode_gpu(device, gen, dtype, seq_lens, hq, hkv, d, page):
    num_blocks = 32768 if hkv * page <= 256 else 16384  # 32768 x 16 x 8 x 128 = 2^29 elements per cache
    _run(device, gen, dtype, seq_lens, hq, hkv, d, page, num_blocks=num_blocks, max_seq_len=4096)


@gpu
@pytest.mark.parametrize("tile", [pytest.param(t, id="BN{}-w{}-s{}".format(*t)) for t in _tile_configs()])
@pytest.mark.parametrize("num_splits", [1, 16, 256])
@pytest.mark.parametrize("hq,hkv,d,page", [(32, 8, 128, 16), (28, 4, 128, 128), (16, 2, 64, 16)])
def test_decode_gpu_every_config(device, gen, tile, num_splits, hq, hkv, d, page):
    # every tile config the table can pick, with 1 (direct), some and the most splits, on mixed lengths
    _run(device, gen, torch.bfloat16, [1, 17, 512, 4095, 4096, 2000, 33, 64], hq, hkv, d, page,
         num_blocks=16384, max_seq_len=4096, num_splits=num_splits, tile=tile)


@gpu
@pytest.mark.parametrize("max_seq_len", [512, 4096, 32768])
@pytest.mark.parametrize("batch", [1, 4, 64])
def test_decode_gpu_table_choice(device, gen, max_seq_len, batch):
    # whatever the table picks for a (bound, batch) pair, with lengths spread up to the bound
    lens = torch.randint(1, max_seq_len + 1, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    lens[0] = max_seq_len
    _run(device, gen, torch.bfloat16, lens, 32, 8, 128, 16, num_blocks=sum(-(-n // 16) for n in lens) + 8,
         max_seq_len=max_seq_len)


@gpu
@pytest.mark.parametrize("batch", [8, 32, 128, 256])
def test_decode_gpu_short_requests_loose_bound(device, gen, batch):
    # the engine's decode graphs: captured with max_model_len as the bound, replayed on short requests
    lens = torch.randint(1, 513, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    _run(device, gen, torch.bfloat16, lens, 32, 8, 128, 16, num_blocks=sum(-(-n // 16) for n in lens) + 8,
         max_seq_len=4096)


@gpu
def test_decode_gpu_cache_past_int32_offsets(device, gen):
    # 140000 blocks of 16 x 8 x 128: 2.29e9 elements per cache, so block ids above 131071 sit past int32
    # element offsets; the launcher must pick int64 ones (OFFSET_64) for them
    lens = [4096, 1, 3000, 17, 2048, 777, 4095, 64]
    _, kv = _run(device, gen, torch.bfloat16, lens, 32, 8, 128, 16, num_blocks=140000, max_seq_len=4096,
                 return_kv=True)
    high = int(kv.block_tables.max()) * kv.key_cache.stride(0)
    assert high >= 2**31, f"no block past int32 offsets ({high}): the test would not test them"


@gpu
def test_decode_gpu_merge_under_graph_replay(device, gen):
    # many replays of one captured launch with fresh queries: a merge that read a partial before its
    # writer finished, or a counter left non-zero, would show as a wrong row in some replay. (The CPU
    # tests cannot see the first: the interpreter runs the programs in order, so the last to count
    # always finds every partial written.)
    kv = PagedKV([int(x) for x in torch.randint(1, 2049, (64,), generator=gen)], 9000, 16, 8, 128,
                 torch.bfloat16, device, gen)
    query = torch.randn(64, 32, 128, device=device, dtype=torch.bfloat16)
    from fastllm.kernels.paged_decode_attention import paged_decode_attention_splits

    def run():
        return paged_decode_attention_splits(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                             2048, 128**-0.5, num_splits=8)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(20):
        query.copy_(torch.randn_like(query))
        graph.replay()
        assert_close(out, decode_oracle(query, kv, 2048), *TOL[torch.bfloat16])


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_decode_gpu_int64_offsets(device, gen, dtype):
    # 32768 blocks x 128 tokens x 8 heads x 128 = 2^32 elements per cache: block * stride overflows int32
    # for every block id >= 16384, which about half of the randomly drawn ids are.
    kv = PagedKV([3000, 1, 129, 4096], 32768, 128, 8, 128, dtype, device, gen)
    assert int(kv.block_tables.max()) >= 16384
    query = torch.randn(4, 32, 128, device=device).to(dtype)
    out = triton_impl("paged_decode_attention")(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 4096, 128**-0.5)
    assert_close(out, decode_oracle(query, kv, 4096), *TOL[dtype])
