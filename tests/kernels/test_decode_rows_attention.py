"""A mixed step's leading decodes through the decode kernel (metadata.decode_rows) against the same step
through the prefill kernel alone: eagerly (the prefill kernel over the requests after the decodes) and as a
CUDA graph stages it (the decode kernel over fixed rows, 0 past the decodes, the tile map leaving the
decodes out) give the same output and write the same cache. On a GPU the Triton kernels run, on the CPU the
references (the layer's dispatch) and, in float32, the Triton kernels interpreted.

The cache is PagedKV's: NaN wherever no request owns a slot, so a row that reads a key past its own
position, or a slot of another request, gives NaN."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastllm.kernels.dispatch as dispatch
from fastllm.kernels import triton_impl
from fastllm.kernels.prefill_tiles import build_tile_map, max_tiles, query_tile_size
from fastllm.layers.attention import Attention
from fastllm.layers.rotary import RotaryEmbedding
from fastllm.worker.attn_metadata import AttentionMetadata, DecodeRows, forward_context, leading_decodes
from tests.kernels.kernel_testing import PagedKV, assert_close
from tests.kernels.test_paged_decode_attention import TOL

HQ, HKV, D, PAGE = 8, 2, 32, 16
CONTEXT = [5, 17, 40, 0, 12, 3]  # tokens in the cache before the step, per request
Q_LENS = [1, 1, 1, 9, 6, 1]  # three decodes lead; the last single token is a prefill's (it comes later)


def _step(layer, kv, mode: str, positions, query, key, value):
    key_cache, value_cache = kv.key_cache.clone(), kv.value_cache.clone()
    layer.bind_kv_cache((key_cache, value_cache))
    device = query.device
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(Q_LENS)]), dtype=torch.int32, device=device)
    decodes = leading_decodes(Q_LENS)
    rows = tile_map = None
    if mode == "eager":  # the rest's own (aligned) copies, as the step stages them
        rows = DecodeRows(decodes, kv.seq_lens[:decodes], kv.block_tables[decodes:].clone(),
                          kv.seq_lens[decodes:].clone(), qsl[decodes:].clone())
    elif mode == "graph":  # every request a row, 0 past the decodes; the tile map has the others' tiles only
        lens = kv.seq_lens.clone()
        lens[decodes:] = 0
        rows = DecodeRows(len(Q_LENS), lens)
        tiled = np.array(Q_LENS)
        tiled[:decodes] = 0
        block_q = query_tile_size(HQ // HKV)
        tile_map = torch.from_numpy(build_tile_map(tiled, np.array(kv.seq_lens_list), block_q,
                                                   max_tiles(sum(Q_LENS), len(Q_LENS), block_q))).to(device)
    metadata = AttentionMetadata(
        slot_mapping=kv.chunk_slots(Q_LENS), block_tables=kv.block_tables, seq_lens=kv.seq_lens,
        query_start_loc=qsl, max_query_len=max(Q_LENS), max_seq_len=max(kv.seq_lens_list), tile_map=tile_map,
        decode_rows=rows)
    with forward_context(metadata, [layer]):
        out = layer.run(positions, query, key, value, *layer.norm_weights)
    return out, key_cache, value_cache


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("kernels", ["dispatch", "triton"])
def test_decode_rows_equal_the_prefill_kernel(device, gen, dtype, mode, window, qk_norm, kernels, monkeypatch):
    assert leading_decodes(Q_LENS) == 3
    if kernels == "triton":
        if device != "cpu" or dtype != torch.float32:
            pytest.skip("the layer dispatches to the Triton kernels on a GPU; the interpreter runs float32")
        for name in ("rotary_kv_cache_write", "prefill_attention", "paged_decode_attention"):
            monkeypatch.setitem(dispatch._chosen, (name, "cpu"), triton_impl(name))
    seq_lens = [n + q for n, q in zip(CONTEXT, Q_LENS)]
    kv = PagedKV(seq_lens, sum(-(-n // PAGE) for n in seq_lens) + 4, PAGE, HKV, D, dtype, device, gen)
    rotary = RotaryEmbedding(D, 128, 10000.0, {}).to(device)
    layer = Attention(HQ, HKV, D, D ** -0.5, 0, rotary, sliding_window=window)
    layer.norm_weights = (torch.rand(D, device=device).to(dtype) + 0.5, torch.rand(D, device=device).to(dtype) + 0.5) \
        if qk_norm else ()
    positions = torch.cat([torch.arange(n, n + q) for n, q in zip(CONTEXT, Q_LENS)]).to(device)
    tokens = sum(Q_LENS)
    query, key, value = (torch.randn(tokens, h, D, device=device).to(dtype) for h in (HQ, HKV, HKV))

    ref, ref_k, ref_v = _step(layer, kv, "none", positions, query, key, value)
    out, k, v = _step(layer, kv, mode, positions, query, key, value)

    assert not out.isnan().any()
    assert_close(out.float(), ref.float(), *TOL[dtype], what=f"{mode} window={window}")
    for cache, ref_cache in ((k, ref_k), (v, ref_v)):  # the same writes (NaN where neither wrote)
        assert torch.equal(cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))
