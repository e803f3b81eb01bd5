"""Bad input gets a clear ValueError, never takes the engine down, never leaks KV blocks."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import typing

import pytest

from fastllm import LLM, SamplingParams
from fastllm.config import EngineConfig
from fastllm.engine.llm_engine import LLMEngine
from tests.conftest import DRAFT, PROMPTS, STORIES, cached_llm

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


@pytest.mark.parametrize("params", ["greedy", [None], 5, [SamplingParams(), "greedy"]])
def test_sampling_params_that_are_not_any_are_refused_by_name(params):
    llm = cached_llm()
    with pytest.raises(ValueError, match="^sampling_params must be a SamplingParams"):
        llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


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
                                          (dict(preemption_mode="drop"), "preemption_mode"),
                                          (dict(enforce_eager=True, cuda_graph_sizes=(1, 2)), "cuda_graph_sizes"),
                                          # arguments that would change nothing
                                          (dict(enforce_eager=True, mixed_cuda_graph_max_tokens=0),
                                           "mixed_cuda_graph_max_tokens"),
                                          (dict(enforce_eager=True, compile_on_cpu=True), "compile_on_cpu"),
                                          (dict(distributed_timeout_s=30.0), "distributed_timeout_s"),
                                          (dict(num_gpu_blocks=64, cpu_kv_cache_gib=0.1), "cpu_kv_cache_gib"),
                                          (dict(num_gpu_blocks=64, gpu_memory_utilization=0.5),
                                           "gpu_memory_utilization"),
                                          (dict(preemption_mode="swap", num_cpu_blocks=8, swap_space_gib=1.0),
                                           "swap_space_gib")])
def test_invalid_engine_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLMEngine.from_kwargs(None, **kwargs)


DEVICE_ARGUMENTS = {"cuda": [dict(cpu_kv_cache_gib=0.1), dict(compile_on_cpu=True)],
                    "cpu": [dict(gpu_memory_utilization=0.5), dict(cuda_graph_sizes=(1, 2)),
                            dict(mixed_cuda_graph_max_tokens=64)]}


@pytest.mark.parametrize("device,kwargs", [(d, kw) for d, kws in DEVICE_ARGUMENTS.items() for kw in kws])
def test_an_argument_of_the_other_device_is_an_error(device, kwargs):
    """The CPU's KV size or compile switch on a GPU, a GPU's memory share or CUDA graphs on the CPU: each
    would change nothing there. Each passes on its own device."""
    other = "cpu" if device == "cuda" else "cuda"
    (name,) = kwargs
    with pytest.raises(ValueError, match=f"^{name} .*GPU"):
        EngineConfig.from_kwargs(None, **kwargs).check_device_args(device)
    EngineConfig.from_kwargs(None, **kwargs).check_device_args(other)
    EngineConfig.from_kwargs(None).check_device_args(device)


def test_the_engine_checks_its_device_arguments():
    with pytest.raises(ValueError, match="gpu_memory_utilization .*on the cpu"):
        LLM(STORIES, device="cpu", gpu_memory_utilization=0.5)


_WRONG_TYPES = {bool: [1, "yes", None], int: [True, 1.5, "8", float("nan")],
                float: [float("nan"), float("inf"), True, "0.5"], str: [5, b"x"]}


def _engine_arguments():
    from fastllm.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

    for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, CompileConfig, EngineConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                yield f.name, hints[f.name]


@pytest.mark.parametrize("name,kind", list(_engine_arguments()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_engine_argument_refuses_a_wrong_type_by_name(name, kind):
    """bool for int, a float for int, nan / inf for float, a number for str, ...: each a ValueError naming the
    argument, never a TypeError deep in the engine or a value taken as something else."""
    optional = type(None) in typing.get_args(kind)
    (base,) = [k for k in typing.get_args(kind) if k is not type(None)] if optional else [kind]
    wrong = [5, (1.5,), (True,), "1,2"] if typing.get_origin(base) is tuple else _WRONG_TYPES[base]
    for value in [v for v in wrong if not (optional and v is None)]:
        with pytest.raises(ValueError, match=f"^{name} "):
            LLMEngine.from_kwargs(**{name: value})


@pytest.mark.parametrize("name,value", [("num_cpu_blocks", 8), ("swap_space_gib", 2.0)])
def test_the_swap_pool_sized_without_swapping_is_refused(name, value):
    with pytest.raises(ValueError, match=f"^{name} sizes the CPU swap pool, which only preemption_mode='swap' uses"):
        LLMEngine.from_kwargs(None, **{name: value})
    # (on the CPU: on a GPU, beside other test processes, the profiling run may find no room for a pool)
    LLMEngine.from_kwargs(None, device="cpu", preemption_mode="swap", **{name: value})


@pytest.mark.parametrize("kwargs,field", [(dict(num_cpu_blocks=0), "num_cpu_blocks"),
                                          (dict(num_cpu_blocks=1), "num_cpu_blocks"),
                                          (dict(swap_space_gib=0.0), "swap_space_gib"),
                                          (dict(swap_space_gib=1e-9), "swap_space_gib")])
def test_a_swap_pool_too_small_to_swap_is_refused_by_name(kwargs, field):
    # (it used to be accepted, and every preemption recomputed)
    with pytest.raises(ValueError, match=f"^{field} gives a CPU swap pool of [01] blocks .* where "
                                         "preemption_mode='swap' needs at least 2"):
        LLM(STORIES, device="cpu", preemption_mode="swap", **kwargs)


def test_a_tokenizer_that_is_not_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="^tokenizer must be a directory holding a tokenizer"):
        LLMEngine.from_kwargs(None, tokenizer=str(tmp_path))


@pytest.mark.parametrize("kwargs,field", [(dict(num_gpu_blocks=10**12), "num_gpu_blocks"),
                                          (dict(cpu_kv_cache_gib=10**7), "cpu_kv_cache_gib"),
                                          (dict(preemption_mode="swap", swap_space_gib=10**7), "swap_space_gib"),
                                          (dict(preemption_mode="swap", num_cpu_blocks=10**12), "num_cpu_blocks")])
def test_a_kv_pool_larger_than_memory_is_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: .* KV blocks .* do not fit"):
        LLM(STORIES, device="cpu", **kwargs)


def test_sliding_window_models_run_to_their_full_context():
    from fastllm.config import EngineConfig

    config = EngineConfig.from_kwargs("mistral-7b-v0.1", load_format="dummy")
    assert config.model.max_model_len == 32768  # the window (4096) is attended within, not a cap
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, 32768\]"):
        EngineConfig.from_kwargs("mistral-7b-v0.1", load_format="dummy", max_model_len=32769)


# Every sampling field at and past the ends of its range, with wrong types: each value is either served
# or refused with a ValueError naming the field (the server test sends the same values as JSON).
INF, NAN = float("inf"), float("nan")
EXTREMES = {
    "n": [0, -1, 2, 2**31, 2**64, 1.5, True, "2", None],
    "temperature": [0, 0.0, 1e-30, 1e30, INF, -INF, NAN, -1e-9, "1", None],
    "top_p": [0, 1e-30, 1, 1.0000001, NAN, INF, -1],
    "top_k": [-2, -1, 0, 1, 2**31, 2**63 - 1, 2**63, 2**64, 1.5],
    "min_p": [0, 1, 1.5, NAN, -1e-9],
    "seed": [0, -1, 2**63 - 1, 2**64 - 1, 2**64, -2**63, -2**63 - 1, 1.5, True, "7"],
    "max_tokens": [0, 1, -1, 2**31, 2**64, 1.5],
    "min_tokens": [-1, 0, 3, 2**31],
    "stop": ["", [""], ["\ud800"], [1], "x" * 500, ["a"] * 50, 5],
    "stop_token_ids": [[-1], [0], [511], [512], [2**64], ["a"], 5],
    "logprobs": [-1, 0, 20, 21, 2**64, True],
    "prompt_logprobs": [-1, 0, 20, 21],
    "presence_penalty": [-2, 2, 2.1, NAN, INF],
    "frequency_penalty": [-2, 2, -2.1, NAN],
    "repetition_penalty": [0, 1e-30, 2, 2.1, NAN, -INF],
    "ignore_eos": [True, "yes", 1, None],
    "include_stop_str_in_output": [True, 0],
    "skip_special_tokens": [False, "no"],
    "logit_bias": [{5: 100.0}, {5: -1e30}, {511: 1.0}, {512: 1.0}, {-1: 1.0}, {}],
    "allowed_token_ids": [[0], [511], [512], [-1], [1.5], []],
    "bad_words": [["the"], [" the"], ["\ud800"], [""], [1], "the", ["x" * 500]],
}


def serve_or_refuse(engine, request_id, prompt, field, value) -> str:
    """'served' once the request ran to its end, or 'refused' on a ValueError that names the field."""
    try:
        params = SamplingParams(**{"max_tokens": 4, field: value})
        engine.add_request(request_id, prompt, params)
    except ValueError as e:
        assert field in str(e), (field, value, str(e))
        return "refused"
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
    return "served"


def test_extreme_sampling_values_are_served_or_refused_by_name():
    engine = cached_llm(max_model_len=128).engine
    seen = {}
    for field, values in EXTREMES.items():
        for i, value in enumerate(values):
            seen[(field, repr(value))] = serve_or_refuse(engine, f"{field}-{i}", PROMPTS[0], field, value)
    refused = {k for k, v in seen.items() if v == "refused"}
    # The cases and a few others are refused; the edges of each range are served.
    for case in [("seed", repr(2**64)), ("seed", repr(-2**63 - 1)), ("top_k", repr(2**63)),
                 ("n", repr(2**31)), ("temperature", repr(INF)), ("top_p", repr(NAN)),
                 ("stop", repr(["\ud800"])), ("stop_token_ids", repr([512])), ("logprobs", repr(21)),
                 ("n", repr(True)), ("logit_bias", repr({512: 1.0})), ("allowed_token_ids", repr([512])),
                 ("bad_words", repr(["\ud800"]))]:
        assert case in refused, case
    for case in [("seed", repr(2**64 - 1)), ("seed", repr(-2**63)), ("top_k", repr(2**63 - 1)),
                 ("temperature", repr(1e30)), ("stop_token_ids", repr([511])), ("logprobs", repr(20)),
                 ("n", repr(2)), ("logit_bias", repr({5: -1e30})), ("allowed_token_ids", repr([511])),
                 ("bad_words", repr(["the"]))]:
        assert seen[case] == "served", case
    good = cached_llm(max_model_len=128).generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8),
                                                  use_tqdm=False)[0]
    assert len(good.outputs[0].token_ids) == 8 and good.outputs[0].finish_reason == "length"
    engine.check_kv_pool_whole()


COMBINED_ENGINES = {  # pools of 136 tokens, which a batch outgrows (preemption); or speculation
    "recompute": dict(num_gpu_blocks=34, block_size=4, max_num_batched_tokens=16),
    "swap": dict(num_gpu_blocks=34, block_size=4, preemption_mode="swap", num_cpu_blocks=64),
    "ngram": dict(num_gpu_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    "draft": dict(num_gpu_blocks=64, speculative_model=DRAFT, num_speculative_tokens=2),
}


@pytest.mark.parametrize("engine_kind", list(COMBINED_ENGINES))
def test_several_extreme_fields_at_once_are_served_or_refused_by_name(engine_kind):
    """Batches of 1-4 requests, each with 1-3 of EXTREMES' values at once on random prompts, beside two
    plain requests of 72 tokens, on engines that preempt (recompute with 16-token chunks, swap) or speculate
    (n-gram, a draft model): each request is refused by a ValueError naming one of its fields, or served
    without error; the pool is whole after every batch."""
    engine = cached_llm(max_model_len=128, **COMBINED_ENGINES[engine_kind]).engine
    rng = random.Random(engine_kind)
    served = refused = 0
    for batch in range(30):
        for a in range(2):  # 72 tokens each: together more than the recompute and swap engines' pools
            anchor = {"prompt_token_ids": [rng.randrange(512) for _ in range(64)]}
            engine.add_request(f"{engine_kind}-{batch}-a{a}", anchor,
                               SamplingParams(max_tokens=8, ignore_eos=True))
        for j in range(rng.randint(1, 4)):
            kwargs = {"max_tokens": rng.choice([1, 4, 12])}
            kwargs |= {f: rng.choice(EXTREMES[f]) for f in rng.sample(list(EXTREMES), rng.randint(1, 3))}
            ids = [rng.randrange(512) for _ in range(rng.randint(1, 40))]
            prompt = rng.choice([{"prompt_token_ids": ids}, rng.choice(PROMPTS), "x" * rng.randint(1, 60)])
            try:
                engine.add_request(f"{engine_kind}-{batch}-{j}", prompt, SamplingParams(**kwargs))
                served += 1
            except ValueError as e:
                assert any(re.search(rf"\b{field}\b", str(e)) for field in kwargs), (kwargs, str(e))
                refused += 1
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, (engine_kind, out.error)
        engine.check_kv_pool_whole()
    assert served >= 8 and refused >= 30, (served, refused)  # both kinds, each many times
    if engine_kind in ("recompute", "swap"):
        assert engine.scheduler.num_preemptions > 0


# --- values that would leave the sampler no finite logit (it then drew token 0): refused, or kept finite


@pytest.mark.parametrize("kwargs, field", [
    (dict(repetition_penalty=1e-50), "repetition_penalty"),  # 0 in float32: x / 0
    (dict(repetition_penalty=0.009), "repetition_penalty"),
    (dict(logit_bias={5: 1e39}), "logit_bias"),  # inf in float32
    (dict(logit_bias={5: -1e31}), "logit_bias"),
])
def test_values_past_float32_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, allowed", [
    # at the bounds, with the smallest sampled temperature: every logit stays finite
    (dict(logit_bias={5: 1e30}, temperature=1e-5), {5}),
    (dict(logit_bias={5: 1e30, 6: 1e30}, temperature=0.1, seed=0), {5, 6}),
    (dict(repetition_penalty=0.01, temperature=1e-5, logit_bias={5: 1e30}), {5}),
    (dict(repetition_penalty=0.01, temperature=0), None),
])
def test_extreme_values_within_bounds_sample_real_tokens(kwargs, allowed):
    llm = cached_llm(max_model_len=128)
    [out] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True, **kwargs), use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert 0 not in tokens and (allowed is None or set(tokens) <= allowed), tokens
    llm.engine.check_kv_pool_whole()


@pytest.mark.parametrize("kwargs, field", [
    (dict(allowed_token_ids=[2], min_tokens=3), "min_tokens"),  # EOS (2), masked until min_tokens
    (dict(allowed_token_ids=[7, 2], stop_token_ids=[7], min_tokens=1), "min_tokens"),
    (dict(stop_token_ids=list(range(512)), min_tokens=3), "min_tokens"),
    (dict(allowed_token_ids=[2, 7], min_tokens=2), None),  # served: 7 until min_tokens, then 2 or 7
])
def test_masks_that_leave_nothing_to_sample_are_refused(kwargs, field):
    engine = cached_llm(max_model_len=128).engine
    params = SamplingParams(max_tokens=4, temperature=0, **kwargs)
    if field is None:
        engine.add_request("served", PROMPTS[0], params)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        tokens = outs[0].outputs[0].token_ids
        assert tokens[:2] == [7, 7] and set(tokens) <= {2, 7}, tokens
    else:
        with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
            engine.add_request("refused", PROMPTS[0], params)
    engine.check_kv_pool_whole()


def test_allowed_tokens_that_are_all_bad_words_are_refused():
    engine = cached_llm(max_model_len=128).engine
    once = engine.tokenizer.encode("Once", add_special_tokens=False)
    assert len(once) == 1
    with pytest.raises(ValueError, match="SamplingParams.allowed_token_ids "):
        engine.add_request("refused", PROMPTS[0], SamplingParams(allowed_token_ids=once, bad_words=["Once"]))
    assert not engine.has_unfinished_requests()


def test_longer_bad_words_that_would_mask_every_allowed_token_are_skipped(caplog):
    """allowed {5, 6}, bad words [5, 6] and [5, 5]: after a 5 both would be masked, so at such a step the
    two-token words are not applied (logged once); without them the row's only finite logits are 5 and 6."""
    import logging

    import torch

    from fastllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow

    params = SamplingParams(temperature=0, allowed_token_ids=[5, 6], bad_words=["x"], logit_bias={5: 1.0})
    params._bad_words_token_ids = [[5, 6], [5, 5]]
    logits = torch.zeros(2, 16)
    rows = [SamplingRow(params, None, [1], output, None) for output in ([6], [6, 5])]
    caplog.set_level(logging.WARNING)
    sampled = Sampler()(logits, SamplingMetadata.build(rows, 16, torch.device("cpu"))).sampled.tolist()
    assert sampled == [5, 5]  # (the first row: 5 allowed and unmasked; the second: the words skipped)
    assert sum("bad_words would mask" in r.getMessage() for r in caplog.records) <= 1


