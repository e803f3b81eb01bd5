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
from tests.kernels.kernel_testing import bucket_edges, gpu, record_prologues, rel_err

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
@pytest.mark.parametrize("rows,n_out,k_in", [(1, 40, 64), (1, 100, 200), (3, 64, 96), (16, 33, 128),
                                             (32, 70, 256), (40, 150, 96), (64, 64, 128)])
@pytest.mark.parametrize("cfg", [S.Config(32, 64, 4, 2, True), S.Config(16, 64, 4, 2, False), None,
                                 S.Config(32, 32, 4, 2, True, split_k=3), S.Config(16, 32, 4, 2, False, split_k=4),
                                 S.Config(64, 32, 4, 2, True, swap_ab=True),
                                 S.Config(64, 32, 4, 2, True, split_k=3, swap_ab=True)],
                         ids=["dot", "fma-one-row", "chosen", "dot-split3", "fma-one-row-split4", "swapped",
                              "swapped-split3"])
def test_matches_float32(device, dtype, rows, n_out, k_in, cfg):
    """(Split K: K = 64 in 32-wide tiles over 3 or 4 programs leaves some with an empty share. The FMA
    configs hold one row: more rows take tl.dot with the config's tiles.)"""
    _check(device, dtype, rows, n_out, k_in, cfg, bias=rows % 2 == 1)


@pytest.mark.parametrize("split_k", [2, 5])
def test_split_k_sums_in_a_fixed_order_and_leaves_its_counters_zero(device, split_k):
    from fastllm.kernels.split_counters import split_counters

    x, w = torch.randn(3, 300, device=device), torch.randn(70, 300, device=device)
    cfg = S.Config(32, 32, 4, 2, True, split_k=split_k)
    first = S.launch(x, w, config=cfg)
    assert torch.equal(S.launch(x, w, config=cfg), first)
    assert not split_counters("skinny linear", x.device, 1).any()


def test_linear_entry_point(device, monkeypatch):
    """linear(): the kernel up to 32 rows, and up to MAX_ROWS for the shapes the table has measured there,
    cuBLAS beyond (same results), into `out` too."""
    monkeypatch.setitem(S._TUNED, (64, 48, 80), S.Config(64, 32, 4, 2, swap_ab=True))
    w = torch.randn(48, 80, device=device).half()
    b = torch.randn(48, device=device).half()
    for rows in (1, 32, 33, S.MAX_ROWS, S.MAX_ROWS + 1):
        x = torch.randn(rows, 80, device=device).half()
        out = torch.full((rows, 48), float("nan"), device=device).half()
        assert triton_impl("linear")(x, w, b, out).data_ptr() == out.data_ptr()
        assert rel_err(out, F.linear(x.float(), w.float(), b.float())) <= TOL[torch.float16]
        assert rel_err(triton_impl("linear")(x, w, None), F.linear(x.float(), w.float())) <= TOL[torch.float16]


def test_rows_past_32_take_the_kernel_only_where_measured(monkeypatch):
    monkeypatch.setitem(S._TUNED, (64, 48, 80), S.Config(64, 32, 4, 2, swap_ab=True))
    assert [S.measured_there(rows, 48, 80) for rows in (1, 32, 33, 64)] == [True] * 4
    assert [S.measured_there(rows, 48, 96) for rows in (1, 32, 33, 64)] == [True, True, False, False]
    x, w = torch.randn(40, 96), torch.randn(48, 96)
    launched = []
    monkeypatch.setattr(S, "launch", lambda *args, **kwargs: launched.append(args))
    assert torch.allclose(S.linear(x, w, None), F.linear(x, w)) and not launched  # cuBLAS (F.linear)


def test_fp32_configs_fit_shared_memory():
    """fp32 halves BLOCK_K: the same tile bytes as the bf16 config the sweep chose."""
    assert S.choose_config(8, 4096, 14336, 4).block_k * 4 == S.choose_config(8, 4096, 14336, 2).block_k * 2


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 16, 32, 40, 64])
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
    assert [S.row_bucket(rows) for rows in (1, 2, 8, 9, 16, 17, 32, 33, 64)] == [1, 8, 8, 16, 16, 32, 32, 64, 64]
    assert bucket_edges(1) == [1] and bucket_edges(32) == [17, 32] and bucket_edges(64) == [33, 64]


@gpu
@pytest.mark.parametrize("key", sorted(S._TUNED), ids=lambda key: "x".join(map(str, key)))
def test_every_tuned_config_gpu(key):
    """Each measured config of the table, at the smallest and largest row count of its bucket."""
    bucket, n_out, k_in = key
    for rows in bucket_edges(bucket):
        _check("cuda", torch.bfloat16, rows, n_out, k_in)


