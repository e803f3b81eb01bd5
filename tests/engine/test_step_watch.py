"""The engine's stall watch: steps over core.SLOW_STEP_SECONDS and compiles during steps are counted in
SchedulerStats (the server's /metrics, `bench serving`'s columns) and logged."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from fastllm import LLM, SamplingParams
from fastllm.engine import core as core_module
from tests.conftest import STORIES

triton = pytest.importorskip("triton")


def test_slow_steps_and_compiles_are_counted_and_logged(monkeypatch, caplog):
    llm = LLM(STORIES, device="cpu", enforce_eager=True, cpu_kv_cache_gib=0.01)
    core = llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=4)
    llm.generate(["Once upon a time"], params, use_tqdm=False)  # warmed up: nothing new to compile
    assert (core.stats.num_compiles, core.stats.num_slow_steps) == (0, 0)
    triton.knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="_old_kernel"))  # between steps
    llm.generate(["Once upon a time"], params, use_tqdm=False)  # the next step counts it
    assert core.stats.num_compiles == 1

    execute = core.executor.execute_model
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    calls = []

    def execute_and_compile(scheduler_output):
        if not calls:  # the first step meets a new Triton kernel and a new torch.compile graph
            triton.knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="_new_kernel"))
            compiled(torch.ones(3))
        calls.append(1)
        return execute(scheduler_output)

    monkeypatch.setattr(core.executor, "execute_model", execute_and_compile)
    monkeypatch.setattr(core_module, "SLOW_STEP_SECONDS", 0.0)  # every step is slow
    with caplog.at_level(logging.WARNING, logger="fastllm.engine.core"):
        out = llm.generate(["Once upon a time"], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    steps = core.stats.num_steps
    assert core.stats.num_compiles == 3
    assert 4 <= core.stats.num_slow_steps <= steps
    assert any(r.getMessage() == "a step compiled 2 kernels or graphs (Triton: _new_kernel)" for r in caplog.records)
    slow = [re.fullmatch(r"a step took [\d.]+ s: it launched (\d+) tokens of (\d+) requests and finished "
                         r"(\d+) tokens of (\d+) requests, \d+ compiles", r.getMessage())
            for r in caplog.records if "a step took" in r.getMessage()]
    assert len(slow) == core.stats.num_slow_steps and all(slow)
    # Each step's work is named once as launched and once as finished (it said launched only: a step that
    # waited out an earlier one's work could read "0 tokens of 0 requests").
    launched, finished = ([sum(int(m.group(i)) for m in slow) for i in group] for group in ((1, 2), (3, 4)))
    assert launched == finished and launched[0] >= 5 + 3, (launched, finished)  # prompt + 3 decode tokens
    llm.engine.check_kv_pool_whole()


def test_engines_share_one_compile_hook():
    """Every engine reads the process's one watch: building engines does not chain hooks."""
    LLM(STORIES, device="cpu", enforce_eager=True, cpu_kv_cache_gib=0.01)
    hook = triton.knobs.runtime.jit_post_compile_hook
    second = LLM(STORIES, device="cpu", enforce_eager=True, cpu_kv_cache_gib=0.01)
    assert triton.knobs.runtime.jit_post_compile_hook is hook
    assert second.engine.core._kernel_compiles is core_module.process_watch()
