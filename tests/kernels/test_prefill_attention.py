"""Triton prefill / chunked-prefill attention vs reference.prefill_attention (float32 oracle, upcast inputs).

Tolerances (||out - ref|| / ||ref||, and max |out - ref|; outputs are O(1)):
    float32   rel 1e-5   abs 1e-4   fp32 dots run with input_precision="ieee" (tf32 would be ~1e-3)
    float16   rel 2e-3   abs 1e-2   p is rounded to fp16 for the PV dot, out rounded to fp16
    bfloat16  rel 1e-2   abs 5e-2   GPU only (interpreter: bf16 tl.dot broken)
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import triton_impl
from tests.kernels.kernel_testing import BF16, PagedKV, assert_close, attention_oracle, gpu

TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1e-2, 5e-2)}
DTYPES = [torch.float32, torch.float16, BF16]


def _run(device, gen, dtype, q_lens, seq_lens, hq, hkv, d, page, num_blocks=None, pad_tokens=0,
         strided=False, config=None, chunk_tma=None, hopper=None):
    """pad_tokens NaN query / key / value rows after the last request's rows (they belong to no request);
    strided: q, k and v are slices of one qkv-like buffer row, as in the model."""
    assert all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    num_blocks = num_blocks or sum(-(-n // page) for n in seq_lens) + 8
    kv = PagedKV(seq_lens, num_blocks, page, hkv, d, dtype, device, gen)
    total = sum(q_lens)
    width = hq + 2 if strided else hq
    buf = torch.randn(total + pad_tokens, width, d, device=device).to(dtype)
    buf[total:] = float("nan")
    query = buf[:, 1 : hq + 1] if strided else buf
    key, value = kv.chunk_rows(q_lens, pad_tokens, width=hkv + 2 if strided else None)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    args = (query, key, value, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, max(q_lens),
            d**-0.5)
    if config is None and chunk_tma is None and hopper is None:
        out = triton_impl("prefill_attention")(*args)
    else:
        from fastllm.kernels.prefill_attention import prefill_attention_config

        out = prefill_attention_config(*args, config=config, chunk_tma=chunk_tma, hopper=hopper)
    assert out.dtype == dtype and out.shape == query.shape
    ref = attention_oracle(query[:total], kv, qsl)
    assert_close(out[:total], ref, *TOL[dtype], what=f"prefill q={q_lens} s={seq_lens}")


def _configs(head_dim):
    """The table's config, and tiles where one query tile spans several key tiles (and the reverse)."""
    from fastllm.kernels.prefill_attention import PrefillConfig, choose_config

    configs = [choose_config(head_dim, 4, torch.float16), PrefillConfig(128, 16, 4, 2)]
    configs.append(PrefillConfig(64, 128, 4, 2) if head_dim <= 128 else PrefillConfig(64, 64, 8, 1))
    return [pytest.param(c, id="BM{}-BN{}-w{}-s{}".format(*c)) for c in configs]


