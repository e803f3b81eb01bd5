"""The decoder's fused projections (add_rms_norm_linear: the pre-norm in qkv's and gate_up's loads;
silu_and_mul_linear: the SiLU in down's) through their Triton kernels on the CPU, under Triton's interpreter,
in place of their references. One prompt at a time, so decode steps are one row: the one-launch path.
float32: Hugging Face's greedy tokens, as with the references (tests/models/test_llama_vs_hf.py)."""

from __future__ import annotations

from fastllm import LLM, SamplingParams
from fastllm.kernels import skinny_linear as S
from tests.conftest import PROMPTS, STORIES, hf_greedy, tokenize
from tests.kernels.kernel_testing import record_prologues, triton_on_cpu

FUSED_OPS = ("add_rms_norm_linear", "silu_and_mul_linear")
NUM_TOKENS = 6


def test_fused_projections_in_the_model_give_hugging_faces_tokens(monkeypatch):
    called = triton_on_cpu(monkeypatch, FUSED_OPS)
    prologues = record_prologues(monkeypatch)
    llm = LLM(STORIES, device="cpu", dtype="float32", block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    for prompt, ids in zip(PROMPTS[:2], tokenize(PROMPTS[:2])):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(STORIES, ids, NUM_TOKENS), prompt
    assert called == set(FUSED_OPS), called
    # the prompts' steps take two launches (norm or SiLU, then the projection), the decode steps one
    assert S.ADD_RMS_NORM in prologues and S.SILU_AND_MUL in prologues and S.PLAIN in prologues
    llm.engine.check_kv_pool_whole()
