"""Sliding-window models: greedy tokens equal to Hugging Face transformers past the window, on every
scheduling path, with the KV blocks a request holds bounded by the window.

The windowed model is the embedded stories260K read as a Mistral with sliding_window=32 (Mistral's weights
are named as Llama's): a trained model, so its greedy tokens have clear margins and are compared exactly,
for prompts and generations well past the window. Random tiny Mistral and Qwen2 (use_sliding_window,
max_window_layers) configs are checked in test_llama_vs_hf.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

from fastllm import SamplingParams
from fastllm.config import sliding_windows
from tests.conftest import PROMPTS, STORIES, cached_llm, hf_greedy, tokenize

WINDOW = 32
MAX_TOKENS = 80
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
         "friends. One day, she saw a big red ball")


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stories_mistral")
    shutil.copytree(STORIES, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=WINDOW)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **kw)


PROMPT_SET = PROMPTS[:4] + [STORY, STORY + " and a small dog. The dog"]  # the last two: longer than the window
_hf: dict = {}


def hf(model: str, ids: list[int]) -> list[int]:
    key = (model, tuple(ids))
    if key not in _hf:
        _hf[key] = hf_greedy(model, ids, MAX_TOKENS)
    return _hf[key]


def check(llm, model, prompts=PROMPT_SET, **kw) -> list:
    outputs = llm.generate(prompts, greedy(**kw), use_tqdm=False)
    for ids, out in zip(tokenize(prompts), outputs):
        want = hf(model, ids)
        for completion in out.outputs:
            assert completion.token_ids == want, f"prompt of {len(ids)} tokens"
    return outputs


def test_config_reads_the_windows_as_hugging_face_does():
    base = {"num_hidden_layers": 4, "max_position_embeddings": 1024}
    assert sliding_windows({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 32}) == (32,) * 4
    assert sliding_windows({**base, "architectures": ["MistralForCausalLM"]}) == (None,) * 4  # 4096 >= 1024
    assert sliding_windows({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None}) == (None,) * 4
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "max_window_layers": 2}
    assert sliding_windows(qwen) == (None,) * 4  # use_sliding_window is off by default
    assert sliding_windows({**qwen, "use_sliding_window": True}) == (None, None, 64, 64)
    types = ["sliding_attention", "full_attention"] * 2
    assert sliding_windows({**qwen, "use_sliding_window": True, "layer_types": types}) == (64, None, 64, None)
    assert sliding_windows({**base, "architectures": ["LlamaForCausalLM"], "sliding_window": 32}) == (None,) * 4


def test_max_model_len_is_the_models_context(windowed):
    # no longer capped at the window
    from fastllm.config import EngineConfig

    config = EngineConfig.from_kwargs(windowed)
    assert config.model.max_model_len == 512 and config.model.kv_sliding_window == WINDOW
    mistral = EngineConfig.from_kwargs("Mistral-7B-v0.1", load_format="dummy")
    assert mistral.model.max_model_len == 32768 and mistral.model.kv_sliding_window == 4096


@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_hf_past_the_window(windowed, block_size):
    outputs = check(cached_llm(windowed, block_size=block_size), windowed)
    assert max(len(o.prompt_token_ids) for o in outputs) > WINDOW
    # and the window matters: the same weights without it continue differently
    plain = cached_llm(STORIES, block_size=block_size).generate(PROMPT_SET, greedy(), use_tqdm=False)
    assert sum(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(outputs, plain)) >= 4


def test_chunked_prefill(windowed):
    check(cached_llm(windowed, block_size=4, max_num_batched_tokens=16, max_model_len=160), windowed)


def test_prefix_caching_hits_past_the_window(windowed):
    llm = cached_llm(windowed, block_size=4, max_model_len=160)
    stats = llm.engine.scheduler.kv.pool.stats
    check(llm, windowed)
    hits = stats.hits
    check(llm, windowed)  # the second round finds the first round's blocks
    assert stats.hits > hits


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(windowed, mode):
    llm = cached_llm(windowed, block_size=4, max_model_len=160, num_gpu_blocks=41, preemption_mode=mode,
                     num_cpu_blocks=64 if mode == "swap" else None)
    before = llm.engine.scheduler.num_preemptions
    check(llm, windowed)
    assert llm.engine.scheduler.num_preemptions > before, "the pool was meant to be too small"


def test_n_siblings(windowed):
    check(cached_llm(windowed, block_size=4, max_model_len=160), windowed, prompts=PROMPT_SET[3:], n=3)


def test_blocks_held_are_bounded_by_the_window(windowed):
    llm = cached_llm(windowed, block_size=4, max_model_len=512)
    scheduler = llm.engine.scheduler
    schedule, most, freed = scheduler.schedule, [0], [0]

    def recording():
        out = schedule()
        for req_id, n in out.num_scheduled_tokens.items():
            if n == 1:  # decode steps: the window plus the new token
                most[0] = max(most[0], scheduler.kv.num_held_blocks(req_id))
            freed[0] = max(freed[0], scheduler.kv.num_freed.get(req_id, 0))
        return out

    scheduler.schedule = recording
    try:
        out = llm.generate([STORY], greedy(400), use_tqdm=False)[0]
    finally:
        del scheduler.schedule
    assert len(out.outputs[0].token_ids) == 400
    assert freed[0] >= (400 - WINDOW) // 4  # the blocks behind the window went back as it moved
    assert most[0] <= -(-(WINDOW - 1) // 4) + 1, most[0]


# ---- on a real GPU ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_kernels_equal_reference(windowed, dtype, monkeypatch):
    # the windowed decode, fused rotary decode and prefill kernels against the reference kernels, eager
    from tests.kernels.test_model_with_kernels import BF16_MARGIN, run

    ref, _ = run(windowed, "reference", PROMPT_SET, MAX_TOKENS, dtype, monkeypatch, outputs=True, max_model_len=512)
    got, paths = run(windowed, "auto", PROMPT_SET, MAX_TOKENS, dtype, monkeypatch, outputs=True, max_model_len=512)
    assert paths and not any(m.endswith("reference") for m in paths.values()), paths
    if dtype == "float32":
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        return
    # bf16 rounds differently in the kernels: a sequence may part from the reference only where the
    # reference's own top-2 margin is a near-tie (after that the two continue from different text).
    partings = []
    for g, r in zip(got, ref):
        want = r.outputs[0]
        n = next((i for i, (a, b) in enumerate(zip(g.outputs[0].token_ids, want.token_ids)) if a != b), None)
        if n is not None:
            top = sorted(want.logprobs[n].values(), key=lambda x: -x.logprob)
            partings.append((n, round(top[0].logprob - top[1].logprob, 4)))
            assert partings[-1][1] < BF16_MARGIN, partings
    print(f"\nbf16 windowed stories260K, Triton vs reference kernels: partings (position, margin) {partings}")


@pytest.mark.gpu
def test_gpu_compiled_with_graphs_matches_hf(windowed):
    # torch.compile + CUDA graphs (decode steps replay graphs captured at max_model_len), fp32
    from fastllm import LLM

    llm = LLM(windowed, device="cuda", dtype="float32", block_size=16, max_model_len=512, num_gpu_blocks=512)
    assert llm.engine.worker.runner.graphs is not None
    check(llm, windowed)
    llm.engine.check_kv_pool_whole()


def test_a_pool_smaller_than_the_context_serves_a_windowed_model(windowed):
    """The KV a request holds is bounded by the window, so the engine starts with fewer blocks than
    max_model_len needs (27 x 4 = 108 slots for a 512-token context) and generates past it."""
    from fastllm import LLM

    llm = LLM(windowed, device="cpu", dtype="float32", block_size=4, num_gpu_blocks=28, max_model_len=512,
              max_num_batched_tokens=32)
    [out] = llm.generate([STORY], greedy(200), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(windowed, tokenize([STORY])[0], 200)
    llm.engine.check_kv_pool_whole()
    with pytest.raises(ValueError, match="fewer than the 68 one request may hold"):
        LLM(windowed, device="cpu", dtype="float32", block_size=4, num_gpu_blocks=17, max_model_len=512,
            max_num_batched_tokens=32)
