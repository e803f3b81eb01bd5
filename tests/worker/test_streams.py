"""streams.py: a Worker's GPU work runs on the engine's own stream (its graphs captured there), and events
go to the stream a thread queues work on, inside a Worker or not."""

import pytest
import torch

from fastllm import SamplingParams
from fastllm.worker.streams import current_stream, engine_stream, on_engine_stream
from tests.conftest import cached_llm


@pytest.mark.gpu
def test_current_stream_is_the_threads():
    device = torch.device("cuda")
    default = torch.cuda.default_stream()
    assert current_stream(device) == default and current_stream(torch.device("cuda", 0)) == default
    assert engine_stream(device) is engine_stream(torch.device("cuda", torch.cuda.current_device()))
    assert engine_stream(device) != default
    with on_engine_stream(device):
        assert torch.cuda.current_stream() == engine_stream(device) == current_stream(device)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert current_stream(device) == side
        assert current_stream(device) == engine_stream(device)
    assert current_stream(device) == default
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the caller's own stream is set back, also after a nested entry
        with on_engine_stream(device):
            with on_engine_stream(device):
                assert torch.cuda.current_stream() == engine_stream(device)
            assert torch.cuda.current_stream() == engine_stream(device)
        assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == default


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_engine_stream_of_another_device_leaves_the_current_device_as_it_was():
    other = torch.device("cuda", 1)
    with torch.cuda.device(0):
        side = torch.cuda.Stream(0)
        with torch.cuda.stream(side):
            with on_engine_stream(other):
                assert torch.cuda.current_device() == 1
                assert torch.cuda.current_stream(1) == engine_stream(other)
                assert torch.cuda.current_stream(0) == side
            assert torch.cuda.current_device() == 0
            assert torch.cuda.current_stream(0) == side
            assert torch.cuda.current_stream(1) == torch.cuda.default_stream(1)


@pytest.mark.gpu
def test_a_workers_steps_run_on_the_engine_stream(monkeypatch):
    llm = cached_llm(device="cuda", dtype="float32", max_num_seqs=8)
    worker = llm.engine.worker
    runner = worker.runner
    seen = []
    execute = runner.execute_model

    def recording(sched):
        seen.append(torch.cuda.current_stream(worker.device))
        return execute(sched)

    monkeypatch.setattr(runner, "execute_model", recording)
    params = SamplingParams(temperature=0, max_tokens=8)
    greedy = llm.generate(["Once upon a time", "The cat"], params)
    stream = engine_stream(worker.device)
    assert seen and all(s == stream for s in seen)
    assert runner.graphs is not None and runner.graphs.capture_stream == stream
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the caller's stream is left as it was
    again = llm.generate(["Once upon a time", "The cat"], params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in greedy]
