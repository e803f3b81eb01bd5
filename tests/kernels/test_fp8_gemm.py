"""fp8_gemm (the persistent Triton FP8 GEMM fp8_linear runs at its tuned shapes above 32 rows) against the
dequantizing reference, and fp8_linear's choice between it and torch._scaled_mm.

On the CPU (Triton's interpreter) the activations are e4m3 values already (exact_rows: no rounding in the
interpreter's casts) and outputs float16 (the interpreter truncates to bf16); the GPU tests take bf16 and
float16 at Llama-3.1-8B's shapes, every tuned config at its bucket's edges.

Tolerances (||out - ref|| / ||ref||, the same quantized operands): the output rounded once to 16 bits, as
test_fp8_linear.py's: bf16 8e-3, fp16 2e-3. bf16 outputs accumulate unpromoted on the GPU (fast_accum), whose
error the GPU test of it bounds at the model's longest K.
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import fp8_gemm as G
from fastllm.kernels import fp8_linear as K
from fastllm.kernels import fp8_quantize, reference
from tests.kernels.kernel_testing import gpu, rel_err
from tests.kernels.test_fp8_linear import TOL, exact_rows, random_weight

SMALL = [G.GemmConfig(32, 32, 64, 4, 2), G.GemmConfig(64, 32, 128, 4, 3), G.GemmConfig(16, 64, 32, 4, 2)]


def quantized_rows(rows: int, k_in: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token scales spread over 2^-12..2^-6 (a transposed scale would show; fp16 outputs stay finite)."""
    power = 2.0 ** torch.randint(-12, -5, (rows, 1)).float()
    return fp8_quantize.quantize_fp8_per_token(exact_rows(rows, k_in, device, power=power.to(device)))


