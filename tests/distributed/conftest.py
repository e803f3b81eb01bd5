"""Helpers of the tensor/pipeline-parallel tests: engines of several ranks (one at a time per process:
torch.distributed has one default group), models to split, and the single-process reference."""

from __future__ import annotations

import pytest

from tests.conftest import _live_engines


# A small KV pool for every engine of these tests, parallel or reference (the CPU default, 0.25 GiB a
# rank, adds up over the engines one session keeps).
SMALL_KV = dict(num_gpu_blocks=160)


def odd_vocab_config(tmp_path_factory) -> str:
    """A Qwen2 config (qkv bias) whose vocabulary of 509 does not split evenly over 2 or 4 ranks: the
    last rank's rows of the embedding and lm_head end in padding. Dummy weights (no checkpoint)."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=509, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, architectures=["Qwen2ForCausalLM"])
    path = tmp_path_factory.mktemp("qwen2-vocab509")
    config.save_pretrained(path)
    return str(path)


def start_parallel_llm(model: str, **kwargs):
    """An engine of several ranks on the CPU (float32, eager), checked like the cached ones until it
    is shut down (shutdown_parallel_llm)."""
    from fastllm import LLM

    llm = LLM(model, dtype="float32", device="cpu", **kwargs)
    _live_engines.append(llm)
    return llm


def forget_parallel_llm(llm) -> None:
    """Check the engine's KV pool and stop tracking it (the list would keep it alive)."""
    if llm in _live_engines:
        _live_engines.remove(llm)
        if not llm.engine.has_unfinished_requests():
            llm.engine.check_kv_pool_whole()


def shutdown_parallel_llm(llm) -> None:
    forget_parallel_llm(llm)
    llm.engine.shutdown()


@pytest.fixture
def parallel_llm():
    """Build with parallel_llm(model, **kwargs); shut down when the test ends."""
    built = []

    def build(model, **kwargs):
        built.append(start_parallel_llm(model, **kwargs))
        return built[-1]

    yield build
    for llm in built:
        shutdown_parallel_llm(llm)



def spawned_main_with_fp8_on_cpu(*args) -> None:
    """A spawned rank that runs FP8 weights and caches through the references on the CPU, as the test
    process does with conftest's allow_fp8_* fixtures (whose patches do not reach a fresh interpreter)."""
    from fastllm.layers import fp8
    from fastllm.worker import worker_process

    fp8.check_device = lambda device, scheme: None
    fp8.check_kv_cache_device = lambda device: None
    worker_process.spawned_main(*args)


@pytest.fixture
def fp8_ranks_on_cpu(monkeypatch, allow_fp8_on_cpu, allow_fp8_kv_cache_on_cpu):
    """FP8 on the CPU in this process and in the ranks engines spawn meanwhile."""
    from fastllm.worker import worker_process

    monkeypatch.setattr(worker_process, "spawned_main", spawned_main_with_fp8_on_cpu)