# (q_lens, seq_lens, Hq, Hkv, head_dim, block_size)
CASES = [
    ([37], [37], 4, 4, 64, 16),  # plain prefill, MHA
    ([16, 17, 1], [16, 17, 1], 8, 2, 64, 16),  # block boundaries, GQA 4, a 1-token prompt
    ([20, 33], [100, 97], 8, 2, 64, 16),  # chunked prefill: cached prefix + chunk
    ([1, 0, 25, 1, 3], [50, 9, 25, 1, 40], 16, 2, 128, 32),  # decode rows + empty + prefill + verify, GQA 8
    ([9, 2], [30, 2], 4, 1, 8, 8),  # head dim 8, block size 8
    ([13, 6], [13, 20], 6, 2, 80, 16),  # head dim 80, group of 3
    ([100, 50], [110, 50], 14, 2, 64, 16),  # group 7: 18-token tiles + 2 pad rows; a tile ends at key 64
    ([150], [220], 8, 2, 64, 16),  # several query tiles and unmasked key tiles before the diagonal
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,seq_lens,hq,hkv,d,page", CASES)
def test_prefill_matches_reference(device, gen, dtype, q_lens, seq_lens, hq, hkv, d, page):
    _run(device, gen, dtype, q_lens, seq_lens, hq, hkv, d, page)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("d", [8, 64, 128])
def test_prefill_grid(device, gen, dtype, hq, hkv, page, d):
    # a full prompt ending one past a block, a chunk over a cached prefix of exactly one block,
    # a decode row, an empty request and a 3-token verify chunk, all in one launch
    q_lens = [page + 1, 2 * page - 3, 1, 0, 3]
    seq_lens = [page + 1, 3 * page - 3, 2 * page, 5, 37]
    _run(device, gen, dtype, q_lens, seq_lens, hq, hkv, d, page)


def test_prefill_padding_tokens_and_strided_qkv(device, gen):
    # rows past query_start_loc[-1] (NaN) are nobody's; q, k, v are strided slices of qkv-like buffers
    _run(device, gen, torch.float16, [5, 12], [40, 12], 8, 2, 64, 16, pad_tokens=3, strided=True)


def test_prefill_head_dim_96(device, gen):
    _run(device, gen, torch.float16, [11, 3], [11, 70], 4, 2, 96, 32)


@pytest.mark.parametrize("config", _configs(64))
def test_prefill_configs(device, gen, config):
    # several query tiles, unmasked key tiles before the diagonal, chunks over a cached prefix, a decode row,
    # an empty request, group 4
    _run(device, gen, torch.float16, [150, 33, 1, 0], [220, 100, 50, 9], 8, 2, 64, 16, config=config)


@pytest.mark.parametrize("chunk_tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("config", _configs(256))
def test_prefill_configs_head_dim_256(device, gen, config, chunk_tma):
    _run(device, gen, torch.float16, [70, 1], [100, 30], 4, 2, 256, 16, config=config, chunk_tma=chunk_tma)


@pytest.mark.parametrize("chunk_tma", [False, True], ids=["pointers", "tma"])
def test_prefill_reads_the_chunk_from_key_value(device, gen, chunk_tma):
    # the chunk's own cache slots are poisoned after the reference ran: only the prefix may come from the
    # cache, the chunk must come from key / value
    from fastllm.kernels.prefill_attention import prefill_attention_config

    q_lens, seq_lens = [70, 5, 1], [70, 60, 33]
    kv = PagedKV(seq_lens, 32, 16, 2, 64, torch.float16, device, gen)
    query = torch.randn(sum(q_lens), 8, 64, device=device).half()
    qsl = torch.tensor([0, 70, 75, 76], dtype=torch.int32, device=device)
    key, value = kv.chunk_rows(q_lens)
    ref = attention_oracle(query, kv, qsl)
    for cache in (kv.key_cache, kv.value_cache):
        cache.view(-1, 2, 64)[kv.chunk_slots(q_lens)] = float("nan")
    out = prefill_attention_config(query, key, value, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                   qsl, 70, 64**-0.5, chunk_tma=chunk_tma)
    assert_close(out, ref, *TOL[torch.float16], what="chunk from key/value")


def test_prefill_forced_tma_checks_the_layout(device):
    from fastllm.kernels.prefill_attention import prefill_attention_config

    kv_rows = torch.zeros(4, 2, 2, 64, device=device).half()[:, :, 0]  # heads not packed: stride(1) != D
    cache = torch.zeros(4, 16, 2, 64, device=device).half()
    with pytest.raises(AssertionError):
        prefill_attention_config(torch.zeros(4, 8, 64, device=device).half(), kv_rows, kv_rows, cache, cache,
                                 torch.zeros(1, 1, dtype=torch.int32, device=device),
                                 torch.tensor([4], dtype=torch.int32, device=device),
                                 torch.tensor([0, 4], dtype=torch.int32, device=device), 4, 0.125, chunk_tma=True)


# The TMA path (chunk tiles through tensor descriptors) is what an sm_90 GPU runs; the interpreter runs it too.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", _configs(64))
def test_prefill_chunk_tma(device, gen, dtype, config):
    # a prompt whose last key tiles run past its end into the next request's rows and the NaN padding:
    # those keys must stay masked and their V rows zeroed
    _run(device, gen, dtype, [150, 33, 1, 0, 70], [220, 100, 50, 9, 70], 8, 2, 64, 16, pad_tokens=5,
         strided=True, config=config, chunk_tma=True)


def test_prefill_choose_config():
    from fastllm.kernels.prefill_attention import choose_config

    assert choose_config(128, 4, torch.bfloat16) == (64, 64, 4, 3)  # measured best on an H100
    assert choose_config(128, 4, torch.float32).num_stages == 2  # fp32 tiles: half the stages fit
    assert choose_config(64, 32, torch.float16).block_m == 64 and choose_config(64, 128, torch.float16).block_m == 128
    assert choose_config(256, 8, torch.bfloat16).block_n == 32


def test_prefill_chunk_tma_only_for_large_steps():
    from fastllm.kernels.prefill_attention import TMA_MIN_TOKENS, _tma_pays

    assert not _tma_pays(TMA_MIN_TOKENS - 1) and _tma_pays(TMA_MIN_TOKENS)  # descriptor setup must pay off


def test_prefill_chunk_tma_needs_a_tma_layout(device):
    from fastllm.kernels.prefill_attention import _tma_layout_ok

    qkv = torch.zeros(4, 12, 64, device=device, dtype=torch.float16)
    assert _tma_layout_ok(qkv[:, 8:10], 64)  # k inside a fused qkv row: rows 12 * 64 * 2 bytes apart
    assert not _tma_layout_ok(torch.zeros(4, 2, 96, device=device, dtype=torch.float16), 96)  # box not 2^k
    assert not _tma_layout_ok(torch.zeros(4, 2, 8, device=device, dtype=torch.float16), 8)  # below 16 wide
    assert not _tma_layout_ok(torch.zeros(4, 2, 3, 64, device=device)[:, :, 0], 64)  # heads not packed


def test_prefill_all_empty(device, gen):
    kv = PagedKV([4, 7], 8, 16, 2, 64, torch.float16, device, gen)
    query = torch.randn(0, 4, 64, device=device).half()
    key = torch.randn(0, 2, 64, device=device).half()
    qsl = torch.zeros(3, dtype=torch.int32, device=device)
    out = triton_impl("prefill_attention")(
        query, key, key, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, 0, 0.125)
    assert out.shape == (0, 4, 64)


# ---- full matrix on a real GPU ----
def _mixed(n, seed):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, 1025, (n,), generator=g)
    q = torch.minimum(seq, torch.randint(0, 300, (n,), generator=g))
    q[::4] = 1  # decode rows
    return q.tolist(), seq.tolist()


GPU_CASES = [
    ([4096], [4096]),
    ([2048] * 8, [2048] * 8),
    ([512, 1, 1, 1000, 4, 0], [4096, 3000, 17, 2024, 4, 9]),
    _mixed(64, 0),
    _mixed(16, 1),
]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens,seq_lens", GPU_CASES, ids=lambda v: f"B{len(v)}max{max(v)}")
@pytest.mark.parametrize("hq,hkv,d,page",
                         [(32, 8, 128, 16), (32, 32, 128, 32), (16, 8, 64, 16), (28, 4, 128, 128)])
def test_prefill_gpu(device, gen, dtype, q_lens, seq_lens, hq, hkv, d, page):
    num_blocks = 32768 if hkv * page <= 256 else 16384  # 32768 x 16 x 8 x 128 = 2^29 elements per cache
    _run(device, gen, dtype, q_lens, seq_lens, hq, hkv, d, page, num_blocks=num_blocks)


@gpu
@pytest.mark.parametrize("config", _configs(128))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,page", [(32, 8, 16), (28, 4, 128), (32, 32, 32)])
@pytest.mark.parametrize("chunk_tma", [True, False], ids=["tma", "pointers"])
def test_prefill_gpu_configs(device, gen, config, dtype, hq, hkv, page, chunk_tma):
    # long prompts, chunks, decode rows and an empty request, NaN padding rows, q/k/v inside a qkv row
    q_lens, seq_lens = [512, 1, 1, 1000, 4, 0, 300], [4096, 3000, 17, 2024, 4, 9, 300]
    _run(device, gen, dtype, q_lens, seq_lens, hq, hkv, 128, page, num_blocks=4096, pad_tokens=7, strided=True,
         config=config, chunk_tma=chunk_tma)


@gpu
@pytest.mark.parametrize("chunk_tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("config", _configs(256))
def test_prefill_gpu_configs_head_dim_256(device, gen, config, chunk_tma):
    _run(device, gen, torch.bfloat16, [700, 1, 64], [900, 50, 64], 16, 8, 256, 16, num_blocks=4096,
         config=config, chunk_tma=chunk_tma)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

# The Gluon kernel (sm_90 only) on the same matrix. The default path gives it steps of TMA_MIN_TOKENS or more;
# here it takes every case, down to single decode rows and empty requests, with both key-tile widths.
hopper_only = pytest.mark.skipif(not HOPPER, reason="the Gluon prefill kernel needs an sm_90 GPU")


@pytest.fixture(params=[64, 128], ids=lambda n: f"BN{n}")
def hopper_key_tile(request, monkeypatch):
    """Make the Gluon kernel pick this key-tile width whatever the step's query length."""
    from fastllm.kernels import prefill_attention_hopper

    monkeypatch.setattr(prefill_attention_hopper, "LONG_QUERY", 0 if request.param == 128 else 1 << 30)
    return request.param


@gpu
@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens,seq_lens", GPU_CASES, ids=lambda v: f"B{len(v)}max{max(v)}")
@pytest.mark.parametrize("hq,hkv,d,page",
                         [(32, 8, 128, 16), (32, 32, 128, 32), (16, 8, 64, 16), (28, 4, 128, 128), (12, 2, 64, 64)])
def test_prefill_gpu_hopper(device, gen, dtype, q_lens, seq_lens, hq, hkv, d, page, hopper_key_tile):
    num_blocks = 32768 if hkv * page <= 256 else 16384
    _run(device, gen, dtype, q_lens, seq_lens, hq, hkv, d, page, num_blocks=num_blocks, hopper=True)


@gpu
@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,page", [(32, 8, 16), (28, 4, 128), (32, 32, 32), (56, 1, 16)])
def test_prefill_gpu_hopper_nan_padding_and_strided_qkv(device, gen, dtype, hq, hkv, page,
                                                        hopper_key_tile):
    # NaN padding rows, NaN in unused cache blocks (PagedKV), q/k/v inside one qkv row; GQA 56
    q_lens, seq_lens = [512, 1, 1, 1000, 4, 0, 300, 77], [4096, 3000, 17, 2024, 4, 9, 300, 1077]
    _run(device, gen, dtype, q_lens, seq_lens, hq, hkv, 128, page, num_blocks=4096, pad_tokens=7, strided=True,
         hopper=True)


@gpu
def test_prefill_gpu_default_kernel(device):
    from fastllm.kernels.prefill_attention import TMA_MIN_TOKENS, _use_hopper_kernel

    qkv = torch.zeros(TMA_MIN_TOKENS, 48, 128, device=device, dtype=torch.bfloat16)
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:48]
    cache = torch.zeros(8, 16, 8, 128, device=device, dtype=torch.bfloat16)
    def use(q, k, v, key_cache, value_cache, masks_keys=False, tile_map=False):
        return _use_hopper_kernel(q, k, v, key_cache, value_cache, masks_keys, tile_map)

    assert use(q, k, v, cache, cache) == HOPPER
    assert not use(q[:-1], k[:-1], v[:-1], cache, cache)  # a small step: descriptors cost more
    assert not use(q.float(), k.float(), v.float(), cache.float(), cache.float())  # fp32
    assert not use(q, k, v, cache, cache, masks_keys=True)  # window, key start or LSE: Triton
    assert not use(q, k, v, cache, cache, tile_map=True)  # a mixed step's CUDA graph: Triton
    fp8_cache = cache.to(torch.float8_e4m3fn)
    assert not use(q, k, v, fp8_cache, fp8_cache)  # an FP8 KV cache: Triton
    d96 = torch.zeros(TMA_MIN_TOKENS, 12, 96, device=device, dtype=torch.bfloat16)
    cache96 = torch.zeros(8, 16, 2, 96, device=device, dtype=torch.bfloat16)
    assert not use(d96[:, :8], d96[:, 8:10], d96[:, 10:], cache96, cache96)  # head_dim 96


@gpu
def test_prefill_gpu_uses_tma_on_hopper(device):
    from fastllm.kernels.prefill_attention import use_chunk_tma

    qkv = torch.zeros(4, 48, 128, device=device, dtype=torch.bfloat16)
    expected = torch.cuda.get_device_capability()[0] >= 9
    assert use_chunk_tma(qkv[:, 32:40], qkv[:, 40:48]) == expected


@gpu
def test_prefill_gpu_int64_offsets(device, gen):
    # 2^32 elements per cache: block * stride overflows int32 for block ids >= 16384
    _run(device, gen, torch.bfloat16, [700, 1, 64], [3000, 1, 129], 32, 8, 128, 128, num_blocks=32768)
