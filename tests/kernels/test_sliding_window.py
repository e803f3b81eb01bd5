"""Sliding-window attention in the Triton kernels vs the references (decode, fused rotary decode, prefill).

The row at position p sees keys p - window < k <= p (Hugging Face's sliding window). Blocks that lie wholly
below every row's window are "freed" here as the engine frees them: their block-table entries point at the
NaN-poisoned block, so a kernel that reads one (table entry or slot) gives NaN instead of passing by luck.
Tolerances are the decode / prefill tables (test_paged_decode_attention.TOL).
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import reference_impl, triton_impl
from tests.kernels.kernel_testing import PagedKV, assert_close, assert_lse_close, gpu
from tests.kernels.test_paged_decode_attention import TOL


def free_blocks_below(kv: PagedKV, first_keys: list[int]) -> int:
    """Point request i's table entries of blocks wholly below first_keys[i] at the poison block; returns
    how many were freed (a test that frees none would not test the skipping)."""
    freed = 0
    for i, first in enumerate(first_keys):
        n = max(0, first) // kv.block_size
        kv.block_tables[i, :n] = kv.poison_block
        freed += n
    return freed


def _decode(device, gen, dtype, seq_lens, window, hq=8, hkv=2, d=64, page=16, num_splits=None, tile=None,
            merge_in_kernel=True, return_lse=False):
    kv = PagedKV(seq_lens, sum(-(-n // page) for n in seq_lens) + 8, page, hkv, d, dtype, device, gen)
    ref_kv = (kv.key_cache.float(), kv.value_cache.float(), kv.block_tables.clone())  # before the freeing
    freed = free_blocks_below(kv, [n - window for n in seq_lens])
    query = torch.randn(len(seq_lens), hq, d, device=device).to(dtype)
    max_seq_len = max(seq_lens)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, max_seq_len, d**-0.5)
    if num_splits is None:
        out = triton_impl("paged_decode_attention")(*args, window, None, return_lse)
    else:
        from fastllm.kernels.paged_decode_attention import paged_decode_attention_splits

        block_n, num_warps, num_stages = tile or (None, 4, 2)
        out = paged_decode_attention_splits(*args, num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                                            num_stages=num_stages, merge_in_kernel=merge_in_kernel, window=window,
                                            return_lse=return_lse)
    ref = reference_impl("paged_decode_attention")(query.float(), *ref_kv, kv.seq_lens, max_seq_len, d**-0.5, window,
                                                   None, return_lse)
    if return_lse:
        (out, lse), (ref, ref_lse) = out, ref
        assert_lse_close(lse, ref_lse)
    assert_close(out, ref, *TOL[dtype], what=f"decode lens={seq_lens} window={window}")
    return freed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 5, 16, 33, 100, 4096])
def test_decode_window(device, gen, dtype, window):
    freed = _decode(device, gen, dtype, [300, 1, 64, 129, 17], window)
    assert freed > 0 or window >= 300


@pytest.mark.parametrize("num_splits,merge_in_kernel", [(2, True), (5, True), (7, False)])
@pytest.mark.parametrize("tile", [(16, 2, 2), (64, 4, 2), (128, 4, 3)], ids=["BN16", "BN64", "BN128"])
def test_decode_window_splits(device, gen, num_splits, merge_in_kernel, tile):
    # a window start inside a tile (masked first tile), splits of the window only, and short requests
    assert _decode(device, gen, torch.float16, [700, 3, 150, 129], 70, num_splits=num_splits, tile=tile,
                   merge_in_kernel=merge_in_kernel) > 0


@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_window_lse(device, gen, num_splits):
    _decode(device, gen, torch.float32, [300, 1, 64, 129, 0], 40, num_splits=num_splits, return_lse=True)


def test_decode_window_bounds_the_launch():
    # the split count follows the window, not the context (the 16k-context decode reads what 4k does)
    from fastllm.kernels.paged_decode_attention import choose_config

    chosen = []
    for bound in (4096, 16384, 32768):
        import fastllm.kernels.paged_decode_attention as pda

        captured = {}
        real = pda.choose_config

        def spy(max_seq_len, *args, **kwargs):
            captured["bound"] = max_seq_len
            return real(max_seq_len, *args, **kwargs)

        pda.choose_config = spy
        try:
            q = torch.zeros(1, 8, 64)
            kv = torch.zeros(4, 16, 2, 64)
            pda.launch_chosen(q, kv, kv, torch.zeros(1, 1, dtype=torch.int32),
                              torch.zeros(1, dtype=torch.int32), bound, 0.125, window=4096)
        finally:
            pda.choose_config = real
        chosen.append(choose_config(captured["bound"], 1, 8, 128, num_sms=132))
    assert chosen[0] == chosen[1] == chosen[2], chosen


def _rotary_decode(device, gen, dtype, seq_lens, window, hq=8, hkv=2, d=32, page=8):
    from tests.kernels.test_rotary import _cos_sin_cache

    kv = PagedKV(seq_lens, sum(-(-n // page) for n in seq_lens) + 8, page, hkv, d, dtype, device, gen)
    batch = len(seq_lens)
    lens = torch.tensor(seq_lens)
    query = torch.randn(batch, hq, d, device=device).to(dtype)
    key = torch.randn(batch, hkv, d, device=device).to(dtype)
    value = torch.randn(batch, hkv, d, device=device).to(dtype)
    table = kv.block_tables.cpu().long()
    slots = (table[torch.arange(batch), (lens - 1) // page] * page + (lens - 1) % page).to(device)
    ref_caches = (kv.key_cache.float(), kv.value_cache.float())
    ref_table = kv.block_tables.clone()
    assert free_blocks_below(kv, [n - window for n in seq_lens]) > 0
    cos_sin = _cos_sin_cache(int(lens.max()) + 1, d, device)
    positions = (lens - 1).to(device)
    tail = (kv.seq_lens, int(lens.max()), d**-0.5, window)
    out = triton_impl("rotary_decode_attention")(positions, query, key, value, cos_sin, True, kv.key_cache,
                                                 kv.value_cache, slots, kv.block_tables, *tail)
    ref = reference_impl("rotary_decode_attention")(positions, query.float(), key.float(), value.float(), cos_sin,
                                                    True, *ref_caches, slots, ref_table, *tail)
    assert_close(out, ref, *TOL[dtype], what=f"rotary decode window={window}")


@pytest.mark.parametrize("window", [1, 7, 20])
def test_rotary_decode_window(device, gen, window):
    _rotary_decode(device, gen, torch.float32, [90, 21, 8, 40], window)


def _prefill(device, gen, dtype, q_lens, seq_lens, window, hq=8, hkv=2, d=32, page=8, config=None,
             chunk_tma=None, return_lse=False):
    from fastllm.kernels.prefill_attention import prefill_attention_config

    kv = PagedKV(seq_lens, sum(-(-n // page) for n in seq_lens) + 8, page, hkv, d, dtype, device, gen)
    query = torch.randn(sum(q_lens), hq, d, device=device).to(dtype)
    key, value = kv.chunk_rows(q_lens)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    k, v, table = kv.compact_float()  # the oracle reads the cache before the freeing
    ref = reference_impl("prefill_attention")(query.float(), key.float(), value.float(), k, v, table, kv.seq_lens,
                                              qsl, max(q_lens), d**-0.5, window, None, return_lse)
    free_blocks_below(kv, [s - q - window + 1 for q, s in zip(q_lens, seq_lens)])
    out = prefill_attention_config(query, key, value, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                   qsl, max(q_lens), d**-0.5, config=config, chunk_tma=chunk_tma, window=window,
                                   return_lse=return_lse)
    if return_lse:
        (out, lse), (ref, ref_lse) = out, ref
        assert_lse_close(lse, ref_lse)
    assert_close(out, ref, *TOL[dtype], what=f"prefill q={q_lens} s={seq_lens} window={window}")


# (q_lens, seq_lens): plain prefill, chunks over a cached prefix, decode rows, and a chunk longer than a tile
PREFILL_CASES = [([37], [37]), ([20, 33, 1], [100, 97, 60]), ([150, 1, 5], [220, 80, 5])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 6, 32, 70, 1000])
@pytest.mark.parametrize("q_lens,seq_lens", PREFILL_CASES)
def test_prefill_window(device, gen, dtype, window, q_lens, seq_lens):
    _prefill(device, gen, dtype, q_lens, seq_lens, window)


@pytest.mark.parametrize("config", [(16, 16, 4, 2), (64, 128, 4, 2), (128, 16, 4, 2)],
                         ids=["BM16-BN16", "BM64-BN128", "BM128-BN16"])
@pytest.mark.parametrize("chunk_tma", [False, True], ids=["pointers", "tma"])
def test_prefill_window_tiles(device, gen, config, chunk_tma):
    # windows that start inside a tile, span several, and are shorter than one query tile
    from fastllm.kernels.prefill_attention import PrefillConfig

    for window in (5, 40):
        _prefill(device, gen, torch.float16, [150, 9], [230, 30], window, config=PrefillConfig(*config),
                 chunk_tma=chunk_tma)


def test_prefill_window_lse(device, gen):
    _prefill(device, gen, torch.float32, [20, 33, 1], [100, 97, 60], 17, return_lse=True)


def test_prefill_window_skips_the_hopper_kernel(device, monkeypatch):
    # a window (or a key start, or the LSE) sends a step to the Triton kernel, and the log says so once
    import fastllm.kernels.prefill_attention as pa

    monkeypatch.setattr(pa.prefill_attention_hopper, "unsupported", lambda *args: None)  # as on an H100
    monkeypatch.setattr(pa, "_tma_layout_ok", lambda rows, head_dim: True)
    rows = torch.zeros(4, 2, 64)
    why = pa._hopper_unsupported(rows, rows, rows, rows, rows, masks_keys=True)
    assert why is not None and "window" in why
    assert pa._hopper_unsupported(rows, rows, rows, rows, rows, masks_keys=False) is None


# ---- on a real GPU ----


@gpu
@pytest.mark.parametrize("window", [4096, 1000, 64])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_window_gpu(device, gen, window, batch):
    lens = torch.randint(1, 16385, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    lens[0] = 16384
    _decode(device, gen, torch.bfloat16, lens, window, hq=32, hkv=8, d=128, page=16)


@gpu
@pytest.mark.parametrize("window", [4096, 100])
def test_prefill_window_gpu(device, gen, window):
    _prefill(device, gen, torch.bfloat16, [2048, 512, 1, 1], [2048, 6000, 5000, 17], window, hq=32, hkv=8, d=128,
             page=16)


@gpu
def test_rotary_decode_window_gpu(device, gen):
    _rotary_decode(device, gen, torch.bfloat16, [16384, 5000, 4097, 4096, 3], 4096, hq=32, hkv=8, d=128, page=16)
