"""fp8_linear (FP8 weights, activations quantized per token) against the dequantizing reference: the
weight-streaming kernel up to 32 rows (fp8_skinny_linear.py), quantization + torch._scaled_mm above (float32
outputs: the reference there, as _scaled_mm's accumulator on Hopper is not float32's).

The activation quantization is bitwise the reference's on the GPU (the same IEEE reciprocal of the scale,
product and round to nearest even). Triton's interpreter rounds float32 -> e4m3 wrongly at binade edges
(1.99 -> 1), so on the CPU the inputs are exactly representable: e4m3 values times a power of two, each
row's amax 448 x that power, so that x * (1 / scale) is exact and no rounding happens (the GPU tests cover
rounding).

Tolerances for the whole op (||out - ref|| / ||ref||, the same quantized operands on both sides):
    float32 out   1e-5   the same e4m3 products summed in float32 in another order
    bf16 out      8e-3   the output rounded once to bf16 (as the skinny kernel's table)
    fp16 out      2e-3
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastllm.kernels import fp8_linear as K
from fastllm.kernels import fp8_quantize, reference
from fastllm.kernels import fp8_skinny_linear as S
from fastllm.kernels.reference import FP8
from fastllm.kernels.skinny_linear import Config
from tests.kernels.kernel_testing import bucket_edges, gpu, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}


def exact_rows(rows: int, k_in: int, device, dtype=torch.float32, power: float | None = None) -> torch.Tensor:
    """Rows of e4m3 values times a power of two per row (or `power` for all), each with amax exactly 448
    x that power."""
    q = (torch.randn(rows, k_in) * 100).clamp(-448, 448).to(FP8).float()
    q[torch.arange(rows), torch.randint(0, k_in, (rows,))] = 448.0
    power = 2.0 ** torch.randint(-10, 6, (rows, 1)).float() if power is None else power
    return (q * power).to(device, dtype)  # e4m3 values have 4 significant bits: exact in bf16 too


def random_weight(n_out: int, k_in: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights and per-row scales that span 2^-12..2^-4 (a transposed scale would show)."""
    weight = (torch.randn(n_out, k_in) * 64).clamp(-448, 448).to(FP8)
    scale = 2.0 ** torch.empty(n_out).uniform_(-12, -4)
    return weight.to(device), scale.to(device)


