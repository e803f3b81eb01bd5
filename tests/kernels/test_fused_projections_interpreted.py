"""The decoder's fused projections (add_rms_norm_linear: the pre-norm in qkv's loads;
add_rms_norm_gated_linear: the SiLU in gate_up's epilogue and, at one row, the pre-norm in its loads) through
their Triton kernels on the CPU, under Triton's interpreter, in place of their references. One prompt at a
time, so decode steps are one row: the one-launch path.
float32: Hugging Face's greedy tokens, as with the references (tests/models/test_llama_vs_hf.py)."""

from __future__ import annotations

from fastllm import LLM, SamplingParams
from fastllm.kernels import skinny_linear as S
from tests.conftest import PROMPTS, STORIES, hf_greedy, tokenize
from tests.kernels.kernel_testing import record_launches, triton_on_cpu

FUSED_OPS = ("add_rms_norm_linear", "add_rms_norm_gated_linear")
NUM_TOKENS = 6


def test_fused_projections_in_the_model_give_hugging_faces_tokens(monkeypatch):
    called = triton_on_cpu(monkeypatch, FUSED_OPS)
    launches = record_launches(monkeypatch)
    llm = LLM(STORIES, device="cpu", dtype="float32", block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    for prompt, ids in zip(PROMPTS[:2], tokenize(PROMPTS[:2])):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(STORIES, ids, NUM_TOKENS), prompt
    assert called == set(FUSED_OPS), called
    # the prompts' steps take the norm's kernel and the projection (gate_up's gated), the decode steps one
    # launch: (prologue, gated)
    assert set(launches) == {(S.ADD_RMS_NORM, False), (S.ADD_RMS_NORM, True), (S.PLAIN, True),
                             (S.PLAIN, False)}
    llm.engine.check_kv_pool_whole()
