"""skinny_linear's folded norm (RMS_NORM_FOLDED: rms_norm(h) @ W^T with the norm's weight folded into W, each
row's 1 / rms(h) applied to the sums) and residual epilogue (ADD_RESIDUAL: the projection + h): a decode layer
with neither norm nor add launches. Against float64 math under the interpreter (float32 / float16: its bf16
tl.dot is wrong) and bf16 on the GPU; the epilogue's add bit for bit the projection then the add."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastllm.kernels import reference
from fastllm.kernels import skinny_linear as S
from fastllm.layers.linear import fold_norm_weight
from tests.kernels.kernel_testing import BF16, gpu, record_launches, rel_err
from tests.kernels.test_skinny_linear import TOL, tolerance

EPS = 1e-6
CONFIGS = {"dot": S.Config(16, 32, 4, 2, True), "swapped": S.Config(64, 32, 4, 2, True, swap_ab=True),
           "chosen": None}
CASES = [pytest.param(1, S.Config(16, 64, 4, 2, False), id="1-fma")] + [
    pytest.param(rows, cfg, id=f"{rows}-{name}") for rows in (1, 3, 16, 40) for name, cfg in CONFIGS.items()]


def inputs(device, dtype, rows, n_out, k_in, seed=0):
    """h (the residual stream, rows of different scales), W [n_out, K], the norm's weight near 1, a bias."""
    g = torch.Generator().manual_seed(seed + rows * 1000 + k_in)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    h = rand(rows, k_in) * (1 + 4 * torch.rand(rows, 1, generator=g))
    w = rand(n_out, k_in) / k_in ** 0.5
    norm_w = 1 + rand(k_in) / 4
    return [t.to(device=device, dtype=dtype) for t in (h, w, norm_w, rand(n_out))]


def float64_ref(h, w, norm_w, bias=None, gated=False):
    """rms_norm(h) with norm_w, then the projection (and SiLU-and-mul), in float64, unfolded."""
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.double()
    y = F.linear(normed, w.double(), None if bias is None else bias.double())
    return reference.silu_and_mul(y) if gated else y


def unit(h):
    """The weight the folding leaves the norm: ones."""
    return torch.ones(h.shape[-1], dtype=h.dtype, device=h.device)


