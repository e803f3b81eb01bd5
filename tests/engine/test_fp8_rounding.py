"""The tolerances test_gpu_fp8.py holds the GPU's FP8 engine to, measured on the CPU: two float32 runs of
the dequantizing reference that differ only in the GEMM's rounding (scales applied to the operands, or to
the sums of exact e4m3 products as _scaled_mm does) part as the GPU's order of sums makes it part from the
reference: rare flips of an e4m3 activation's rounding, large at the few positions they touch."""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import dispatch, reference
from tests.conftest import DRAFT, PROMPTS
from tests.engine.test_gpu_fp8 import LOGPROBS, MAX_LOGPROB_ERR, P90_LOGPROB_ERR, compare_greedy


def scales_after_the_sums(x, weight, weight_scale, bias, input_scale=None):
    x_q, x_scale = reference.quantize_fp8_per_token(x, input_scale)
    out = (x_q.float() @ weight.float().t()) * x_scale * weight_scale.float()[None, :]
    return (out if bias is None else out + bias.float()).to(x.dtype)


def test_two_gemm_roundings_part_within_the_gpu_tests_tolerances(monkeypatch):
    from fastllm import LLM
    from fastllm.layers import fp8

    monkeypatch.setattr(fp8, "check_device", lambda device, scheme: None)
    runs = []
    for linear in (None, scales_after_the_sums):
        if linear is not None:
            monkeypatch.setitem(dispatch._chosen, ("fp8_linear", "cpu"), linear)
        llm = LLM(DRAFT, device="cpu", dtype="float32", quantization="fp8")
        runs.append(llm.generate(PROMPTS, LOGPROBS, use_tqdm=False))
    errors = [abs(a.logprob - b.logprob) for x, y in zip(*runs) for la, lb in
              zip(x.outputs[0].logprobs, y.outputs[0].logprobs) for a, b in
              ((la[t], lb[t]) for t in set(la) & set(lb))]
    assert max(errors) > 0.05  # the flips the old 0.05 bound could not hold (0.30 when measured)
    assert compare_greedy(*runs, MAX_LOGPROB_ERR, "two GEMM roundings on the CPU", P90_LOGPROB_ERR) >= 8 * 24
