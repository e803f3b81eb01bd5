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
from tests.kernels.kernel_testing import bucket_edges, gpu, record_launches, rel_err

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


# The fused prologue and the gated epilogue against their unfused pair: the norm's or SiLU's reference, and
# F.linear in float64.
NORM_CONFIGS = [S.Config(16, 64, 4, 2, False), S.Config(8, 256, 8, 3, False)]
NORM_IDS = ["fma-16x64", "fma-8x256"]
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


def unfused_pair(x, w, cfg):
    """The gated launch's unfused pair: the projection of each half of w = [gate; up] with cfg, then the SiLU
    kernel."""
    from fastllm.kernels.silu_and_mul import silu_and_mul

    return silu_and_mul(torch.cat([S.launch(x, half, config=cfg) for half in w.chunk(2)], dim=1))


GATED_CONFIGS = [S.Config(16, 64, 4, 2, False), S.Config(16, 32, 4, 2, True),
                 S.Config(64, 32, 4, 2, True, swap_ab=True), None]
GATED_IDS = ["fma-one-row", "dot", "swapped", "chosen"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("n_out,k_in", FUSED_SHAPES)
@pytest.mark.parametrize("cfg", GATED_CONFIGS, ids=GATED_IDS)
def test_gated_epilogue_matches_the_projection_then_the_activation(device, dtype, rows, n_out, k_in, cfg):
    """silu(x @ gate^T) * (x @ up^T) of weight [gate; up] against float64 math. Its error: gate's and up's
    each within the projection's bound, the product's within their sum, and fp16's two more roundings
    (SiLU's output and the product, 2^-11 each at most)."""
    from fastllm.kernels import reference

    x, w, _ = _fused_inputs(device, dtype, rows, 2 * n_out, k_in, k_in)
    x = x * 3  # gates well into SiLU's curve on both sides
    out = torch.full((rows, n_out), float("nan"), device=device, dtype=dtype)
    assert S.launch(x, w, config=cfg, out=out, gated=True).data_ptr() == out.data_ptr()
    ref = reference.silu_and_mul(F.linear(x.double(), w.double()))
    bound = 2 * tolerance(dtype, k_in) + (2 * 2 ** -11 if dtype == torch.float16 else 0)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= bound, (cfg, rel_err(out, ref))


@pytest.mark.parametrize("rows,cfg", [(1, S.Config(16, 64, 4, 2, False)), (1, S.Config(8, 256, 8, 3, False)),
                                      (2, S.Config(16, 32, 4, 2, True))],
                         ids=["fma-16x64", "fma-8x256", "dot"])
def test_gated_epilogue_gives_the_unfused_pairs_bits(device, rows, cfg):
    """bf16 (the FMA path's, and the interpreter's dot in float32): the gated launch against the same
    config's projection into [rows, 2N] and the SiLU kernel: the same sums a column, rounded where the pair
    rounds. On the GPU: test_gated_and_fused_prologue_gpu."""
    dtype = torch.bfloat16 if not cfg.use_dot else torch.float32  # (the interpreter's bf16 tl.dot is wrong)
    for n_out, k_in in FUSED_SHAPES:
        x, w, _ = _fused_inputs(device, dtype, rows, 2 * n_out, k_in, k_in)
        assert torch.equal(S.launch(x, w, config=cfg, gated=True), unfused_pair(x, w, cfg)), (n_out, k_in)


def test_gated_config_halves_the_projections_tile_width_down_to_its_paths_narrowest(monkeypatch):
    for key, cfg in {(1, 96, 64): S.Config(16, 64, 4, 2, False), (8, 96, 64): S.Config(32, 64, 4, 2),
                     (16, 96, 64): S.Config(16, 64, 4, 2), (32, 96, 64): S.Config(64, 64, 4, 2, swap_ab=True),
                     (64, 96, 64): S.Config(128, 64, 4, 2, split_k=2, swap_ab=True)}.items():
        monkeypatch.setitem(S._TUNED, key, cfg)
    assert [S.gated_config(rows, 48, 64).block_n for rows in (1, 8, 16, 32, 64)] == [8, 16, 16, 64, 64]
    assert S.gated_config(32, 48, 64).block_k == 32  # (too narrow to halve: half as deep)
    assert S.gated_config(64, 48, 64).split_k == 1
    own = S.Config(32, 32, 4, 3)
    monkeypatch.setitem(S._GATED_TUNED, (8, 96, 64), own)
    assert S.gated_config(8, 48, 64) == own and S.gated_config(8, 48, 64, 4) == own._replace(block_k=16)


def test_gated_launches_past_32_rows_take_the_kernel_where_either_table_has_the_shape(monkeypatch):
    monkeypatch.setitem(S._GATED_TUNED, (64, 96, 64), S.Config(64, 32, 4, 2, swap_ab=True))
    assert S.measured_there(40, 96, 64, gated=True) and not S.measured_there(40, 96, 64)
    assert not S.measured_there(40, 96, 80, gated=True)


def test_the_prologue_refuses_the_dot_and_split_k_and_the_fused_ops_run_apart_there(device, monkeypatch):
    """The norm's prologue runs on the one-row FMA path, unsplit (program 0 alone stores x + residual), and
    gated launches unsplit: other configs are refused, and the fused ops run apart where the table chooses
    them, and for weights over SMALL_WEIGHT_BYTES."""
    x, w = torch.randn(1, 64, device=device), torch.randn(8, 64, device=device)
    norm_w = torch.ones(64, device=device)
    with pytest.raises(AssertionError, match="unsplit"):
        S.launch_add_rms_norm(x, x, norm_w, 1e-6, w, config=S.Config(8, 32, 4, 2, False, split_k=2))
    with pytest.raises(AssertionError, match="unsplit"):
        S.launch(x, w, config=S.Config(8, 32, 4, 2, False, split_k=2), gated=True)
    with pytest.raises(AssertionError, match="FMA"):
        S.launch_add_rms_norm(x, x, norm_w, 1e-6, w, config=S.Config(16, 32, 4, 2, True))
    with pytest.raises(AssertionError, match="no bias"):
        S.launch(x, w, torch.zeros(8, device=device), gated=True)
    fuses = lambda: (S._fuses("add_rms_norm_linear", x, w, x, norm_w),  # noqa: E731
                     S._fuses("add_rms_norm_gated_linear", x, w, x, norm_w, gated=True))
    assert fuses() == (True, True)
    monkeypatch.setitem(S._TUNED, (1, 8, 64), S.Config(8, 32, 4, 2, False, split_k=2))
    assert fuses() == (False, True)  # (gated launches drop the split)
    monkeypatch.setitem(S._TUNED, (1, 8, 64), S.Config(16, 32, 4, 2, True))
    assert fuses() == (False, False)
    monkeypatch.delitem(S._TUNED, (1, 8, 64))
    monkeypatch.setattr(S, "SMALL_WEIGHT_BYTES", w.numel() * w.element_size() - 1)  # not latency-bound
    assert fuses() == (False, False)


def test_fused_ops_take_one_launch_at_decode_rows_and_more_above(device, monkeypatch, caplog):
    """add_rms_norm_linear / add_rms_norm_gated_linear: the prologue kernel at one row, else the norm's kernel
    and the projection, said once in the log; gated_linear one gated launch up to MAX_ROWS, cuBLAS and the
    SiLU kernel above; the same results either way."""
    import logging

    from fastllm.kernels import reference

    launches = record_launches(monkeypatch)
    w_qkv, w_gate_up = torch.randn(48, 64, device=device), torch.randn(64, 64, device=device)
    norm_w = torch.rand(64, device=device) + 0.5
    caplog.set_level(logging.INFO, logger="fastllm.kernels")
    monkeypatch.setattr(S, "_logged", set())  # (logged once a process: maybe by an earlier test)
    for rows in (1, 2, S.MAX_ROWS + 1):
        launches.clear()
        x, residual = torch.randn(rows, 64, device=device), torch.randn(rows, 64, device=device)
        out, res = triton_impl("add_rms_norm_linear")(x, residual, norm_w, 1e-6, w_qkv, None)
        ref, ref_res = reference.add_rms_norm_linear(x, residual, norm_w, 1e-6, w_qkv, None)
        assert torch.equal(res, ref_res) and rel_err(out, ref.double()) <= tolerance(torch.float32, 64)
        act, res = triton_impl("add_rms_norm_gated_linear")(x, residual, norm_w, 1e-6, w_gate_up)
        ref, ref_res = reference.add_rms_norm_gated_linear(x, residual, norm_w, 1e-6, w_gate_up)
        assert torch.equal(res, ref_res) and rel_err(act, ref.double()) <= 2 * tolerance(torch.float32, 64)
        act = triton_impl("gated_linear")(x, w_gate_up)
        assert rel_err(act, reference.gated_linear(x, w_gate_up).double()) <= 2 * tolerance(torch.float32, 64)
        norm, plain, gated = (S.ADD_RMS_NORM, False), (S.PLAIN, False), (S.PLAIN, True)
        want = {1: [norm, (S.ADD_RMS_NORM, True), gated], 2: [plain, gated, gated]}.get(rows, [])
        assert launches == want, (rows, launches)
    assert "two launches for batches of more than one row" in caplog.text
    assert f"cuBLAS for batches of more than {S.MAX_ROWS} rows" in caplog.text


@gpu
@pytest.mark.parametrize("n_out,k_in", [(4096, 1024), (6144, 1024), (1024, 2048), (1024, 3072), (6144, 4096),
                                        (4096, 12288), (4096, 14336)])
def test_fused_prologue_gpu(n_out, k_in):
    """bf16, one row, the chosen configs at Qwen3-0.6B's and the 8B models' shapes, against the norm kernel
    and then the same config: x + residual is bitwise the norm kernel's. The norm's tiles round as the norm
    kernel's do, but its rms sums h^2 a tile at a time, not in one reduction: one fp32 ulp of 1 / rms can
    move a few h / rms across a bf16 rounding, each moving an output by ~2^-8 of one product (2^-16 of the
    output here), far below the 2^-8 that rounding w * h rather than w * (h / rms) (the prologue before)
    gave."""
    from fastllm.kernels.fused_add_rms_norm import fused_add_rms_norm

    x, w, b = _fused_inputs("cuda", torch.bfloat16, 1, n_out, k_in, 2 * k_in)
    cfg = S.choose_config(1, n_out, k_in)._replace(use_dot=False, split_k=1)  # (the 8B's gate_up: a dot)
    h, residual = x[:, :k_in].contiguous(), x[:, k_in:].contiguous()
    norm_w = (1 + torch.randn(k_in, device="cuda") / 4).to(torch.bfloat16)
    out, res_out = S.launch_add_rms_norm(h, residual, norm_w, 1e-6, w, b, config=cfg)
    normed, ref_res = fused_add_rms_norm(h, residual, norm_w, 1e-6)
    assert torch.equal(res_out, ref_res)
    ref = S.launch(normed, w, b, config=cfg)
    assert rel_err(out, ref) <= 2 ** -12, rel_err(out, ref)


@gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 32, 40])
@pytest.mark.parametrize("n_out,k_in", [(3072, 1024), (12288, 4096), (14336, 4096), (1000, 1000)])
def test_gated_epilogue_gpu(rows, n_out, k_in):
    """bf16 at the gate/up shapes of Qwen3-0.6B, Qwen3-8B and Llama-3.1-8B: the chosen gated config against
    the same config's projection into [rows, 2N] and the SiLU kernel, bit for bit (the same dots a column,
    rounded where the pair rounds), and against float64 math. Where the table has no gated config past 32
    rows (gated_linear hands those to cuBLAS) the bucket's default runs."""
    from fastllm.kernels import reference

    x, w, _ = _fused_inputs("cuda", torch.bfloat16, rows, 2 * n_out, k_in, k_in)
    cfg = S.gated_config(rows, n_out, k_in)
    out = S.launch(x * 3, w, config=cfg, gated=True)
    assert torch.equal(out, unfused_pair(x * 3, w, cfg))
    ref = reference.silu_and_mul(F.linear((x * 3).double(), w.double()))
    assert rel_err(out, ref) <= 2 * TOL[torch.bfloat16] + 2 * 2 ** -9, rel_err(out, ref)