def folded(w, norm_w):
    w = w.clone()
    fold_norm_weight(w, norm_w)
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,cfg", CASES)
@pytest.mark.parametrize("n_out,k_in", [(40, 64), (100, 200), (64, 96)])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_folded_norm_matches_float64(device, dtype, rows, n_out, k_in, cfg, gated):
    """Its error: the projection's, the folded weight's one rounding (2^-11 in fp16) and, gated, SiLU's two
    (as the gated epilogue's test)."""
    h, w, norm_w, b = inputs(device, dtype, rows, (2 if gated else 1) * n_out, k_in)
    bias = None if gated else b
    prologue = S.Prologue(S.RMS_NORM_FOLDED, eps=EPS)
    out = S.launch(h, folded(w, norm_w), bias, config=cfg, prologue=prologue, gated=gated)
    half = 2 ** -11 if dtype == torch.float16 else 0
    bound = (2 if gated else 1) * (tolerance(dtype, k_in) + half) + (2 * half if gated else 0)
    err = rel_err(out, float64_ref(h, w, norm_w, bias, gated))
    assert torch.isfinite(out).all() and err <= bound, (cfg, err, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("rows,cfg", [(1, S.Config(16, 64, 4, 2, False)), (3, S.Config(16, 32, 4, 2, True)),
                                      (40, S.Config(64, 32, 4, 2, True, swap_ab=True)),
                                      (8, S.Config(16, 64, 4, 2, True, split_k=3))])
def test_residual_epilogue_gives_the_projection_then_the_adds_bits(device, dtype, rows, cfg):
    """The same config's projection (+ bias), then the add as torch rounds it, bit for bit (split K too: the
    add follows the splits' sum)."""
    h, w, _, b = inputs(device, dtype, rows, 100, 200)
    residual = torch.randn(rows, 100, device=device).to(dtype) * 3
    out = S.launch(h, w, b, config=cfg, add_residual=residual)
    assert torch.equal(out, S.launch(h, w, b, config=cfg) + residual)


def test_the_ops_take_one_launch_at_decode_rows_and_the_norm_apart_above(device, monkeypatch):
    """rms_norm_folded_linear, its gated form and linear_add: one launch up to 32 rows; above MAX_ROWS the
    norm (with a unit weight) and cuBLAS, within the same bounds of float64 math."""
    launches = record_launches(monkeypatch)
    for rows in (2, S.MAX_ROWS + 1):
        h, w, norm_w, b = inputs(device, torch.float32, rows, 64, 96)
        wf, w2f = folded(w, norm_w), folded(torch.cat([w, w.flip(0)]), norm_w)
        launches.clear()
        y = S.rms_norm_folded_linear(h, unit(h), EPS, wf, b)
        act = S.rms_norm_folded_gated_linear(h, unit(h), EPS, w2f)
        z = S.linear_add(h, w, b, y)
        folded_kind = (S.RMS_NORM_FOLDED, False), (S.RMS_NORM_FOLDED, True), (S.PLAIN, False)
        assert launches == (list(folded_kind) if rows <= S.MAX_ROWS else []), launches
        assert rel_err(y, float64_ref(h, w, norm_w, b)) <= 2 * tolerance(torch.float32, 96)
        ref_act = float64_ref(h, torch.cat([w, w.flip(0)]), norm_w, gated=True)
        assert rel_err(act, ref_act) <= 4 * tolerance(torch.float32, 96)
        assert rel_err(z, F.linear(h.double(), w.double(), b.double()) + y.double()) <= 2 * tolerance(
            torch.float32, 96)


def test_reference_ops_are_the_norm_then_the_projection(device):
    """The CPU path's references against float64 math (float32: their norm's rounding is float32's)."""
    h, w, norm_w, b = inputs(device, torch.float32, 5, 64, 96)
    wf = folded(w, norm_w)
    y = reference.rms_norm_folded_linear(h, unit(h), EPS, wf, b)
    assert rel_err(y, float64_ref(h, w, norm_w, b)) <= 1e-6
    w2 = torch.cat([w, w.flip(0)])
    assert rel_err(reference.rms_norm_folded_gated_linear(h, unit(h), EPS, folded(w2, norm_w)),
                   float64_ref(h, w2, norm_w, gated=True)) <= 1e-6
    r = torch.randn(5, 64)
    assert torch.equal(reference.linear_add(h, w, b, r), F.linear(h, w, b) + r)


def test_swapped_configs_take_the_norm_apart(device, monkeypatch):
    """A config that swaps the dot runs the norm (unit weight) and the projection: two launches, within the
    same bound."""
    launches = record_launches(monkeypatch)
    swapped = S.Config(64, 32, 4, 2, True, swap_ab=True)
    monkeypatch.setattr(S, "launch_config", lambda x, w, gated=False: swapped)
    h, w, norm_w, b = inputs(device, torch.float32, 3, 64, 96)
    y = S.rms_norm_folded_linear(h, unit(h), EPS, folded(w, norm_w), b)
    assert launches == [(S.PLAIN, False)]
    assert rel_err(y, float64_ref(h, w, norm_w, b)) <= 2 * tolerance(torch.float32, 96)


def test_the_folded_prologue_runs_unsplit():
    h, w, _, _ = inputs("cpu", torch.float32, 3, 64, 96)
    with pytest.raises(AssertionError, match="unsplit"):
        S.launch(h, w, config=S.Config(16, 32, 4, 2, True, split_k=2), prologue=S.Prologue(S.RMS_NORM_FOLDED))


@gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 32, 40])
@pytest.mark.parametrize("n_out,k_in,gated", [(4096, 1024, False), (6144, 1024, True), (6144, 4096, False),
                                              (24576, 4096, True), (1000, 1000, False)])
def test_folded_norm_gpu(rows, n_out, k_in, gated):
    """bf16 at Qwen3-0.6B's and -8B's qkv and gate/up, each row count's chosen config (unsplit), against
    float64 math: the projection's bound, the folded weight's rounding (2^-9) and gated SiLU's two."""
    h, w, norm_w, b = inputs("cuda", torch.bfloat16, rows, n_out, k_in)
    wf = folded(w, norm_w)
    if gated:
        out, ref = S.rms_norm_folded_gated_linear(h, unit(h), EPS, wf), float64_ref(h, w, norm_w, gated=True)
        bound = 2 * (TOL[torch.bfloat16] + 2 ** -9) + 2 * 2 ** -9
    else:
        out, ref = S.rms_norm_folded_linear(h, unit(h), EPS, wf, b), float64_ref(h, w, norm_w, b)
        bound = TOL[torch.bfloat16] + 2 ** -9
    assert rel_err(out, ref) <= bound, rel_err(out, ref)


@gpu
@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("n_out,k_in", [(1024, 2048), (1024, 3072), (4096, 4096), (4096, 12288)])
def test_residual_epilogue_gpu(rows, n_out, k_in):
    """bf16 at the o and down shapes of Qwen3-0.6B and -8B (the 0.6B's down splits K at 8 rows): the chosen
    config's projection then the add, bit for bit."""
    h, w, _, _ = inputs("cuda", torch.bfloat16, rows, n_out, k_in)
    residual = torch.randn(rows, n_out, device="cuda").to(torch.bfloat16)
    if not S.measured_there(rows, n_out, k_in):
        pytest.skip("cuBLAS's shape at this row count")
    assert torch.equal(S.linear_add(h, w, None, residual), S.launch(h, w) + residual)
