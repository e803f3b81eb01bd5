"""max_num_seqs left unset is decided by the device: 512 on GPUs of 70 GiB or more, else 256."""

from __future__ import annotations

import pytest
import torch

from fastllm.config import (DEFAULT_MAX_NUM_SEQS, LARGE_GPU_GIB, LARGE_GPU_MAX_NUM_SEQS, EngineConfig,
                            default_max_num_seqs)
from fastllm.core.scheduler import Scheduler


def test_unset_max_num_seqs_is_decided_by_the_device():
    config = EngineConfig.from_kwargs(None)
    assert config.scheduler.max_num_seqs is None
    assert config.for_device(torch.device("cpu")).scheduler.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    explicit = EngineConfig.from_kwargs(None, max_num_seqs=7)
    assert explicit.for_device(torch.device("cpu")) is explicit


def test_scheduler_refuses_an_unresolved_config():
    config = EngineConfig.from_kwargs(None)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(config.scheduler, config.cache, 64, 16)


def test_engine_runs_with_the_resolved_value():
    from tests.conftest import cached_llm

    engine = cached_llm().engine
    expected = default_max_num_seqs(engine.worker.device)
    assert engine.config.scheduler.max_num_seqs == engine.scheduler.config.max_num_seqs == expected


@pytest.mark.gpu
def test_large_gpus_default_to_larger_batches():
    device = torch.device("cuda")
    large = torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_GIB * 2**30
    resolved = EngineConfig.from_kwargs(None).for_device(device).scheduler.max_num_seqs
    assert resolved == (LARGE_GPU_MAX_NUM_SEQS if large else DEFAULT_MAX_NUM_SEQS)
