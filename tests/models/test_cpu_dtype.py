"""On the CPU a half-precision checkpoint runs in float32 unless dtype says otherwise (logged)."""

from __future__ import annotations

import logging

import torch

from fastllm import LLM
from tests.conftest import STORIES


def test_a_bf16_checkpoint_runs_in_float32_on_the_cpu(caplog):
    with caplog.at_level(logging.INFO, logger="fastllm.models.loader"):
        llm = LLM(STORIES, device="cpu", num_gpu_blocks=64)  # config.json says bfloat16
    assert llm.engine.worker.runner.dtype == torch.float32
    assert "bfloat16 checkpoint: the CPU runs it in float32" in caplog.text
    assert LLM(STORIES, device="cpu", dtype="bfloat16", num_gpu_blocks=64).engine.worker.runner.dtype == torch.bfloat16
