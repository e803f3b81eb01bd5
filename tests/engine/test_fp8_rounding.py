"""The tolerances test_gpu_fp8.py holds the GPU's FP8 engine to, measured on the CPU: float32 runs of the
dequantizing reference whose rounding differs a little from the plain run's, as the GPU's does (its GEMMs'
order of sums, its attention and norms), part from it as the GPU does: rare flips of an e4m3 activation's
rounding, large at the few positions they touch, and nothing elsewhere."""

from __future__ import annotations

import torch

from fastllm.kernels import dispatch, reference
from tests.conftest import DRAFT, PROMPTS
from tests.engine.test_gpu_fp8 import LOGPROBS, MAX_LOGPROB_ERR, P90_LOGPROB_ERR, compare_greedy


def scales_after_the_sums(x_q, x_scale, weight, weight_scale, bias, out_dtype):
    """reference.fp8_linear_quantized with the scales applied to the sums of exact e4m3 products."""
    out = (x_q.float() @ weight.float().t()) * x_scale * weight_scale.float()[None, :]
    return (out if bias is None else out + bias.float()).to(out_dtype)


def logprob_errors(want, got) -> list[float]:
    """|logprob differences| of the tokens both report, up to and including where the greedy tokens part."""
    errors = []
    for x, y in zip(want, got):
        for i, (la, lb) in enumerate(zip(x.outputs[0].logprobs, y.outputs[0].logprobs)):
            errors += [abs(la[t].logprob - lb[t].logprob) for t in set(la) & set(lb)]
            if x.outputs[0].token_ids[i] != y.outputs[0].token_ids[i]:
                break
    return errors


def quantizer_inputs_moved(seed: int, ulps: int, quantize=reference.quantize_fp8_per_token):
    """quantize (reference.quantize_fp8_per_token) with its input moved by up to `ulps` float32 ulps, at random:
    patched into the reference, every activation quantizer (the projections', the norms' and SiLU-and-mul's
    _fp8 variants)."""
    g = torch.Generator().manual_seed(seed)

    def moved(x, input_scale=None):
        return quantize(x * (1 + torch.randint(-ulps, ulps + 1, x.shape, generator=g).to(x.dtype) * 2.0 ** -23),
                        input_scale)
    return moved


def test_quantizer_inputs_a_few_ulps_off_flip_within_the_gpu_tests_bound(monkeypatch):
    """The largest move one flip makes: inputs moved by up to 32 ulps (the GPU's 90th percentile says it
    moves them by far less, but its flips land where these do). Three seeds whose largest move passes 0.5,
    as the H200's did (0.57 and 0.62) against the old bound of 0.5; over 112 runs at 2-64 ulps none passed
    0.68."""
    from fastllm import LLM
    from fastllm.layers import fp8

    monkeypatch.setattr(fp8, "check_device", lambda *args: None)
    plain = LLM(DRAFT, device="cpu", dtype="float32", quantization="fp8").generate(PROMPTS, LOGPROBS, use_tqdm=False)
    largest = []
    for seed in (0, 2, 6):
        monkeypatch.setattr(reference, "quantize_fp8_per_token", quantizer_inputs_moved(seed, 32))
        llm = LLM(DRAFT, device="cpu", dtype="float32", quantization="fp8")
        moved = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
        compare_greedy(plain, moved, MAX_LOGPROB_ERR, f"quantizer inputs 32 ulps off, seed {seed}")
        largest.append(max(logprob_errors(plain, moved)))
    assert min(largest) > 0.5, largest  # what the old bound could not hold


def test_two_gemm_roundings_part_within_the_gpu_tests_tolerances(monkeypatch):
    from fastllm import LLM
    from fastllm.layers import fp8

    monkeypatch.setattr(fp8, "check_device", lambda *args: None)
    runs = []
    for linear in (None, scales_after_the_sums):
        if linear is not None:  # every FP8 projection's GEMM (fp8_linear quantizes, then calls it)
            monkeypatch.setattr(reference, "fp8_linear_quantized", linear)
            monkeypatch.setitem(dispatch._chosen, ("fp8_linear_quantized", "cpu"), linear)
        llm = LLM(DRAFT, device="cpu", dtype="float32", quantization="fp8")
        runs.append(llm.generate(PROMPTS, LOGPROBS, use_tqdm=False))
    errors = logprob_errors(*runs)
    assert max(errors) > 0.05  # the flips the old 0.05 bound could not hold (0.30 when measured)
    assert compare_greedy(*runs, MAX_LOGPROB_ERR, "two GEMM roundings on the CPU", P90_LOGPROB_ERR) >= 8 * 24