# --- fields changed after construction are checked again by the engine


@pytest.mark.parametrize("field, value", [
    ("seed", 2**70), ("allowed_token_ids", []), ("prompt_logprobs", 10**6), ("n", 0),
    ("temperature", float("nan")), ("top_k", -5), ("repetition_penalty", 0.0), ("logit_bias", {5: float("inf")})])
def test_a_field_changed_after_construction_is_refused_at_the_boundary(field, value):
    engine = cached_llm(max_model_len=128).engine
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        engine.add_request("changed", PROMPTS[0], params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("field, value", [("beam_width", 0), ("length_penalty", 1e6),
                                          ("length_penalty", float("nan"))])
def test_a_beam_search_field_changed_after_construction_is_refused(field, value):
    from fastllm.sampling_params import BeamSearchParams

    engine = cached_llm(max_model_len=128).engine
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field} "):
        engine.add_beam_search("changed", PROMPTS[0], params)
    assert not engine.has_unfinished_requests()


def test_a_beam_search_too_long_names_its_own_max_tokens():
    from fastllm.sampling_params import BeamSearchParams

    llm = cached_llm(max_model_len=128)
    with pytest.raises(ValueError, match=r"^BeamSearchParams\.max_tokens \(128\)"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=128))


def test_aborting_one_sample_of_a_request_is_ignored():
    """A sample's id is not a request's: aborting it ends nothing, and the request (all its samples)
    finishes, its id free again."""
    engine = cached_llm(max_model_len=128).engine
    engine.add_request("r", PROMPTS[0], SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=1))
    engine.step()
    engine.abort_request("r#1")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["r"] and len(finished[0].outputs) == 3
    assert all(o.finish_reason == "length" for o in finished[0].outputs)
    assert engine.get_num_unfinished_requests() == 0
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_kv_pool_whole()


