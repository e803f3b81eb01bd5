"""torch.compile of the model: one graph with no breaks (prefill, decode and mixed steps), and the
same greedy tokens as the eager model. On the CPU this compiles once (~15-30 s), so it is one test."""

from __future__ import annotations

import torch
import torch._dynamo

from fastllm import SamplingParams
from tests.conftest import PROMPTS, cached_llm


def test_compiled_equals_eager_without_graph_breaks():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = cached_llm(compile_on_cpu=True, max_num_batched_tokens=24)
    eager = cached_llm(enforce_eager=True, max_num_batched_tokens=24)
    assert compiled.engine.worker.runner.forward is not compiled.engine.worker.runner.model.forward
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
