"""Cascade attention's Triton kernels in the engine on the CPU, through Triton's interpreter, in place of
their references: a decode step's prefix and suffix kernels (cascade_decode_attention) and a mixed step's
prefix kernel and merge. The decode steps go through the CUDA-graph runner's staging without replay, so
their plans arrive padded as a graph's (MAX_GROUPS group columns, rows -1, bounds at max_model_len).
float32: Hugging Face's greedy tokens, as with the references (tests/engine/test_cascade_attention.py)."""

from __future__ import annotations

from fastllm import LLM, SamplingParams
from tests.conftest import STORIES
from tests.engine.test_cascade_attention import BASE, PROMPTS, expected, staged_graphs
from tests.kernels.kernel_testing import triton_on_cpu

CASCADE_OPS = ("cascade_decode_attention", "cascade_prefix_attention", "merge_attn_states")
NUM_TOKENS = 5


def test_cascade_kernels_in_the_engine_give_hugging_faces_tokens(monkeypatch):
    called = triton_on_cpu(monkeypatch, CASCADE_OPS)
    llm = LLM(STORIES, device="cpu", dtype="float32", cascade_attention=True, num_gpu_blocks=256, **BASE)
    runner = llm.engine.worker.runner
    replayed = staged_graphs(llm)
    # The interpreter takes seconds a step: a few tokens. The first round caches the prefixes, so in the
    # second the prompts' chunks cascade too (mixed steps).
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    planned = runner.cascade.num_planned
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [tokens[:NUM_TOKENS] for tokens in expected()]  # (greedy: a prefix of the longer run's)
    assert runner.cascade.num_planned > planned and called == set(CASCADE_OPS), called
    assert any(replayed), "no decode step cascaded through the graph inputs"
    llm.engine.check_kv_pool_whole()
