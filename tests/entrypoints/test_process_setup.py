"""The commands' process-wide settings: garbage-collector thresholds raised so decode steps do not
collect (FASTLLM_GC_THRESHOLD to choose others), one torch thread for tiny models on the CPU; and the
library itself changes neither."""

from __future__ import annotations

import gc

import pytest
import torch

from fastllm import LLM, SamplingParams
from fastllm.config import EngineConfig
from fastllm.entrypoints.process_setup import DEFAULT_THRESHOLD, prepare_gc_for_serving, read_gc_threshold, \
    set_cpu_threads
from tests.conftest import STORIES


@pytest.fixture
def restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.set_threshold(*threshold)
    gc.unfreeze()


def test_threshold_from_the_environment(monkeypatch):
    monkeypatch.delenv("FASTLLM_GC_THRESHOLD", raising=False)
    assert read_gc_threshold() == DEFAULT_THRESHOLD
    monkeypatch.setenv("FASTLLM_GC_THRESHOLD", "700,10,10")
    assert read_gc_threshold() == (700, 10, 10)
    monkeypatch.setenv("FASTLLM_GC_THRESHOLD", " 5000 ")
    assert read_gc_threshold() == (5000,)
    for bad in ["x", "1,2,3,4", "-1", "1,,2"]:
        monkeypatch.setenv("FASTLLM_GC_THRESHOLD", bad)
        with pytest.raises(ValueError, match="FASTLLM_GC_THRESHOLD"):
            read_gc_threshold()


def test_prepare_sets_the_thresholds(restore_gc):
    prepare_gc_for_serving((1234, 5, 6))
    assert gc.get_threshold() == (1234, 5, 6)
    prepare_gc_for_serving((4321,))
    assert gc.get_threshold() == (4321, 5, 6)


def test_a_malformed_setting_fails_before_the_engine_loads(monkeypatch, capsys):
    import fastllm.engine.llm_engine as llm_engine
    from fastllm.entrypoints.cli import main

    monkeypatch.setattr(llm_engine, "Worker", lambda config: pytest.fail("the worker was built"))
    monkeypatch.setenv("FASTLLM_GC_THRESHOLD", "lots")
    assert main(["generate", "--device", "cpu"]) == 2
    assert "FASTLLM_GC_THRESHOLD" in capsys.readouterr().err


def test_the_library_leaves_the_process_settings_alone(monkeypatch):
    monkeypatch.setenv("FASTLLM_GC_THRESHOLD", "12345")
    before = gc.get_threshold(), gc.get_freeze_count(), torch.get_num_threads()
    llm = LLM(STORIES, dtype="float32", device="cpu")
    llm.generate("Once upon a time", SamplingParams(max_tokens=2), use_tqdm=False)
    assert (gc.get_threshold(), gc.get_freeze_count(), torch.get_num_threads()) == before
    llm.engine.check_kv_pool_whole()


def test_tiny_models_run_one_thread_on_the_cpu(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        set_cpu_threads(EngineConfig.from_kwargs("llama-3.1-8b", load_format="dummy", device="cpu"))
        assert torch.get_num_threads() == 2  # not tiny
        set_cpu_threads(EngineConfig.from_kwargs(STORIES, device="cuda"))
        assert torch.get_num_threads() == 2  # not on the CPU
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        set_cpu_threads(EngineConfig.from_kwargs(STORIES, device="cpu"))
        assert torch.get_num_threads() == 2  # the user's choice
        monkeypatch.delenv("OMP_NUM_THREADS")
        set_cpu_threads(EngineConfig.from_kwargs(STORIES, device="cpu"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def count_decode_collections(engine, num_requests: int, max_tokens: int) -> dict[int, int]:
    """Collections per generation while `num_requests` requests decode (after their prefill step)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    for i in range(num_requests):
        engine.add_request(f"gc-{i}", {"prompt_token_ids": [1, 3 + i % 400, 7, 9]}, params)
    engine.step()  # every prompt in one step (4 tokens each, within the token budget)
    counts = {0: 0, 1: 0, 2: 0}

    def count(phase, info):
        if phase == "start":
            counts[info["generation"]] += 1

    gc.collect()
    gc.callbacks.append(count)
    try:
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    finally:
        gc.callbacks.remove(count)
    assert steps >= max_tokens - 1
    return counts


def test_decode_steps_of_256_requests_do_not_collect(make_llm, restore_gc):
    """At CPython's default gen-0 threshold (700) each such step collected about three times."""
    engine = make_llm().engine
    prepare_gc_for_serving()  # as the commands do once the engine is built
    assert gc.get_threshold() == DEFAULT_THRESHOLD
    assert count_decode_collections(engine, 256, 12) == {0: 0, 1: 0, 2: 0}
