"""torch.compile of the model: one graph with no breaks (prefill, decode and mixed steps), the same
greedy tokens as the eager model, and the compiled forward saved and loaded again. On the CPU a
compile takes ~15-30 s, so this is one test that compiles once; Qwen3's q/k norm path is only traced (a
quick second test)."""

from __future__ import annotations

import torch
import torch._dynamo

from fastllm import LLM, SamplingParams
from fastllm.compile import aot_cache
from tests.conftest import PROMPTS, STORIES, cached_llm

ENGINE = dict(compile_on_cpu=True, max_num_batched_tokens=24, dtype="float32", device="cpu")


def test_compiled_equals_eager_without_graph_breaks(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTLLM_CACHE_DIR", str(tmp_path))  # a cold cache: this process traces
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = LLM(STORIES, **ENGINE)
    eager = cached_llm(enforce_eager=True, max_num_batched_tokens=24)
    runner = compiled.engine.worker.runner
    assert runner.forward is not runner.model.forward
    params = SamplingParams(temperature=0, max_tokens=24)
    # 24-token budget: long prompts are chunked while others decode, so prefill, decode-only and
    # mixed steps all run through the compiled graph.
    prompts = PROMPTS + [PROMPTS[0] + " and the dog ran to the park with the ball."]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    assert got == want
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert breaks == 0, dict(torch._dynamo.utils.counters["graph_break"])
    # dynamic in the token count, 1 included (an unbacked size): one graph for every step
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(torch._dynamo.utils.counters["stats"])

    if not aot_cache.available():
        assert runner.compile_how.startswith("compiled (torch")
        return
    assert runner.compile_how.startswith("compiled, saved to"), runner.compile_how
    # A second engine of the same model loads that forward instead of tracing: no new Dynamo graph.
    reloaded = LLM(STORIES, **ENGINE)
    assert reloaded.engine.worker.runner.compile_how.startswith("loaded"), reloaded.engine.worker.runner.compile_how
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    got = [o.outputs[0].token_ids for o in reloaded.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_qwen3_qk_norm_traces_without_graph_breaks():
    """Qwen3's q/k norm weights ride into the attention op (the rotary kernels apply them): the whole forward
    still traces as one graph. The eager backend only traces (no Inductor compile), so this is quick."""
    from fastllm.models.llama import LlamaArgs, LlamaForCausalLM
    from fastllm.worker.attn_metadata import forward_context

    args = LlamaArgs(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling={},
                     max_position_embeddings=32, qk_norm=True)
    model = LlamaForCausalLM(args)
    ids, positions = torch.arange(5), torch.arange(5)
    torch._dynamo.reset()
    with forward_context(None, model.attention_layers()):  # no metadata: the op only shapes its output
        out = torch.compile(model.forward, fullgraph=True, dynamic=True, backend="eager")(ids, positions)
    assert out.shape == (5, 32)