@gpu
@pytest.mark.parametrize("key", sorted(S._GATED_TUNED), ids=lambda key: "x".join(map(str, key)))
def test_every_gated_tuned_config_gpu(key):
    """Each config of the gated table at the smallest and largest row count of its bucket, against the
    projection's launch with the same config and the SiLU kernel (bit for bit) and float64 math."""
    from fastllm.kernels import reference

    bucket, n_gate_up, k_in = key
    for rows in bucket_edges(bucket):
        x, w, _ = _fused_inputs("cuda", torch.bfloat16, rows, n_gate_up, k_in, k_in)
        cfg = S.gated_config(rows, n_gate_up // 2, k_in)
        assert cfg == S._GATED_TUNED[key]
        out = S.launch(x * 3, w, gated=True)
        assert torch.equal(out, unfused_pair(x * 3, w, cfg)), rows
        ref = reference.silu_and_mul(F.linear((x * 3).double(), w.double()))
        assert rel_err(out, ref) <= 2 * TOL[torch.bfloat16] + 2 * 2 ** -9, (rows, rel_err(out, ref))


@gpu
def test_fused_norm_and_gated_epilogue_gpu():
    """Qwen3-0.6B's gate/up at one row, the norm in its loads and the SiLU in its epilogue, against the norm
    kernel then the gated launch of the same config (the rms's sum order apart, as
    test_fused_prologue_gpu)."""
    from fastllm.kernels.fused_add_rms_norm import fused_add_rms_norm

    x, w, _ = _fused_inputs("cuda", torch.bfloat16, 1, 6144, 1024, 2048)
    h, residual = x[:, :1024].contiguous(), x[:, 1024:].contiguous()
    norm_w = (1 + torch.randn(1024, device="cuda") / 4).to(torch.bfloat16)
    assert S._fuses("add_rms_norm_gated_linear", h, w, residual, norm_w, gated=True)
    out, _ = S.add_rms_norm_gated_linear(h, residual, norm_w, 1e-6, w)
    normed, _ = fused_add_rms_norm(h, residual, norm_w, 1e-6)
    ref = S.launch(normed, w, gated=True)
    assert rel_err(out, ref) <= 2 ** -11, rel_err(out, ref)
