"""A speculative step's attention as decode rows (metadata.token_rows) against the same step through the
prefill kernel: each request's few new tokens, one decode row per token, give the same output and write
the same cache. On a GPU the Triton kernels run, on the CPU the references (the layer's dispatch).

The cache is PagedKV's: NaN wherever no request owns a slot, so a row that reads a key past its own
position, or a slot of another request, gives NaN."""

from __future__ import annotations

import pytest
import torch

from fastllm.layers.attention import Attention
from fastllm.layers.rotary import RotaryEmbedding
from fastllm.worker.attn_metadata import AttentionMetadata, TokenRows, forward_context
from tests.kernels.kernel_testing import PagedKV, assert_close
from tests.kernels.test_paged_decode_attention import TOL

HQ, HKV, D, PAGE = 8, 2, 32, 16


def _step(layer, kv, q_lens, token_rows: bool, positions, query, key, value):
    key_cache, value_cache = kv.key_cache.clone(), kv.value_cache.clone()
    layer.bind_kv_cache((key_cache, value_cache))
    device = query.device
    q_len = q_lens[0]
    rows = None
    if token_rows:
        rows = TokenRows(kv.block_tables.repeat_interleave(q_len, dim=0), (positions + 1).to(torch.int32))
    metadata = AttentionMetadata(
        slot_mapping=kv.chunk_slots(q_lens), block_tables=kv.block_tables, seq_lens=kv.seq_lens,
        query_start_loc=torch.arange(0, (len(q_lens) + 1) * q_len, q_len, dtype=torch.int32, device=device),
        max_query_len=q_len, max_seq_len=max(kv.seq_lens_list), token_rows=rows)
    with forward_context(metadata, [layer]):
        out = layer.run(positions, query, key, value, *layer.norm_weights)
    return out, key_cache, value_cache


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q_len", [2, 5])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_token_rows_equal_the_prefill_kernel(device, gen, dtype, q_len, window, qk_norm):
    context = [0, 3, 16, 40]  # tokens in the cache before the step, per request
    kv = PagedKV([n + q_len for n in context], sum(-(-(n + q_len) // PAGE) for n in context) + 4, PAGE, HKV, D,
                 dtype, device, gen)
    rotary = RotaryEmbedding(D, 128, 10000.0, {}).to(device)
    layer = Attention(HQ, HKV, D, D ** -0.5, 0, rotary, sliding_window=window)
    layer.norm_weights = (torch.rand(D, device=device).to(dtype) + 0.5, torch.rand(D, device=device).to(dtype) + 0.5) \
        if qk_norm else ()
    tokens = len(context) * q_len
    positions = torch.cat([torch.arange(n, n + q_len) for n in context]).to(device)
    query, key, value = (torch.randn(tokens, h, D, device=device).to(dtype) for h in (HQ, HKV, HKV))

    ref, ref_k, ref_v = _step(layer, kv, [q_len] * len(context), False, positions, query, key, value)
    out, k, v = _step(layer, kv, [q_len] * len(context), True, positions, query, key, value)

    assert_close(out.float(), ref.float(), *TOL[dtype], what=f"q_len={q_len} window={window}")
    for cache, ref_cache in ((k, ref_k), (v, ref_v)):  # the same writes (NaN where neither wrote)
        assert torch.equal(cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))
