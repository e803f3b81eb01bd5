"""`fastllm serve`'s path on a GPU: the engine core in its own process on CUDA (compiled, CUDA graphs),
32 concurrent streams through the HTTP server give the CPU engine's greedy float32 tokens, and afterwards
the core is idle with its KV pool whole. Marked `gpu`: skipped without CUDA."""

from __future__ import annotations

import asyncio

import pytest

from fastllm import SamplingParams
from fastllm.engine.async_llm_engine import AsyncLLMEngine
from tests.conftest import PROMPTS, cached_llm
from tests.entrypoints.conftest import MODEL, serving

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.gpu


def test_process_core_on_cuda_streams_the_cpu_tokens():
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    want = [o.outputs[0].token_ids for o in cached_llm(device="cpu", dtype="float32").generate(
        prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)]
    engine = AsyncLLMEngine.from_kwargs(None, device="cuda", dtype="float32", num_gpu_blocks=2048,
                                        max_num_seqs=64, cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64))
    try:
        with serving(engine) as url:
            async def one(client, prompt):
                ids = []
                stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=48,
                                                         temperature=0, stream=True,
                                                         extra_body={"return_token_ids": True})
                async for chunk in stream:
                    for c in chunk.choices:
                        ids += c.model_extra.get("token_ids") or []
                return ids

            async def main():
                client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
                async with client:
                    got = await asyncio.gather(*(one(client, p) for p in prompts))
                for _ in range(200):  # the core may still hold a step in flight
                    if await engine.call_core("is_idle"):  # (raises if a block is still held)
                        return got, True
                    await asyncio.sleep(0.05)
                return got, False

            got, idle = asyncio.run(main())
        assert got == want
        assert idle, "the core kept requests"
    finally:
        engine.shutdown()
