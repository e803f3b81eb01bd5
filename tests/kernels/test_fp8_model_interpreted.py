"""The FP8 model's own kernels end to end on the CPU, through Triton's interpreter: the quantizing norms and
SiLU-and-mul (_fp8 variants), fp8_linear_quantized (the weight-streaming kernel on e4m3 activations, its
one-row FMA path included) and fp8_linear (o_proj), in place of their references, against the reference
engine. float32: the same quantized activations, sums in another order, so test_gpu_fp8.py's bounds hold
(logprobs within its maximum, 90% within its 90th percentile, tokens equal up to near-ties)."""

from __future__ import annotations

from fastllm import LLM, SamplingParams
from tests.conftest import DRAFT, PROMPTS
from tests.engine.test_gpu_fp8 import MAX_LOGPROB_ERR, P90_LOGPROB_ERR, compare_greedy
from tests.kernels.kernel_testing import triton_on_cpu

FP8_OPS = ("fp8_linear", "fp8_linear_quantized", "rms_norm_fp8", "fused_add_rms_norm_fp8", "silu_and_mul_fp8")


def test_fp8_kernels_in_the_model_give_the_references_tokens(allow_fp8_on_cpu, monkeypatch):
    prompts = PROMPTS[:3]  # a 1-row step at the end: the FMA path on e4m3 activations
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (16, 10, 6)]
    want = LLM(DRAFT, device="cpu", dtype="float32", quantization="fp8").generate(prompts, params, use_tqdm=False)
    called = triton_on_cpu(monkeypatch, FP8_OPS)
    llm = LLM(DRAFT, device="cpu", dtype="float32", quantization="fp8")
    got = llm.generate(prompts, params, use_tqdm=False)
    assert called == set(FP8_OPS), called
    compared = compare_greedy(want, got, MAX_LOGPROB_ERR, "fp8 Triton kernels (interpreted) vs references",
                              P90_LOGPROB_ERR)
    assert compared >= 0.5 * sum(p.max_tokens for p in params)
    llm.engine.check_kv_pool_whole()