@pytest.mark.parametrize("prompts", [None, b"abc", 5])
def test_prompts_that_are_not_prompts_are_a_value_error(prompts):
    with pytest.raises(ValueError, match="prompts must be"):
        cached_llm(max_model_len=128).generate(prompts, use_tqdm=False)


def test_bad_prompts_name_what_is_wrong():
    engine = cached_llm(max_model_len=128).engine
    for prompt, match in [("\ud800 once", "Unicode"), ({"prompt_token_ids": [1, 512]}, "512"),
                          ({"prompt_token_ids": [1, -1]}, "-1"), ({"prompt_token_ids": [1, True]}, "True"),
                          ({"prompt_token_ids": "12"}, "list"),
                          ({"prompt_token_ids": [1], "prompt": 5}, "string"),
                          ("x" * 10_000, "longer than max_model_len")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", prompt, SamplingParams())
    assert not engine.has_unfinished_requests()


def test_request_ids_are_unique_including_samples():
    engine = cached_llm().engine
    engine.add_request("a", PROMPTS[0], SamplingParams(n=2, max_tokens=4))
    for request_id, n in [("a", 1), ("a#1", 1), ("a#0", 3)]:
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(request_id, PROMPTS[1], SamplingParams(n=n, max_tokens=4))
    engine.add_request("b#1", PROMPTS[1], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="'b#1' is already in use"):
        engine.add_request("b", PROMPTS[1], SamplingParams(n=2, max_tokens=4))  # its second sample is b#1
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == {"a", "b#1"}
    engine.check_kv_pool_whole()


class PoisonedStep:
    """Make the first step that schedules `poison` raise: at launch, or when its tokens are read. (Under an
    AsyncLLMEngine the core knows the request as "<k>:poison".)"""

    def __init__(self, engine, poison: str, when: str):
        self.worker, self.poison, self.when = engine.worker, poison, when
        self.execute = self.worker.execute_model
        self.failures = 0

    def __enter__(self):
        def execute(sched):
            poisoned = not self.failures and any(r == self.poison or r.endswith(":" + self.poison)
                                                 for r in sched.num_scheduled_tokens)
            if poisoned and self.when == "launch":
                self.failures += 1
                raise RuntimeError("planted launch failure")
            out = self.execute(sched)
            if poisoned:
                self.failures += 1
                result = out.result

                def failing_result():
                    result()  # the runner's own bookkeeping, then the failure
                    raise RuntimeError("planted failure reading the tokens")
                out.result = failing_result
            return out
        self.worker.execute_model = execute
        return self

    def __exit__(self, *exc):
        del self.worker.execute_model


def run_all(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.mark.parametrize("when", ["launch", "result"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_failed_step_fails_only_its_requests(when, async_scheduling):
    """One request per step (max_num_seqs=1): the step with `poison` raises; poison ends with finish
    reason "error" and the error text, the requests before and after it give their normal tokens, and
    the pool is whole. Then two requests share a failing step: both fail, and the engine serves on."""
    llm = cached_llm(max_num_seqs=1, async_scheduling=async_scheduling)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in cached_llm().generate(PROMPTS[:2], greedy, use_tqdm=False)]
    engine.add_request("before", PROMPTS[0], greedy)
    engine.add_request("poison", PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, n=1))
    engine.add_request("after", PROMPTS[1], greedy)
    with PoisonedStep(engine, "poison", when) as poisoned:
        finished = run_all(engine)
    assert poisoned.failures == 1
    assert finished["poison"].outputs[0].finish_reason == "error"
    assert "planted" in finished["poison"].error
    assert [finished[r].outputs[0].token_ids for r in ("before", "after")] == want
    assert finished["before"].error is None and finished["after"].outputs[0].finish_reason == "length"
    engine.check_kv_pool_whole()

    shared = cached_llm(async_scheduling=async_scheduling).engine
    shared.add_request("poison", PROMPTS[2], SamplingParams(temperature=0.8, max_tokens=6, n=2))
    shared.add_request("neighbour", PROMPTS[3], greedy)
    with PoisonedStep(shared, "poison#0", when):
        finished = run_all(shared)
    assert {o.finish_reason for r in ("poison", "neighbour") for o in finished[r].outputs} == {"error"}
    shared.check_kv_pool_whole()
    assert cached_llm(async_scheduling=async_scheduling).generate(PROMPTS[0], greedy, use_tqdm=False)[0] \
        .outputs[0].token_ids == want[0]


def test_a_step_whose_update_fails_fails_only_its_requests(monkeypatch):
    """Applying a step's tokens raises (the host's side, after the forward): that step's request ends with the
    error and its blocks are freed; the requests of the steps before and after it give their normal tokens."""
    from fastllm.core.scheduler import Scheduler

    engine = cached_llm(max_num_seqs=1).engine
    greedy = SamplingParams(temperature=0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in cached_llm().generate(PROMPTS[:2], greedy, use_tqdm=False)]
    check_stop = Scheduler._check_stop

    def failing(request, token):
        if request.request_id == "poison" and request.num_output_tokens == 3:
            raise RuntimeError("planted update failure")
        return check_stop(request, token)

    monkeypatch.setattr(Scheduler, "_check_stop", staticmethod(failing))
    engine.add_request("before", PROMPTS[0], greedy)
    engine.add_request("poison", PROMPTS[2], greedy)
    engine.add_request("after", PROMPTS[1], greedy)
    finished = run_all(engine)
    assert finished["poison"].outputs[0].finish_reason == "error" and "planted" in finished["poison"].error
    assert [finished[r].outputs[0].token_ids for r in ("before", "after")] == want
    engine.check_kv_pool_whole()


def test_a_request_whose_output_fails_fails_alone(monkeypatch):
    """Turning a request's tokens into text or logprobs raised (a tokenizer's bug on some token sequence):
    that request ends with finish reason "error" naming what raised, its tokens stop being computed, and the other
    requests of the same steps give their normal text; the pool is whole."""
    from fastllm.engine.output_processor import OutputProcessor

    add_tokens = OutputProcessor._add_tokens

    def failing(self, sample, core_out, stopped):
        if core_out.request_id.startswith("poison") and sample.output.token_ids:  # (its samples: poison#i)
            raise RuntimeError("planted detokenizer failure")
        return add_tokens(self, sample, core_out, stopped)

    llm = cached_llm()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    want = cached_llm().generate(PROMPTS[:2], greedy, use_tqdm=False)
    monkeypatch.setattr(OutputProcessor, "_add_tokens", failing)
    engine = llm.engine
    engine.add_request("before", PROMPTS[0], greedy)
    engine.add_request("poison", PROMPTS[2], SamplingParams(temperature=0, max_tokens=40, n=2))
    engine.add_request("after", PROMPTS[1], greedy)
    finished = run_all(engine)
    assert {o.finish_reason for o in finished["poison"].outputs} == {"error"}
    assert "RuntimeError: planted detokenizer failure" in finished["poison"].error
    assert all(len(o.token_ids) < 40 for o in finished["poison"].outputs)  # stopped in the core, not run out
    for rid, w in zip(("before", "after"), want):
        assert finished[rid].outputs[0].text == w.outputs[0].text and finished[rid].error is None
    engine.check_kv_pool_whole()