@pytest.mark.parametrize("one_pass_max_k", [16384, 64], ids=["one-pass", "looped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k_in", [(1, 64), (3, 100), (8, 2048), (2, 3000)])
def test_quantize_per_token_is_the_reference(device, dtype, rows, k_in, one_pass_max_k, monkeypatch):
    monkeypatch.setattr(fp8_quantize, "ONE_PASS_MAX_K", one_pass_max_k)  # 64: rows wider than 64 loop over K
    x = exact_rows(rows, k_in, device, dtype)
    x[-1] = 0  # an all-zero token: the smallest scale, zeros
    q, scale = K.quantize_fp8_per_token(x)
    ref_q, ref_scale = reference.quantize_fp8_per_token(x)
    assert q.dtype == FP8 and scale.shape == (rows, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    # with exact inputs the round trip is exact
    assert torch.equal(q.float() * scale, x.float())


@pytest.mark.parametrize("one_pass_max_k", [16384, 64], ids=["one-pass", "looped"])
def test_quantize_with_a_static_scale_saturates(device, one_pass_max_k, monkeypatch):
    monkeypatch.setattr(fp8_quantize, "ONE_PASS_MAX_K", one_pass_max_k)
    x = exact_rows(4, 96, device, power=2.0 ** -3)
    # a quarter of what the tokens need: x / scale = 4 x an e4m3 value, exact or saturating at 448
    input_scale = torch.tensor(2.0 ** -5, device=device)
    q, scale = K.quantize_fp8_per_token(x, input_scale)
    ref_q, ref_scale = reference.quantize_fp8_per_token(x, input_scale)
    assert torch.equal(scale, ref_scale) and torch.equal(scale, input_scale.expand(4, 1))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert q.float().abs().max() == 448 and torch.isfinite(q.float()).all()


@pytest.mark.parametrize("rows,n_out,k_in", [(1, 48, 64), (5, 32, 128), (17, 64, 96), (40, 48, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_reference(device, rows, n_out, k_in, bias):
    x = exact_rows(rows, k_in, device)
    weight, scale = random_weight(n_out, k_in, device)
    b = torch.randn(n_out, device=device) if bias else None
    out = K.fp8_linear(x, weight, scale, b)
    ref = reference.fp8_linear(x, weight, scale, b)
    assert out.shape == (rows, n_out) and out.dtype == x.dtype
    assert rel_err(out, ref) <= TOL[torch.float32], rel_err(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_outputs_above_32_rows_take_the_reference_not_scaled_mm(device, dtype, monkeypatch):
    """Hopper's FP8 MMA keeps ~14 bits of _scaled_mm's fp32 accumulator (H200, float32 out: 1.1e-4..1.3e-4 off
    the reference at 2..512 rows; the weight-streaming kernel 7.8e-7), which flipped e4m3 roundings across
    whole prompts in the float32 engine test (90th percentile logprob error 0.155, 3.3e-6 without it). So
    float32 outputs take the dequantizing reference there; 16-bit outputs keep _scaled_mm."""
    calls = []
    scaled_mm = K._scaled_mm
    monkeypatch.setattr(K, "_scaled_mm", lambda *args, **kw: calls.append(args) or scaled_mm(*args, **kw))
    x = torch.randn(K.SKINNY_MAX_ROWS + 8, 64, device=device, dtype=dtype)
    weight, scale = random_weight(48, 64, device)
    out = K.fp8_linear(x, weight, scale, None)
    if dtype == torch.float32:
        assert not calls and torch.equal(out, reference.fp8_linear(x, weight, scale, None))
    else:
        assert len(calls) == 1 and rel_err(out, reference.fp8_linear(x, weight, scale, None)) <= TOL[dtype]


@pytest.mark.parametrize("rows,n_out,k_in", [(1, 40, 64), (1, 100, 200), (3, 64, 96), (16, 33, 128),
                                            (32, 70, 256), (2, 48, 3000)])
@pytest.mark.parametrize("cfg", [Config(32, 64, 4, 2, True), Config(16, 64, 4, 2, False), None,
                                 Config(32, 64, 4, 2, True, split_k=3), Config(16, 64, 4, 2, False, split_k=2)],
                         ids=["dot", "fma-one-row", "chosen", "dot-split3", "fma-one-row-split2"])
def test_skinny_kernel_matches_reference(device, rows, n_out, k_in, cfg):
    """The weight-streaming kernel quantizes x itself: odd N and K (masked tiles), one row to 32; K split
    over programs (some with no share of a short K) is scaled once, after the partials are added."""
    x = exact_rows(rows, k_in, device)
    weight, scale = random_weight(n_out, k_in, device)
    bias = torch.randn(n_out, device=device) if rows % 2 else None
    out = S.launch(x, weight, scale, bias, config=cfg)
    assert rel_err(out, reference.fp8_linear(x, weight, scale, bias)) <= TOL[torch.float32]


def test_untuned_narrow_shapes_split_k_to_fill_the_sms(device):
    """Few column tiles (Qwen3-0.6B's o and down: 16 at 64 wide): K split in powers of two until the programs
    reach half the SMs, two BLOCK_K tiles a split at least; Llama-3.1-8B's shapes (swept) keep the table's."""
    block_k = S.choose_config(2, 1024, 3072).block_k
    assert S.choose_config(2, 1024, 3072, num_sms=132).split_k == 4  # 64 programs; 8 would leave 1.5 tiles
    assert S.choose_config(2, 1024, 2048, num_sms=132).split_k == 4
    assert S.choose_config(2, 1024, 4 * block_k - 1, num_sms=132).split_k == 1  # under two tiles a split
    for rows in (1, 8, 32):
        for n_out, k_in in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            assert S.choose_config(rows, n_out, k_in, num_sms=132) == S.choose_config(rows, n_out, k_in)
    assert S.choose_config(2, 1024, 3072, num_sms=4) == S.choose_config(2, 1024, 3072)  # the interpreter's 4
    # the chosen split on a small shape (one column tile, 1024 of K: split 2 of two tiles each at 132 SMs)
    cfg = S.choose_config(3, 64, 4 * block_k, num_sms=132)
    assert cfg.split_k == 2
    x = exact_rows(3, 4 * block_k, device)
    weight, scale = random_weight(64, 4 * block_k, device)
    x_q, x_scale = fp8_quantize.quantize_fp8_per_token(x)
    out = S.launch_quantized(x_q, x_scale, weight, scale, None, torch.float32, config=cfg)
    assert rel_err(out, reference.fp8_linear(x, weight, scale, None)) <= TOL[torch.float32]


@pytest.mark.parametrize("rows,n_out,k_in", [(2, 64, 96), (17, 130, 256), (32, 64, 512)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_swapped_dot_of_16bit_outputs_matches_the_unswapped_one(device, rows, n_out, k_in, split_k, monkeypatch):
    """16-bit outputs take the dot as W @ x^T (fp8_skinny_linear.swap_ab: e4m3 wgmma on Hopper), float32 ones
    the unswapped dot; odd N (masked tiles) and K split too. The swapped bf16 output against the unswapped
    one: bitwise on the CPU; on a GPU wgmma's ~14-bit accumulation may move a few roundings by a bf16 step
    (a 1% error measures ~7.5e-3 here, inside TOL's 8e-3: hence this sharper bound)."""
    assert S.swap_ab(torch.bfloat16) and not S.swap_ab(torch.float32)
    x = exact_rows(rows, k_in, device)
    weight, scale = random_weight(n_out, k_in, device)
    x_q, x_scale = fp8_quantize.quantize_fp8_per_token(x)
    cfg = Config(64, 128, 4, 2, True, split_k=split_k)
    swapped = S.launch_quantized(x_q, x_scale, weight, scale, None, torch.bfloat16, config=cfg)
    exact = S.launch_quantized(x_q, x_scale, weight, scale, None, torch.float32, config=cfg)
    assert rel_err(exact, reference.fp8_linear_quantized(x_q, x_scale, weight, scale, None, torch.float32)) \
        <= TOL[torch.float32]
    monkeypatch.setattr(S, "swap_ab", lambda out_dtype: False)
    unswapped = S.launch_quantized(x_q, x_scale, weight, scale, None, torch.bfloat16, config=cfg)
    assert swapped.dtype == unswapped.dtype == torch.bfloat16
    assert rel_err(swapped, unswapped) <= 3e-3
    assert rel_err(unswapped, exact) <= TOL[torch.bfloat16]


def test_a_swapped_config_is_refused(device):
    """The e4m3 kernel swaps by its output dtype; a config's swap_ab (the bf16 kernel's) would do nothing."""
    x_q, x_scale = fp8_quantize.quantize_fp8_per_token(exact_rows(2, 64, device))
    weight, scale = random_weight(64, 64, device)
    with pytest.raises(AssertionError, match="swap_ab"):
        S.launch_quantized(x_q, x_scale, weight, scale, None, torch.bfloat16, config=Config(64, 64, 4, 2, swap_ab=True))


def test_skinny_kernel_static_scale(device):
    x = exact_rows(4, 96, device, power=2.0 ** -3)
    input_scale = torch.tensor(2.0 ** -5, device=device)  # saturates the larger values, as above
    weight, scale = random_weight(40, 96, device)
    out = S.launch(x, weight, scale, None, input_scale)
    assert rel_err(out, reference.fp8_linear(x, weight, scale, None, input_scale)) <= TOL[torch.float32]


@pytest.mark.parametrize("rows,n_out,k_in", [(1, 48, 64), (1, 100, 200), (5, 32, 128), (17, 64, 96), (40, 48, 64),
                                            (40, 64, 172)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_activations_give_what_fp8_linear_gives(device, rows, n_out, k_in, dtype):
    """fp8_linear_quantized (x quantized by the kernel before: a norm's or SiLU-and-mul's _fp8 variant) is
    fp8_linear with its quantizing taken out: tl.dot, _scaled_mm, and the reference for shapes _scaled_mm
    cannot take (K = 172); a [2, rows, K] input keeps its leading dims. Bitwise on the CPU, but for one row:
    quantized x takes tl.dot there, 16-bit x the FMA path that quantizes as it streams, the same e4m3
    products summed in another order, as on a GPU (where the sums' order differs anyway), held to the
    kernel's tolerance."""
    x = exact_rows(rows, k_in, device, dtype)
    weight, scale = random_weight(n_out, k_in, device)
    bias = torch.randn(n_out, device=device).to(dtype) if rows % 2 else None
    x_q, x_scale = fp8_quantize.quantize_fp8_per_token(x)
    out = K.fp8_linear_quantized(x_q, x_scale, weight, scale, bias, dtype)
    assert out.dtype == dtype
    assert_same_sums(out, K.fp8_linear(x, weight, scale, bias), bitwise=rows > 1)
    stacked = K.fp8_linear_quantized(torch.stack([x_q, x_q]), torch.stack([x_scale, x_scale]), weight, scale, bias,
                                     dtype)
    assert stacked.shape == (2, rows, n_out)
    assert_same_sums(stacked, K.fp8_linear(torch.stack([x, x]), weight, scale, bias), bitwise=rows > 1)


def assert_same_sums(out: torch.Tensor, want: torch.Tensor, bitwise: bool = True) -> None:
    """Bitwise where both sum in one order (the CPU, one path); else the same products summed in another."""
    if bitwise and out.device.type == "cpu":
        assert torch.equal(out, want)
    else:
        assert rel_err(out, want) <= TOL[out.dtype], rel_err(out, want)


def test_unaligned_shapes_above_32_rows_run_the_reference(device):
    """K or N not a multiple of 16 (stories260K's 172-wide MLP) at more than 32 rows: the reference."""
    x = torch.randn(40, 172, device=device)
    weight, scale = random_weight(64, 172, device)
    assert torch.equal(K.fp8_linear(x, weight, scale, None), reference.fp8_linear(x, weight, scale, None))


def test_custom_op_fake_and_traced():
    """torch.compile sees fastllm::fp8_linear through its fake (shapes only). opcheck's schema test is left
    out: it does arithmetic on the inputs, which torch lacks for e4m3 on the CPU."""
    from fastllm.compile import custom_ops  # noqa: F401  (registers the op)

    x, (weight, scale) = torch.randn(5, 32), random_weight(16, 32, "cpu")
    for args in [(x, weight, scale, None, None), (x, weight, scale, torch.randn(16), torch.tensor(0.01))]:
        torch.library.opcheck(torch.ops.fastllm.fp8_linear.default, args, test_utils=(
            "test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration"))


def test_reference_is_close_to_the_unquantized_product():
    """The reference dequantizes: against the float32 product of the weights it quantizes, the error is
    e4m3's (3 mantissa bits: at most 2^-4 relative per element, far less over a sum)."""
    from fastllm.layers.fp8 import quantize_weight

    w = torch.randn(96, 256) / 16
    x = torch.randn(7, 256)
    for per_tensor in (False, True):
        weight, scale = quantize_weight(w, per_tensor)
        assert rel_err(reference.fp8_linear(x, weight, scale, None), x @ w.t()) < 0.05


# GPU: real rounding, cuBLASLt's row-wise _scaled_mm, Llama-3.1-8B's projections.

@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 31, 32, 33, 64, 100, 128, 255, 256, 511, 512])
@pytest.mark.parametrize("n_out,k_in", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128, 64),
                                        (1024, 1024)])
def test_fp8_linear_gpu(dtype, rows, n_out, k_in):
    torch.manual_seed(rows + n_out)
    # token magnitudes spread over 2^-6..2^6 (2^2 in fp16, whose range ends at 65504), so a transposed
    # scale_a would show
    top = 3 if dtype == torch.float16 else 7
    magnitude = 2.0 ** torch.randint(-6, top, (rows, 1), device="cuda")
    x = (torch.randn(rows, k_in, device="cuda") * magnitude).to(dtype)
    weight, scale = random_weight(n_out, k_in, "cuda")
    q, x_scale = K.quantize_fp8_per_token(x)
    ref_q, ref_scale = reference.quantize_fp8_per_token(x)
    assert torch.equal(x_scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    out = K.fp8_linear(x, weight, scale, None)
    ref = reference.fp8_linear(x, weight, scale, None)
    assert out.dtype == dtype and torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL[dtype], rel_err(out, ref)


@gpu
@pytest.mark.parametrize("rows", [1, 2, 8, 13, 16, 32])
@pytest.mark.parametrize("n_out,k_in", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                        (1000, 1000)])
def test_skinny_kernel_against_scaled_mm_gpu(rows, n_out, k_in):
    """The two GPU paths on the same decode batch: the same quantized x, sums in another order."""
    x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16)
    weight, scale = random_weight(n_out, k_in, "cuda")
    out = S.launch(x, weight, scale)
    ref = reference.fp8_linear(x, weight, scale, None)
    assert rel_err(out, ref) <= TOL[torch.bfloat16], rel_err(out, ref)
    if K._scaled_mm_fits(weight):
        q, x_scale = K.quantize_fp8_per_token(x)
        cublas = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                                  out_dtype=x.dtype)
        assert rel_err(out, cublas) <= TOL[torch.bfloat16]


@gpu
@pytest.mark.parametrize("key", sorted(S._TUNED), ids=lambda key: "x".join(map(str, key)))
def test_every_tuned_config_gpu(key):
    """Each measured e4m3 config, at the smallest and largest row count of its bucket."""
    bucket, n_out, k_in = key
    weight, scale = random_weight(n_out, k_in, "cuda")
    for rows in bucket_edges(bucket):
        x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16)
        out = S.launch(x, weight, scale)
        assert rel_err(out, reference.fp8_linear(x, weight, scale, None)) <= TOL[torch.bfloat16]


@gpu
@pytest.mark.parametrize("pdl_mode", ["1", "trigger"])
@pytest.mark.parametrize("cfg", [Config(64, 256, 4, 4, prefetch_k=4096),
                                 Config(64, 256, 4, 5, prefetch_k=1024, split_k=2),
                                 Config(8, 1024, 4, 3, False, prefetch_k=4096)],
                         ids=["whole-k", "split2", "fma"])
def test_weights_prefetched_before_the_pdl_wait_gpu(cfg, pdl_mode, monkeypatch):
    """W's lines fetched into L2 before the PDL wait (and the next kernel let in early, "trigger"): the same
    products, quantized x from a kernel just before, or one row in 16 bits on the FMA path."""
    from fastllm.kernels import pdl
    monkeypatch.setenv("FASTLLM_PDL", pdl_mode)
    pdl._mode.cache_clear()
    try:
        weight, scale = random_weight(4096, 4096, "cuda")
        for rows in (1, 8, 32) if cfg.use_dot else (1,):
            x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
            out = S.launch(x, weight, scale, config=cfg)
            assert rel_err(out, reference.fp8_linear(x, weight, scale, None)) <= TOL[torch.bfloat16]
    finally:
        monkeypatch.undo()
        pdl._mode.cache_clear()


@gpu
def test_fp8_linear_bias_static_scale_and_3d_gpu():
    x = torch.randn(2, 5, 256, device="cuda", dtype=torch.bfloat16)
    weight, scale = random_weight(512, 256, "cuda")
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    input_scale = x.float().abs().amax() / 448
    for s in (None, input_scale):
        out = K.fp8_linear(x, weight, scale, bias, s)
        ref = reference.fp8_linear(x, weight, scale, bias, s)
        assert out.shape == (2, 5, 512) and rel_err(out, ref) <= TOL[torch.bfloat16]


@gpu
def test_fp8_linear_in_a_cuda_graph_gpu():
    """Captured once, replayed on new inputs of the same shape (the decode step's graphs)."""
    weight, scale = random_weight(4096, 4096, "cuda")
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    torch.ops.fastllm.fp8_linear(x, weight, scale, None, None)  # warm up (Triton compile, cuBLASLt plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.fastllm.fp8_linear(x, weight, scale, None, None)
    for _ in range(3):
        x.copy_(torch.randn_like(x) * 3)
        graph.replay()
        assert rel_err(out, reference.fp8_linear(x, weight, scale, None)) <= TOL[torch.bfloat16]


@gpu
def test_fp8_weights_close_to_bf16_gpu():
    """End to end against the unquantized bf16 product: e4m3's error, not a wrong scale or layout."""
    from fastllm.layers.fp8 import quantize_weight

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    weight, scale = quantize_weight(w, per_tensor=False)
    assert rel_err(K.fp8_linear(x, weight, scale, None), F.linear(x.float(), w.float())) < 0.05
