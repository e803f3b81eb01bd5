"""AsyncLLMEngine: streams equal the offline outputs, concurrent requests do not disturb each other, an
early-closed stream or an abort frees the request's blocks, and a bad request fails alone."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from fastllm import SamplingParams
from fastllm.engine.async_llm_engine import AsyncLLMEngine
from fastllm.sampling_params import RequestOutputKind
from tests.conftest import PROMPTS, cached_llm
from tests.engine.engine_testing import count_steps, wait_idle


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLMEngine.from_kwargs(None, device="cpu", dtype="float32", num_gpu_blocks=256)
    yield eng
    eng.shutdown()
    eng.engine.check_kv_pool_whole()


def greedy(kind=RequestOutputKind.CUMULATIVE, max_tokens=32):
    return SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=kind)


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_streams_equal_offline_outputs(engine):
    offline = [o.outputs[0].text for o in cached_llm(device="cpu", dtype="float32").generate(
        PROMPTS, greedy(), use_tqdm=False)]

    async def main():
        cumulative = collect(engine, PROMPTS[0], greedy(), "c0")
        deltas = [collect(engine, p, greedy(RequestOutputKind.DELTA), f"d{i}") for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(cumulative, *deltas)

    cumulative, *deltas = asyncio.run(main())
    assert cumulative[-1].finished and not any(o.finished for o in cumulative[:-1])
    assert cumulative[-1].outputs[0].text == offline[0]
    assert [o.outputs[0].text for o in cumulative] == sorted((o.outputs[0].text for o in cumulative), key=len)
    for outs, want in zip(deltas, offline):  # concurrent, each stream its own request's text
        assert "".join(o.outputs[0].text for o in outs) == want
    wait_idle(engine)


def test_closed_stream_and_abort_free_the_blocks(engine):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main(steps):
        stream = engine.generate(PROMPTS[1], long, "early")
        first = await anext(stream)
        await stream.aclose()  # the consumer leaves after one output
        left_at = steps[0]
        for _ in range(500):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert steps[0] - left_at < 100, "the engine kept generating after the consumer left"
        aborted = []

        async def consume():
            async for out in engine.generate(PROMPTS[2], long, "aborted"):
                aborted.append(out)
                if len(aborted) == 2:
                    engine.abort("aborted")
        await consume()
        return first, aborted

    with count_steps(engine) as steps:
        first, aborted = asyncio.run(main(steps))
        wait_idle(engine)
    # ended without a last output; outputs already on their way when abort() was called may still arrive
    assert not first.finished and 2 <= len(aborted) < 20 and not aborted[-1].finished
    assert steps[0] < 200, "aborted requests ran on"


def test_unread_stream_closed_or_dropped_aborts(engine):
    """A request taken but never read (a server whose next prompt was refused) is aborted when its
    stream is closed, or dropped, without a single output read."""
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        closed = await engine.add_request("closed", PROMPTS[3], long)
        await closed.aclose()
        dropped = await engine.add_request("dropped", PROMPTS[4], long)
        del dropped
    with count_steps(engine) as steps:
        asyncio.run(main())
        wait_idle(engine)
    assert steps[0] < 100, "unread requests ran on"


def test_bad_request_fails_alone(engine):
    async def main():
        good = asyncio.create_task(collect(engine, PROMPTS[0], greedy(), "good"))
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, "x" * 10, SamplingParams(max_tokens=10**6), "bad")
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, "", greedy(), "empty")
        dup = engine.generate(PROMPTS[0], greedy(max_tokens=100), "dup")
        async with contextlib.aclosing(dup):
            await anext(dup)
            with pytest.raises(ValueError, match="already in use"):
                await collect(engine, PROMPTS[0], greedy(), "dup")
        return await good

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    wait_idle(engine)


def test_failed_step_fails_open_requests_and_refuses_new_ones():
    eng = AsyncLLMEngine.from_kwargs(None, device="cpu", dtype="float32", num_gpu_blocks=64)
    real_step, calls = eng.engine.step, [0]

    def failing():
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("device lost")
        return real_step()
    eng.engine.step = failing

    async def main():
        with pytest.raises(RuntimeError, match="device lost"):
            await collect(eng, PROMPTS[0], greedy(max_tokens=50), "open")
        with pytest.raises(RuntimeError, match="stopped after an error"):
            await collect(eng, PROMPTS[1], greedy(), "new")
    try:
        asyncio.run(main())
        assert isinstance(eng.errored, RuntimeError)
    finally:
        eng.shutdown()
