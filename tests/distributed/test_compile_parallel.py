"""The collectives are custom ops that torch.compile traces through: a sharded forward compiles as one
graph (fullgraph: a break is an error) that holds the all-reduces (a TP rank) or the pipeline's recv and
send (PP stages), and computes what the eager shard computes.

In one process: the collectives' bodies are replaced by local stand-ins (an all-reduce that returns
its input, a send that keeps the message, a recv that hands back the last message sent), which is all
tracing needs; the real collectives run in the engine tests. Dynamo's graph runs as traced (the
backend records its ops), so no code is generated.
"""

from __future__ import annotations

import pytest
import torch

from fastllm.config import EngineConfig
from fastllm.distributed import communication
from fastllm.distributed.parallel_state import ParallelRank
from fastllm.models.loader import load_model
from fastllm.worker.attn_metadata import forward_context

IDS = torch.tensor([1, 403, 407, 261, 378, 9, 22])


class LocalGroup:
    def all_reduce(self, x):
        return x.clone()


class Mailbox:
    """dist.isend / dist.recv between two stages of this process."""

    def __init__(self):
        self.last = None

    def isend(self, tensor, dst):
        self.last = tensor.clone()
        return type("Done", (), {"wait": lambda self: None})()

    def recv(self, tensor, src):
        tensor.copy_(self.last)


@pytest.fixture
def local_collectives(monkeypatch):
    mailbox = Mailbox()
    monkeypatch.setattr(communication, "get_tp_group", LocalGroup)
    monkeypatch.setattr(communication.dist, "isend", mailbox.isend)
    monkeypatch.setattr(communication.dist, "recv", mailbox.recv)
    monkeypatch.setattr(communication, "_sending", None)


def compiled_and_eager(model):
    ops: set[str] = set()

    def recording_backend(gm, example_inputs):
        ops.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    positions = torch.arange(len(IDS))
    with torch.inference_mode(), forward_context(None, model.attention_layers()):
        eager = model(IDS, positions)
        compiled = torch.compile(model.forward, fullgraph=True, dynamic=True, backend=recording_backend)
        compiled = compiled(IDS, positions)
    return {op for op in ops if op.startswith("fastllm.")}, eager, compiled


@pytest.mark.parametrize("rank,expected", [
    (ParallelRank.of(1, 2, 1), {"fastllm.tp_all_reduce"}),
    (ParallelRank.of(0, 1, 2), {"fastllm.pp_send"}),
    (ParallelRank.of(1, 1, 2), {"fastllm.pp_recv"}),
], ids=["tp-rank", "first-stage", "last-stage"])
def test_sharded_forward_compiles_as_one_graph(local_collectives, rank, expected):
    config = EngineConfig.from_kwargs(None, dtype="float32").model
    if rank.pp_rank == 1:  # the last stage receives what the first one sends
        compiled_and_eager(load_model(config, torch.device("cpu"), ParallelRank.of(0, 1, 2)))
    ops, eager, compiled = compiled_and_eager(load_model(config, torch.device("cpu"), rank))
    assert expected <= ops, ops
    assert torch.equal(eager, compiled)
