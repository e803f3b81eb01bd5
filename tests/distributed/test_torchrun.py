"""Under torchrun every rank runs the same command: rank 0's engine serves and the others turn into its
workers inside LLM(...), then all of them exit cleanly. `fastllm generate` at TP 2 on the CPU writes
one process's story."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fastllm import SamplingParams
from fastllm.worker.executor import free_port
from tests.conftest import cached_llm

REPO = Path(__file__).resolve().parents[2]


def test_fastllm_generate_under_torchrun():
    prompt = "Once upon a time"
    want = cached_llm().generate([prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "fastllm", "generate", "--tensor-parallel-size", "2",
               "--device", "cpu", "--dtype", "float32", "--max-tokens", "16", prompt]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == prompt + want[0].outputs[0].text
