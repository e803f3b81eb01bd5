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
         strided_query=False, config=None):
    """pad_tokens NaN query rows after the last request's rows (they belong to no request)."""
    assert all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    num_blocks = num_blocks or sum(-(-n // page) for n in seq_lens) + 8
    kv = PagedKV(seq_lens, num_blocks, page, hkv, d, dtype, device, gen)
    total = sum(q_lens)
    width = hq + 2 if strided_query else hq
    buf = torch.randn(total + pad_tokens, width, d, device=device).to(dtype)
    buf[total:] = float("nan")
    query = buf[:, 1 : hq + 1] if strided_query else buf
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, max(q_lens), d**-0.5)
    if config is None:
        out = triton_impl("prefill_attention")(*args)
    else:
        from fastllm.kernels.prefill_attention import prefill_attention_config

        out = prefill_attention_config(*args, config=config)
    assert out.dtype == dtype and out.shape == query.shape
    ref = attention_oracle(query[:total], kv, qsl)
    assert_close(out[:total], ref, *TOL[dtype], what=f"prefill q={q_lens} s={seq_lens}")


def _configs(head_dim):
    from fastllm.kernels.prefill_attention import CONFIGS_HEAD_DIM_128, CONFIGS_HEAD_DIM_256

    configs = CONFIGS_HEAD_DIM_128 if head_dim <= 128 else CONFIGS_HEAD_DIM_256
    return [pytest.param(c, id="BM{BLOCK_M}-BN{BLOCK_N}".format(**c.kwargs) + f"-w{c.num_warps}-s{c.num_stages}")
            for c in configs]


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


def test_prefill_padding_tokens_and_strided_query(device, gen):
    # rows past query_start_loc[-1] (NaN) are nobody's; q is a strided slice of a qkv-like buffer
    _run(device, gen, torch.float16, [5, 12], [40, 12], 8, 2, 64, 16, pad_tokens=3, strided_query=True)


def test_prefill_head_dim_96(device, gen):
    _run(device, gen, torch.float16, [11, 3], [11, 70], 4, 2, 96, 32)


@pytest.mark.parametrize("config", _configs(64))
def test_prefill_every_candidate_config(device, gen, config):
    # each autotune candidate on its own: several query tiles, unmasked key tiles before the diagonal,
    # chunks over a cached prefix, a decode row, an empty request, group 4
    _run(device, gen, torch.float16, [150, 33, 1, 0], [220, 100, 50, 9], 8, 2, 64, 16, config=config)


@pytest.mark.parametrize("config", _configs(256))
def test_prefill_every_candidate_config_head_dim_256(device, gen, config):
    _run(device, gen, torch.float16, [70, 1], [100, 30], 4, 2, 256, 16, config=config)


def test_prefill_candidates_and_buckets():
    from fastllm.kernels.prefill_attention import CONFIGS_HEAD_DIM_128, candidate_configs, len_bucket

    assert candidate_configs(128, 4) == CONFIGS_HEAD_DIM_128  # the first one is the pre-tuning config
    assert all(c.kwargs["BLOCK_M"] >= 32 for c in candidate_configs(64, 32))  # a tile holds one token's heads
    lens = (1, 16, 17, 64, 65, 512, 2048, 8192, 20000)
    assert [len_bucket(n) for n in lens] == [16, 16, 32, 64, 128, 512, 2048, 8192, 16384]


def test_prefill_autotune_pick_is_cached(device, gen):
    # the first call of a (bucket, shape, dtype) key tunes (interpreter: the single pre-tuning candidate) and
    # records the pick; later calls of that key launch the plain kernel with it
    from fastllm.kernels.prefill_attention import candidate_configs, tuned_config

    _run(device, gen, torch.float16, [21, 7], [21, 30], 8, 2, 64, 16)
    picked = tuned_config(64, 4, 21, 16, torch.float16)
    assert picked is not None and picked in candidate_configs(64, 4)
    _run(device, gen, torch.float16, [30, 1], [60, 9], 8, 2, 64, 16)  # same bucket (32): the cached pick
    assert tuned_config(64, 4, 30, 16, torch.float16) is picked


def test_prefill_all_empty(device, gen):
    kv = PagedKV([4, 7], 8, 16, 2, 64, torch.float16, device, gen)
    query = torch.randn(0, 4, 64, device=device).half()
    qsl = torch.zeros(3, dtype=torch.int32, device=device)
    out = triton_impl("prefill_attention")(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, 0, 0.125)
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
def test_prefill_gpu_every_candidate_config(device, gen, config, dtype, hq, hkv, page):
    # each config autotune can pick, on a mix of long prompts, chunks, decode rows and an empty request
    q_lens, seq_lens = [512, 1, 1, 1000, 4, 0, 300], [4096, 3000, 17, 2024, 4, 9, 300]
    _run(device, gen, dtype, q_lens, seq_lens, hq, hkv, 128, page, num_blocks=4096, config=config)


@gpu
@pytest.mark.parametrize("config", _configs(256))
def test_prefill_gpu_every_candidate_config_head_dim_256(device, gen, config):
    _run(device, gen, torch.bfloat16, [700, 1, 64], [900, 50, 64], 16, 8, 256, 16, num_blocks=4096,
         config=config)


@gpu
def test_prefill_gpu_int64_offsets(device, gen):
    # 2^32 elements per cache: block * stride overflows int32 for block ids >= 16384
    _run(device, gen, torch.bfloat16, [700, 1, 64], [3000, 1, 129], 32, 8, 128, 128, num_blocks=32768)