# The fused prologues against their unfused pair: the norm's or SiLU's reference, then F.linear in float64.
NORM_CONFIGS = [S.Config(16, 64, 4, 2, False), S.Config(8, 256, 8, 3, False)]
NORM_IDS = ["fma-16x64", "fma-8x256"]
SILU_CONFIGS, SILU_IDS = NORM_CONFIGS + [S.Config(16, 32, 4, 2, False, split_k=3)], NORM_IDS + ["fma-split3"]
FUSED_SHAPES = [(40, 64), (100, 200), (64, 96), (33, 1000)]


def _fused_inputs(device, dtype, rows, n_out, k_in, width):
    g = torch.Generator(device="cpu").manual_seed(rows * 1000 + k_in)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    return (rand(rows, width).to(dtype), (rand(n_out, k_in) / k_in ** 0.5).to(dtype), rand(n_out).to(dtype))


def _norm_inputs(device, dtype, k_in):
    """A one-row residual and an RMSNorm weight near 1 for the norm's prologue."""
    residual = (torch.randn(1, k_in, device=device) * 3).to(dtype)
    return residual, (1 + torch.randn(k_in, device=device) / 4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_out,k_in", FUSED_SHAPES)
@pytest.mark.parametrize("cfg", NORM_CONFIGS, ids=NORM_IDS)
def test_add_rms_norm_prologue_matches_the_norm_then_the_projection(device, dtype, n_out, k_in, cfg):
    """The projection of rms_norm(x + residual) (K = 200, 1000: partial last tiles), and x + residual
    exactly as fused_add_rms_norm rounds it. One row: the prologues' path."""
    from fastllm.kernels import reference

    rows = 1
    x, w, b = _fused_inputs(device, dtype, rows, n_out, k_in, k_in)
    residual, norm_w = _norm_inputs(device, dtype, k_in)
    bias = b if k_in % 3 else None
    out, res_out = S.launch_add_rms_norm(x, residual, norm_w, 1e-5, w, bias, config=cfg)
    normed, ref_res = reference.fused_add_rms_norm(x, residual, norm_w, 1e-5)
    assert torch.equal(res_out, ref_res)
    ref = F.linear(normed.double(), w.double(), bias.double() if bias is not None else None)
    assert rel_err(out, ref) <= tolerance(dtype, k_in), (cfg, rel_err(out, ref))


@pytest.mark.parametrize("n_out,k_in", FUSED_SHAPES)
@pytest.mark.parametrize("cfg", NORM_CONFIGS, ids=NORM_IDS)
def test_add_rms_norm_prologue_rounds_as_the_norm_kernel(device, n_out, k_in, cfg):
    """bf16 (the FMA path takes no tl.dot, so the interpreter runs it right): the fused projection against
    the norm kernel's output through the same config. The tiles round where the norm rounds (h / rms, then
    times w), so only the rms's sum order stands between them; rounding w * h instead gave ~2^-9."""
    from fastllm.kernels.fused_add_rms_norm import fused_add_rms_norm

    x, w, b = _fused_inputs(device, torch.bfloat16, 1, n_out, k_in, k_in)
    residual, norm_w = _norm_inputs(device, torch.bfloat16, k_in)
    out, _ = S.launch_add_rms_norm(x, residual, norm_w, 1e-5, w, b, config=cfg)
    normed, _ = fused_add_rms_norm(x, residual, norm_w, 1e-5)
    ref = S.launch(normed, w, b, config=cfg)
    assert rel_err(out, ref) <= 2 ** -12, (cfg, rel_err(out, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_out,k_in", FUSED_SHAPES)
@pytest.mark.parametrize("cfg", SILU_CONFIGS, ids=SILU_IDS)
def test_silu_and_mul_prologue_matches_the_activation_then_the_projection(device, dtype, n_out, k_in, cfg):
    from fastllm.kernels import reference

    rows = 1
    x, w, b = _fused_inputs(device, dtype, rows, n_out, k_in, 2 * k_in)
    x = x * 3  # gates well into SiLU's curve on both sides
    bias = b if k_in % 3 else None
    out = S.launch_silu_and_mul(x, w, bias, config=cfg)
    ref = F.linear(reference.silu_and_mul(x).double(), w.double(), None if bias is None else bias.double())
    assert rel_err(out, ref) <= tolerance(dtype, k_in), (cfg, rel_err(out, ref))


def test_prologues_refuse_the_dot_and_the_norm_split_k_and_the_ops_run_apart_there(device, monkeypatch):
    """Prologues run on the one-row FMA path, the norm's unsplit (program 0 alone stores x + residual):
    other configs are refused, and the fused ops run apart where the table chooses them, and for weights
    over SMALL_WEIGHT_BYTES."""
    x, w = torch.randn(1, 64, device=device), torch.randn(8, 64, device=device)
    norm_w = torch.ones(64, device=device)
    with pytest.raises(AssertionError, match="unsplit"):
        S.launch_add_rms_norm(x, x, norm_w, 1e-6, w, config=S.Config(8, 32, 4, 2, False, split_k=2))
    for rows, cfg in ((1, S.Config(16, 32, 4, 2, True)), (2, S.Config(8, 32, 4, 2, False))):
        with pytest.raises(AssertionError, match="FMA"):
            S.launch_silu_and_mul(torch.randn(rows, 128, device=device), w, config=cfg)
    assert S._fuses("add_rms_norm_linear", x, w, x, norm_w) and S._fuses("silu_and_mul_linear", x, w)
    monkeypatch.setitem(S._TUNED, (1, 8, 64), S.Config(8, 32, 4, 2, False, split_k=2))
    assert not S._fuses("add_rms_norm_linear", x, w, x, norm_w) and S._fuses("silu_and_mul_linear", x, w)
    monkeypatch.setitem(S._TUNED, (1, 8, 64), S.Config(16, 32, 4, 2, True))
    assert not S._fuses("add_rms_norm_linear", x, w, x, norm_w) and not S._fuses("silu_and_mul_linear", x, w)
    monkeypatch.delitem(S._TUNED, (1, 8, 64))
    monkeypatch.setattr(S, "SMALL_WEIGHT_BYTES", w.numel() * w.element_size() - 1)  # not latency-bound
    assert not S._fuses("add_rms_norm_linear", x, w, x, norm_w) and not S._fuses("silu_and_mul_linear", x, w)


def test_fused_ops_take_one_launch_at_decode_rows_and_two_above(device, monkeypatch, caplog):
    """add_rms_norm_linear / silu_and_mul_linear: the prologue kernel at one row, else the norm's or SiLU's
    kernel and the projection, said once in the log; the same results either way."""
    import logging

    from fastllm.kernels import reference

    launches = record_prologues(monkeypatch)
    w_qkv, w_down = torch.randn(48, 64, device=device), torch.randn(64, 32, device=device)
    norm_w = torch.rand(64, device=device) + 0.5
    caplog.set_level(logging.INFO, logger="fastllm.kernels")
    monkeypatch.setattr(S, "_logged", set())  # (logged once a process: maybe by an earlier test)
    for rows in (1, 2):
        launches.clear()
        x, residual, gate_up = (torch.randn(rows, 64, device=device), torch.randn(rows, 64, device=device),
                                torch.randn(rows, 64, device=device))
        out, res = triton_impl("add_rms_norm_linear")(x, residual, norm_w, 1e-6, w_qkv, None)
        ref, ref_res = reference.add_rms_norm_linear(x, residual, norm_w, 1e-6, w_qkv, None)
        assert torch.equal(res, ref_res) and rel_err(out, ref.double()) <= tolerance(torch.float32, 64)
        down = triton_impl("silu_and_mul_linear")(gate_up, w_down, None)
        assert rel_err(down, reference.silu_and_mul_linear(gate_up, w_down, None).double()) <= 1e-6
        fused = rows == 1
        want = [S.ADD_RMS_NORM, S.SILU_AND_MUL] if fused else [S.PLAIN, S.PLAIN]
        assert launches == want, (rows, launches)
    assert "two launches for batches of more than one row" in caplog.text


@gpu
@pytest.mark.parametrize("n_out,k_in", [(4096, 1024), (6144, 1024), (1024, 2048), (1024, 3072), (6144, 4096),
                                        (4096, 12288), (4096, 14336)])
def test_fused_prologues_gpu(n_out, k_in):
    """bf16, one row, the chosen configs at Qwen3-0.6B's and the 8B models' shapes, against the unfused pair
    (the norm's or SiLU's kernel, then the same config): SiLU-and-mul's prologue gives the pair's bits (the
    same elementwise math, then the same sums), and x + residual is bitwise the norm kernel's. The norm's
    tiles round as the norm kernel's do, but its rms sums h^2 a tile at a time, not in one reduction: one
    fp32 ulp of 1 / rms can move a few h / rms across a bf16 rounding, each moving an output by ~2^-8 of one
    product (2^-16 of the output here), far below the 2^-8 that rounding w * h rather than w * (h / rms)
    (the prologue before) gave."""
    from fastllm.kernels.fused_add_rms_norm import fused_add_rms_norm
    from fastllm.kernels.silu_and_mul import silu_and_mul

    x, w, b = _fused_inputs("cuda", torch.bfloat16, 1, n_out, k_in, 2 * k_in)
    cfg = S.choose_config(1, n_out, k_in)._replace(use_dot=False, split_k=1)  # (the 8B's gate_up: a dot)
    out = S.launch_silu_and_mul(x, w, b, config=cfg)
    assert torch.equal(out, S.launch(silu_and_mul(x), w, b, config=cfg))
    h, residual = x[:, :k_in].contiguous(), x[:, k_in:].contiguous()
    norm_w = (1 + torch.randn(k_in, device="cuda") / 4).to(torch.bfloat16)
    out, res_out = S.launch_add_rms_norm(h, residual, norm_w, 1e-6, w, b, config=cfg)
    normed, ref_res = fused_add_rms_norm(h, residual, norm_w, 1e-6)
    assert torch.equal(res_out, ref_res)
    ref = S.launch(normed, w, b, config=cfg)
    assert rel_err(out, ref) <= 2 ** -12, rel_err(out, ref)
