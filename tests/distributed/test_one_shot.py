"""The one-shot all-reduce's choice of path, on the CPU (tests/distributed/test_gpu_parallel.py sums on GPUs)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from fastllm.distributed import one_shot
from fastllm.worker.executor import free_port


def test_a_group_name_rendezvoused_before_in_this_process_takes_nccl(monkeypatch, caplog):
    """torch keeps a group's symmetric-memory store by name for the process's life, and a later engine's
    groups reuse the names: the later engine's ranks would rendezvous on different stores and hang."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        monkeypatch.setenv(one_shot.ENV_MAX_BYTES, str(1 << 20))
        monkeypatch.setattr(one_shot, "unavailable_reason", lambda *args: None)  # as on GPUs with P2P
        monkeypatch.setattr(one_shot, "_rendezvoused", {group.group_name: object()})  # an earlier engine's
        with caplog.at_level(logging.INFO, logger=one_shot.__name__):
            assert one_shot.OneShotAllReduce.create(group, torch.device("cpu"), torch.float32, group) is None
        assert f"rendezvoused on group name {group.group_name!r}" in caplog.text
        # The same group (a model reloaded into the same ranks) goes on to the one-shot path.
        monkeypatch.setattr(one_shot, "_rendezvoused", {group.group_name: group})
        monkeypatch.setattr(one_shot.OneShotAllReduce, "__init__", lambda self, *args: None)
        assert isinstance(one_shot.OneShotAllReduce.create(group, torch.device("cpu"), torch.float32, group),
                          one_shot.OneShotAllReduce)
    finally:
        dist.destroy_process_group()
