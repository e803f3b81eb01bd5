"""AsyncLLMEngine over its engine core (on a thread here; in a process of its own at the end): streams
equal the offline outputs, concurrent requests do not disturb each other, an early-closed stream or an
abort frees the request's blocks, a bad request fails alone, a failed step fails only its requests, a
slow reader gets merged deltas, and a dead core process fails every stream and every new request."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import shutil
import time
from pathlib import Path

import pytest

from fastllm import BeamSearchParams, SamplingParams
from fastllm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from fastllm.engine.llm_engine import LLMEngine
from fastllm.sampling_params import RequestOutputKind
from tests.conftest import PROMPTS, STORIES, cached_llm, python_sigint_handler
from tests.engine.engine_testing import count_steps, wait_idle
from tests.engine.test_bad_input import PoisonedStep


STORIES_DIR = Path(STORIES)
PERIOD = 426  # "."


def in_thread(**kwargs) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine.from_kwargs(None, device="cpu", dtype="float32", **kwargs))


@pytest.fixture(scope="module")
def engine():
    eng = in_thread(num_gpu_blocks=256)
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


def test_min_tokens_beyond_the_context_is_refused_and_holds_nothing(engine):
    """With max_tokens None, min_tokens had no bound: past 2**64 it could not be sent to the core (an
    OverflowError, the request left held in this process); past the room the prompt leaves it asks for
    what can never be generated."""
    async def main():
        for min_tokens in (10**20, 600):
            with pytest.raises(ValueError, match="SamplingParams.min_tokens"):
                await engine.add_request(f"min-{min_tokens}", PROMPTS[0],
                                         SamplingParams(max_tokens=None, min_tokens=min_tokens))
        return await collect(engine, PROMPTS[0], SamplingParams(max_tokens=None, min_tokens=8), "fine")

    outs = asyncio.run(main())
    assert len(outs[-1].outputs[0].token_ids) >= 8
    assert not engine.output_processor.groups and not engine._streams
    wait_idle(engine)
    with pytest.raises(ValueError, match="SamplingParams.min_tokens"):
        engine.engine.add_request("offline", PROMPTS[0], SamplingParams(max_tokens=None, min_tokens=600))


def test_failed_step_fails_its_request_and_the_engine_serves_on(engine):
    """The step of `poison` raises: its stream raises RequestFailedError with the cause, and the
    engine goes on serving the requests after it."""
    async def main():
        with PoisonedStep(engine.engine, "poison", "launch"):
            with pytest.raises(RequestFailedError, match="planted launch failure"):
                await collect(engine, PROMPTS[0], greedy(max_tokens=50), "poison")
        return await collect(engine, PROMPTS[1], greedy(), "after")

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert engine.errored is None
    wait_idle(engine)


def test_an_id_used_again_at_once_gets_only_its_own_outputs(engine):
    """A request id is free again as soon as its request has ended here, while the core may still send
    outputs of the old request (until the abort, or the stop for a stop string found here, reaches it):
    those went to the new request (a stream that began with another prompt's tokens), and a dropped stream
    of the old request, collected later, aborted the new one."""
    short = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = cached_llm(device="cpu", dtype="float32").generate(PROMPTS[1], short, use_tqdm=False)[0]
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def again(request_id: str) -> list[int]:
        outs = await collect(engine, PROMPTS[1], short, request_id)
        assert outs and outs[-1].finished, "the new request was aborted"
        return outs[-1].outputs[0].token_ids

    async def main():
        got = []
        for end in (lambda: engine.abort("a"), lambda: engine.end_all("ended")):
            stream = await engine.add_request("a", PROMPTS[0], long)
            await anext(stream)
            time.sleep(0.1)  # the loop busy a moment: the old request's outputs queue up meanwhile
            end()
            got.append(await again("a"))
        for _ in range(5):  # ended here by a stop string, which the core learns of a message later
            stopped = SamplingParams(temperature=0, max_tokens=200, stop=["park"])
            outs = await collect(engine, PROMPTS[0], stopped, "b")
            assert outs[-1].outputs[0].finish_reason == "stop"
            got.append(await again("b"))
        stream = await engine.add_request("c", PROMPTS[0], long)
        engine.abort("c")
        cycle = [stream, None]
        cycle[1] = cycle  # (collected only by a later gc run)
        del stream, cycle
        new = await engine.add_request("c", PROMPTS[1], short)
        first = await anext(new)
        gc.collect()  # the old stream's __del__ aborted "c": the new request
        outs = [first] + [out async for out in new]
        assert outs[-1].finished, "the new request was aborted"
        got.append(outs[-1].outputs[0].token_ids)
        return got

    assert asyncio.run(main()) == [want.outputs[0].token_ids] * 8
    wait_idle(engine)


def test_a_shut_down_engine_refuses_requests_by_saying_so():
    """They raised ZeroMQ's "Socket operation on non-socket"."""
    engine = in_thread(num_gpu_blocks=64)
    engine.shutdown()

    async def main():
        with pytest.raises(EngineDeadError, match="the engine was shut down"):
            await engine.add_request("late", PROMPTS[0], greedy())
        with pytest.raises(EngineDeadError, match="the engine was shut down"):
            await engine.call_core("is_idle")
    asyncio.run(main())
    assert not engine._streams and not engine.output_processor.groups


def test_slow_reader_gets_merged_deltas(engine):
    """A reader that does not keep up reads fewer outputs, each carrying every token since its last
    read; together they are the whole text and tokens."""
    want = cached_llm(device="cpu", dtype="float32").generate(PROMPTS[2], greedy(max_tokens=40),
                                                              use_tqdm=False)[0].outputs[0]

    async def main():
        outs = []
        async for out in engine.generate(PROMPTS[2], greedy(RequestOutputKind.DELTA, 40), "slow"):
            outs.append(out)
            await asyncio.sleep(0.05)
        return outs

    outs = asyncio.run(main())
    assert "".join(o.outputs[0].text for o in outs) == want.text
    assert [t for o in outs for t in o.outputs[0].token_ids] == want.token_ids
    assert len(outs) < 40 and outs[-1].finished
    wait_idle(engine)


def test_request_ids_the_core_could_not_read_are_refused_by_name():
    """A request id crosses to the core's process as a UTF-8 string: an int there stopped the core (its loop
    could not decode the message), so ids of another type or with a lone surrogate are refused here."""
    eng = AsyncLLMEngine.from_kwargs(None, device="cpu", dtype="float32", num_gpu_blocks=64)

    async def main():
        for request_id in (5, None, b"id", "\ud800"):
            with pytest.raises(ValueError, match="^request_id "):
                await eng.add_request(request_id, PROMPTS[0], greedy())
            with pytest.raises(ValueError, match="^request_id "):
                await eng.add_beam_search(request_id, PROMPTS[0], BeamSearchParams(2, max_tokens=2))
        return await collect(eng, PROMPTS[0], greedy(max_tokens=4), "")  # (any string will do)
    try:
        outs = asyncio.run(main())
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    finally:
        eng.shutdown()


def test_core_process_serves_through_a_sigterm_to_its_group():
    """A SIGTERM to the whole process group (systemd's stop, `timeout`) reaches the server, which lets its
    requests in flight finish and then shuts the core down: the core itself keeps serving (it died at once,
    failing every request in flight with "exited with code -15")."""
    import os
    import signal

    eng = AsyncLLMEngine.from_kwargs(None, device="cpu", dtype="float32", num_gpu_blocks=64)

    async def main():
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        stream = await eng.add_request("in-flight", PROMPTS[0], params)
        os.kill(eng.client._core.proc.pid, signal.SIGTERM)
        [out] = [o async for o in stream]
        after = await collect(eng, PROMPTS[1], greedy(RequestOutputKind.FINAL_ONLY, 4), "after")
        return out, after

    try:
        out, after = asyncio.run(asyncio.wait_for(main(), timeout=60))
        assert out.finished and len(out.outputs[0].token_ids) == 24 and after[-1].finished
        assert eng.client.dead is None
    finally:
        eng.shutdown()
    assert eng.client._core.proc.returncode == 0  # Shutdown ended it, as before


def test_a_start_stopped_by_ctrl_c_kills_the_core_process_at_once(monkeypatch):
    """Ctrl-C (or a SIGTERM handler's exception) while the core process builds its engine: the core, which
    reads no Shutdown before it is ready, is killed before the KeyboardInterrupt leaves; it was waited for
    at exit (5 s), then killed."""
    import os
    import signal
    import threading

    from fastllm.engine import core_client

    cores, start, sent = [], core_client._CoreProcess.__init__, []

    def ctrl_c():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    def started(self, *args):
        start(self, *args)
        cores.append(self)
        threading.Timer(0.3, ctrl_c).start()  # (the core imports torch for seconds)

    monkeypatch.setattr(core_client._CoreProcess, "__init__", started)
    with python_sigint_handler(), pytest.raises(KeyboardInterrupt):
        AsyncLLMEngine.from_kwargs(None, device="cpu", dtype="float32", num_gpu_blocks=64)
    assert time.monotonic() - sent[0] < 2.5
    [core] = cores
    assert core.proc.returncode == -signal.SIGKILL and core.sentinel is None


def test_the_core_refuses_an_eos_token_id_outside_the_vocabulary_by_name(engine):
    """Each request carries its EOS to the core (the API process's tokenizer's): the core checks it as it
    checks the prompt's token ids, and serves on."""
    core, vocab = engine.engine.core, engine.engine.vocab_size
    for eos in (-1, vocab, 10**30, True, 2.0, "2"):
        with pytest.raises(ValueError, match=rf"^eos_token_id must be an integer in \[0, {vocab}\), got "):
            core.add_request("bad-eos", [1, 2, 3], greedy(), eos)
        with pytest.raises(ValueError, match=r"^eos_token_id must be"):
            core.add_beam_search("bad-eos", [1, 2, 3], BeamSearchParams(2, max_tokens=2), eos)
    outs = asyncio.run(collect(engine, PROMPTS[0], greedy(max_tokens=4), "bad-eos"))  # (the id is free)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    wait_idle(engine)


def test_a_core_process_ends_requests_at_the_api_processs_tokenizers_eos(tmp_path):
    """The core process loads no tokenizer: a tokenizer whose EOS is "." (the config says </s>) ends
    requests at the first ".", because the API process sends its EOS with each request."""
    for f in STORIES_DIR.iterdir():
        shutil.copy(f, tmp_path)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        settings = json.loads((tmp_path / name).read_text())
        (tmp_path / name).write_text(json.dumps({**settings, "eos_token": "."}))
    eng = AsyncLLMEngine.from_kwargs(str(tmp_path), device="cpu", dtype="float32", num_gpu_blocks=64)
    try:
        assert eng.client.ready.config_eos_token_id == 2 and eng.eos_token_id == PERIOD
        outs = asyncio.run(collect(eng, PROMPTS[0], greedy(RequestOutputKind.FINAL_ONLY, 100), "r"))
        tokens = outs[-1].outputs[0].token_ids
        assert outs[-1].outputs[0].finish_reason == "stop" and tokens[-1] == PERIOD and PERIOD not in tokens[:-1]
    finally:
        eng.shutdown()


def test_dead_core_process_fails_every_stream_and_new_request():
    """The core in its own process, killed mid-stream: the open stream raises EngineDeadError, the
    death callback runs, and add_request raises it too; nothing hangs."""
    import os
    import signal

    eng = AsyncLLMEngine.from_kwargs(None, device="cpu", dtype="float32", num_gpu_blocks=64)
    deaths = []
    eng.on_death(deaths.append)

    async def main():
        first = await collect(eng, PROMPTS[0], greedy(RequestOutputKind.DELTA, 8), "alive")
        stream = await eng.add_request("doomed", PROMPTS[1], SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        os.kill(eng.client._core.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request("late", PROMPTS[2], greedy())
        return first

    try:
        first = asyncio.wait_for(main(), timeout=60)
        assert "".join(o.outputs[0].text for o in asyncio.run(first)) != ""
        assert deaths and "-9" in deaths[0]
    finally:
        eng.shutdown()
