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
