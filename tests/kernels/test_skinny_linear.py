"""Triton skinny_linear (decode-batch projections) against float32 math.

Tolerances (||out - ref|| / ||ref||, ref = F.linear in float64 on the same inputs):
    float32  2 * sqrt(K) * 2^-24   (fp32 accumulation: rounding errors of random sign grow as sqrt(K))
    float16  2e-3                  (the output rounded once to fp16)
    bfloat16 8e-3                  (the same in bf16, 8x coarser; measured 1.7e-3 on the H100); GPU only
Outputs start as NaN, so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastllm.kernels import skinny_linear as S
from fastllm.kernels import triton_impl
from tests.kernels.kernel_testing import bucket_edges, gpu, rel_err

TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3}


def tolerance(dtype: torch.dtype, k_in: int) -> float:
    return 2 * k_in ** 0.5 * 2.0 ** -24 if dtype == torch.float32 else TOL[dtype]


def _check(device, dtype, rows, n_out, k_in, cfg=None, bias=False):
    x = torch.randn(rows, k_in, device=device).to(dtype)
    w = (torch.randn(n_out, k_in, device=device) / k_in ** 0.5).to(dtype)
    b = torch.randn(n_out, device=device).to(dtype) if bias else None
    out = torch.full((rows, n_out), float("nan"), device=device, dtype=dtype)
    y = S.launch(x, w, b, config=cfg, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    assert rel_err(y, ref) <= tolerance(dtype, k_in), (cfg, rel_err(y, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n_out,k_in", [(1, 40, 64), (1, 100, 200), (3, 64, 96), (16, 33, 128), (32, 70, 256)])
@pytest.mark.parametrize("cfg", [S.Config(32, 64, 4, 2, True), S.Config(16, 64, 4, 2, False), None,
                                 S.Config(32, 32, 4, 2, True, split_k=3), S.Config(16, 32, 4, 2, False, split_k=4)],
                         ids=["dot", "fma-one-row", "chosen", "dot-split3", "fma-one-row-split4"])
def test_matches_float32(device, dtype, rows, n_out, k_in, cfg):
    """(Split K: K = 64 in 32-wide tiles over 3 or 4 programs leaves some with an empty share.)"""
    _check(device, dtype, rows, n_out, k_in, cfg, bias=rows % 2 == 1)


@pytest.mark.parametrize("split_k", [2, 5])
def test_split_k_sums_in_a_fixed_order_and_leaves_its_counters_zero(device, split_k):
    from fastllm.kernels.split_counters import split_counters

    x, w = torch.randn(3, 300, device=device), torch.randn(70, 300, device=device)
    cfg = S.Config(32, 32, 4, 2, True, split_k=split_k)
    first = S.launch(x, w, config=cfg)
    assert torch.equal(S.launch(x, w, config=cfg), first)
    assert not split_counters("skinny linear", x.device, 1).any()


def test_linear_entry_point(device):
    """linear(): the kernel up to MAX_ROWS rows, cuBLAS beyond (same results), into `out` too."""
    w = torch.randn(48, 80, device=device).half()
    b = torch.randn(48, device=device).half()
    for rows in (1, S.MAX_ROWS, S.MAX_ROWS + 1):
        x = torch.randn(rows, 80, device=device).half()
        out = torch.full((rows, 48), float("nan"), device=device).half()
        assert triton_impl("linear")(x, w, b, out).data_ptr() == out.data_ptr()
        assert rel_err(out, F.linear(x.float(), w.float(), b.float())) <= TOL[torch.float16]
        assert rel_err(triton_impl("linear")(x, w, None), F.linear(x.float(), w.float())) <= TOL[torch.float16]


def test_fp32_configs_fit_shared_memory():
    """fp32 halves BLOCK_K: the same tile bytes as the bf16 config the sweep chose."""
    assert S.choose_config(8, 4096, 14336, 4).block_k * 4 == S.choose_config(8, 4096, 14336, 2).block_k * 2


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 16, 32])
@pytest.mark.parametrize("n_out,k_in", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                        (1000, 1000)])
def test_llama_shapes_gpu(dtype, rows, n_out, k_in):
    _check("cuda", dtype, rows, n_out, k_in)  # the chosen config


@gpu
@pytest.mark.parametrize("cfg", [S.Config(32, 256, 4, 4, True, prefetch_k=512),
                                 S.Config(16, 1024, 4, 3, False, prefetch_k=2048)])
def test_pdl_options_gpu(cfg):
    for rows in (1, 8):
        _check("cuda", torch.bfloat16, rows, 4096, 4096, cfg, bias=True)


def test_small_weights_prefetch_a_quarter_of_k_under_pdl_triggers(monkeypatch):
    """Under early triggers a weight of <= 16 MiB (Qwen3-0.6B's) prefetches a quarter of each program's K;
    larger ones (Llama-3.1-8B's), or no triggers, prefetch nothing."""
    assert S.choose_config(1, 4096, 1024, 2, triggers=True).prefetch_k == 256
    assert S.choose_config(8, 6144, 1024, 2, triggers=True).prefetch_k == 256
    monkeypatch.setitem(S._TUNED, (1, 96, 4096), S.Config(8, 1024, 4, 2, False, split_k=2))
    assert S.choose_config(1, 96, 4096, 2, triggers=True).prefetch_k == 512  # a quarter of the split's K
    assert S.choose_config(1, 4096, 1024, 2, triggers=False).prefetch_k == 0
    assert S.choose_config(8, 6144, 4096, 2, triggers=True).prefetch_k == 0  # 48 MiB
    assert S.choose_config(1, 4096, 4096, 4, triggers=True).prefetch_k == 0  # fp32: 64 MiB


def test_row_buckets():
    assert [S.row_bucket(rows) for rows in (1, 2, 8, 9, 16, 17, 32)] == [1, 8, 8, 16, 16, 32, 32]
    assert bucket_edges(1) == [1] and bucket_edges(32) == [17, 32]


@gpu
@pytest.mark.parametrize("key", sorted(S._TUNED), ids=lambda key: "x".join(map(str, key)))
def test_every_tuned_config_gpu(key):
    """Each measured config of the table, at the smallest and largest row count of its bucket."""
    bucket, n_out, k_in = key
    for rows in bucket_edges(bucket):
        _check("cuda", torch.bfloat16, rows, n_out, k_in)