@pytest.mark.parametrize("cfg", SMALL, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("rows,n_out,k_in", [(40, 48, 64), (33, 96, 160), (70, 32, 256), (1, 16, 32)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast"])
def test_gemm_matches_reference(device, cfg, rows, n_out, k_in, bias, fast_accum):
    """Partial row, column and K tiles (160 = 2.5 tiles of 64), more tiles than programs (the persistent
    loop), a bias added before the one rounding; both accumulations (exact alike in the interpreter)."""
    x_q, x_scale = quantized_rows(rows, k_in, device)
    weight, scale = random_weight(n_out, k_in, device)
    b = torch.randn(n_out, device=device, dtype=torch.float16) if bias else None
    assert G.fits(x_q, x_scale, weight, scale, torch.float16)
    out = G.launch(x_q, x_scale, weight, scale, b, torch.float16, cfg, fast_accum=fast_accum)
    ref = reference.fp8_linear_quantized(x_q, x_scale, weight, scale, b, torch.float32)
    assert out.shape == (rows, n_out) and out.dtype == torch.float16
    assert rel_err(out, ref) <= TOL[torch.float16], rel_err(out, ref)


def test_choose_config_by_row_bucket():
    """A batch takes its bucket's entry (the smallest bucket holding it), from its first row count to its last;
    none past the last bucket, nor for an untuned shape."""
    for (bucket, n_out, k_in), config in G._TUNED.items():
        below = [b for b in G.ROW_BUCKETS if b < bucket]
        assert G.choose_config(bucket, n_out, k_in) == config
        assert G.choose_config(below[-1] + 1 if below else 1, n_out, k_in) == config
        assert G.choose_config(513, n_out, k_in) is None
    assert G.row_bucket(33) == 64 and G.row_bucket(512) == 512 and G.row_bucket(513) == 0
    assert G.choose_config(64, 48, 64) is None


def test_fits_refuses_what_tma_cannot_take(device, monkeypatch):
    x_q, x_scale = quantized_rows(40, 64, device)
    weight, scale = random_weight(48, 64, device)
    assert G.fits(x_q, x_scale, weight, scale, torch.bfloat16)
    with monkeypatch.context() as m:
        m.setattr(G, "TensorDescriptor", None)  # triton < 3.4
        assert not G.fits(x_q, x_scale, weight, scale, torch.bfloat16)
    assert not G.fits(x_q, x_scale, weight, scale, torch.float32)  # float32 outputs: the reference's
    assert not G.fits(x_q[:, 8:40], x_scale, weight[:, 8:40], scale, torch.bfloat16)  # rows not contiguous
    wide_q, _ = quantized_rows(40, 72, device)
    assert not G.fits(wide_q[:, :56], x_scale, weight[:, :56], scale, torch.bfloat16)  # strides of 72 bytes
    assert not G.fits(x_q, x_scale, weight[:44], scale[:44], torch.bfloat16)  # N * 2 bytes not 16-aligned


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_linear_takes_the_gemm_at_tuned_shapes(device, dtype, monkeypatch, caplog):
    """A tuned shape above 32 rows runs fp8_gemm for 16-bit outputs (not _scaled_mm), the reference for
    float32; an untuned one keeps _scaled_mm. Both accumulate unpromoted for bf16 outputs only, and the log
    says once which accumulation ran."""
    monkeypatch.setitem(G._TUNED, (64, 48, 64), SMALL[0])
    monkeypatch.setattr(K, "_logged", set())
    caplog.set_level("INFO", logger="fastllm.kernels")
    gemm_calls, mm_calls = [], []
    launch, scaled_mm = G.launch, K._scaled_mm
    monkeypatch.setattr(G, "launch", lambda *a, **kw: gemm_calls.append(kw) or launch(*a, **kw))
    monkeypatch.setattr(K, "_scaled_mm", lambda *a, **kw: mm_calls.append(kw) or scaled_mm(*a, **kw))
    x_q, x_scale = quantized_rows(40, 64, device)
    weight, scale = random_weight(48, 64, device)
    out = K.fp8_linear_quantized(x_q, x_scale, weight, scale, None, dtype)
    ref = reference.fp8_linear_quantized(x_q, x_scale, weight, scale, None, torch.float32)
    assert rel_err(out, ref) <= TOL[dtype]
    sixteen_bit = dtype != torch.float32
    assert (len(gemm_calls), len(mm_calls)) == ((1, 0) if sixteen_bit else (0, 0))
    if sixteen_bit:
        other, other_scale = random_weight(64, 64, device)
        K.fp8_linear_quantized(x_q, x_scale, other, other_scale, None, dtype)
        assert (len(gemm_calls), len(mm_calls)) == (1, 1)
        assert gemm_calls == mm_calls == [{"fast_accum": dtype == torch.bfloat16}]
        said = [r.getMessage() for r in caplog.records if "outputs above" in r.getMessage()]
        assert said == ["fp8_linear: " + K._ACCUMULATION_LOG[dtype == torch.bfloat16]], said


# GPU: real rounding, Llama-3.1-8B's projections, every tuned config.

@gpu
@pytest.mark.parametrize("key", sorted(G._TUNED), ids=lambda key: "x".join(map(str, key)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_tuned_config_gpu(key, dtype):
    """Each tuned shape through fp8_linear at its bucket's smallest and largest row count, with a bias
    (Qwen2's qkv has one), against the reference and against _scaled_mm on the same quantized rows."""
    bucket, n_out, k_in = key
    torch.manual_seed(bucket + n_out)
    weight, scale = random_weight(n_out, k_in, "cuda")
    bias = torch.randn(n_out, device="cuda", dtype=dtype)
    below = [b for b in G.ROW_BUCKETS if b < bucket]
    smallest = max(below[-1] + 1 if below else 1, K.SKINNY_MAX_ROWS + 1)  # (fewer: the skinny kernel's)
    for rows in (smallest, bucket):
        magnitude = 2.0 ** torch.randint(-6, 3, (rows, 1), device="cuda")
        x = (torch.randn(rows, k_in, device="cuda") * magnitude).to(dtype)
        x_q, x_scale = K.quantize_fp8_per_token(x)
        assert G.choose_config(rows, n_out, k_in) == G._TUNED[key]
        out = K.fp8_linear_quantized(x_q, x_scale, weight, scale, bias, dtype)
        ref = reference.fp8_linear_quantized(x_q, x_scale, weight, scale, bias, torch.float32)
        assert rel_err(out, ref) <= TOL[dtype], (rows, rel_err(out, ref))
        cublas = K._scaled_mm(x_q, x_scale, weight, scale, bias, dtype, fast_accum=K.fast_accum(dtype))
        assert rel_err(out, cublas) <= TOL[dtype], (rows, rel_err(out, cublas))


@gpu
def test_gemm_in_a_cuda_graph_gpu():
    """Captured once (the descriptors' addresses baked in), replayed on new rows of the same shape."""
    key = (256, 4096, 14336)
    config = G._TUNED[key]
    weight, scale = random_weight(4096, 14336, "cuda")
    x = torch.randn(200, 14336, device="cuda", dtype=torch.bfloat16)
    x_q, x_scale = K.quantize_fp8_per_token(x)
    G.launch(x_q, x_scale, weight, scale, None, torch.bfloat16, config, fast_accum=True)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.launch(x_q, x_scale, weight, scale, None, torch.bfloat16, config, fast_accum=True)
    for _ in range(3):
        q, s = K.quantize_fp8_per_token(torch.randn_like(x) * 4)
        x_q.copy_(q)
        x_scale.copy_(s)
        graph.replay()
        ref = reference.fp8_linear_quantized(x_q, x_scale, weight, scale, None, torch.float32)
        assert rel_err(out, ref) <= TOL[torch.bfloat16]


@gpu
@pytest.mark.parametrize("n_out,k_in", [(28672, 4096), (4096, 14336)], ids=["gate_up", "down"])
def test_fast_accumulation_error_gpu(n_out, k_in):
    """Unpromoted sums (bf16 outputs, both kernels) stay within 5e-3 of the exact product at Llama-3.1-8B's
    K (H200: 2.1e-3 at 4096, 3.3e-3 at 14336, against bf16's own rounding of 1.7e-3); promoted ones (fp16
    outputs) within fp16's 2e-3."""
    torch.manual_seed(k_in)
    weight, scale = random_weight(n_out, k_in, "cuda")
    x_q, x_scale = K.quantize_fp8_per_token(torch.randn(256, k_in, device="cuda", dtype=torch.bfloat16))
    ref = reference.fp8_linear_quantized(x_q, x_scale, weight, scale, None, torch.float32)
    config = G.GemmConfig(64, 128, 256, 4, 4)
    for dtype, bound in ((torch.bfloat16, 5e-3), (torch.float16, TOL[torch.float16])):
        fast = K.fast_accum(dtype)
        assert fast == (dtype == torch.bfloat16)
        gemm = G.launch(x_q, x_scale, weight, scale, None, dtype, config, fast_accum=fast)
        cublas = K._scaled_mm(x_q, x_scale, weight, scale, None, dtype, fast_accum=fast)
        assert rel_err(gemm, ref) <= bound and rel_err(cublas, ref) <= bound, \
            (dtype, rel_err(gemm, ref), rel_err(cublas, ref))
