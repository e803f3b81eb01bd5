"""Bad input gets a clear ValueError, never takes the engine down, never leaks KV blocks."""

from __future__ import annotations

import json

import pytest

from fastllm import LLM, SamplingParams
from fastllm.engine.llm_engine import LLMEngine
from tests.conftest import PROMPTS, cached_llm

INVALID_PARAMS = [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1), ("logprobs", 21), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("stop", [""]), ("stop_token_ids", [-1]),
    ("seed", 1.5),
]


@pytest.mark.parametrize("field,value", INVALID_PARAMS)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_bad_requests_leave_the_engine_serving():
    llm = cached_llm(max_model_len=128)
    engine = llm.engine
    engine.add_request("good", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))
    bad = [
        ("", SamplingParams()),
        ({"prompt_token_ids": []}, SamplingParams()),
        ({"prompt_token_ids": [1, 99999]}, SamplingParams()),
        (PROMPTS[1], SamplingParams(max_tokens=200)),  # prompt + max_tokens > max_model_len
        ({"prompt_token_ids": [5] * 128}, SamplingParams(max_tokens=None)),  # no room left at all
        (12, SamplingParams()),
    ]
    for prompt, params in bad:
        with pytest.raises(ValueError):
            engine.add_request("bad", prompt, params)
        engine.step()  # the good request keeps going
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", PROMPTS[2], SamplingParams())
    finished = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished = out
    assert finished.request_id == "good" and len(finished.outputs[0].token_ids) == 20
    engine.check_kv_pool_whole()


def test_generate_with_one_bad_prompt_queues_nothing():
    llm = cached_llm(max_model_len=128)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(PROMPTS[:3] + [{"prompt_token_ids": [3] * 120}], SamplingParams(max_tokens=16), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_kv_pool_whole()
    assert len(llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)) == 2


def test_abort_frees_blocks():
    llm = cached_llm()
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=50, n=2))
    for _ in range(3):
        engine.step()
    engine.abort_request(["r1", "r3"])
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"r0", "r2"}
    engine.check_kv_pool_whole()


def test_missing_model_directory():
    with pytest.raises(ValueError, match="not a directory"):
        LLM("/nonexistent/model/dir")


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="no safetensors weights"):
        LLM(str(tmp_path), device="cpu")
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy")  # dummy weights need none
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 16}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(tmp_path), device="cpu", load_format="dummy")


def test_unknown_engine_argument():
    with pytest.raises(ValueError, match="unknown engine argument 'max_num_seq'"):
        LLMEngine.from_kwargs(None, max_num_seq=4)


@pytest.mark.parametrize("kwargs,field", [(dict(dtype="int8"), "dtype"), (dict(block_size=3), "block_size"),
                                          (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                                          (dict(max_model_len=100000), "max_model_len"),
                                          (dict(preemption_mode="drop"), "preemption_mode")])
def test_invalid_engine_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLMEngine.from_kwargs(None, **kwargs)


def test_sliding_window_models_run_to_their_full_context():
    from fastllm.config import EngineConfig

    config = EngineConfig.from_kwargs("mistral-7b-v0.1", load_format="dummy")
    assert config.model.max_model_len == 32768  # the window (4096) is attended within, not a cap
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 32768\]"):
        EngineConfig.from_kwargs("mistral-7b-v0.1", load_format="dummy", max_model_len=32769)
