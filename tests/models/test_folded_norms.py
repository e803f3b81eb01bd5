"""A model with its RMSNorms folded into the projections after them (a speculative draft's:
spec_decode/draft_model.py): qkv and gate/up scale their sums by 1 / rms (the norms' weights in their
columns), o and down add the residual stream in their epilogues. Hugging Face's greedy tokens, as without
folding: float32 through the CPU references (real and random tiny models of each architecture) and through the
Triton kernels under the interpreter (stories260K)."""

from __future__ import annotations

import functools

import pytest
import torch

from fastllm import LLM, SamplingParams
from fastllm.config import EngineConfig
from fastllm.distributed.parallel_state import ParallelRank
from fastllm.kernels import skinny_linear as S
from fastllm.layers import fp8
from fastllm.models import loader
from fastllm.models.registry import build_model
from fastllm.worker import model_runner
from tests.conftest import PROMPTS, STORIES, hf_greedy, tokenize
from tests.kernels.kernel_testing import record_launches, triton_on_cpu
from tests.models.test_llama_vs_hf import check_against_hf, make_tiny_model

FOLDED_OPS = ("rms_norm_folded_linear", "rms_norm_folded_gated_linear", "linear_add")


@pytest.fixture
def folded_engines(monkeypatch):
    """Engines of this test load their target as a draft is loaded: norms folded."""
    monkeypatch.setattr(model_runner, "load_model", functools.partial(loader.load_model, fold_norms=True))


def folded_llm(model: str, **kwargs) -> LLM:
    llm = LLM(model, device="cpu", dtype="float32", **kwargs)
    model = llm.engine.worker.runner.model
    assert model.args.fold_norms
    for layer in model.model.stage_layers():
        assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    return llm


def test_folded_real_model_matches_hf(folded_engines):
    llm = folded_llm(STORIES)
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for ids, out in zip(tokenize(PROMPTS), outputs):
        assert out.outputs[0].token_ids == hf_greedy(STORIES, ids, 32), out.prompt
    llm.engine.check_kv_pool_whole()


@pytest.mark.parametrize("name", ["llama3.1", "mistral-window", "qwen2", "qwen3"])
def test_folded_tiny_configs_match_hf(folded_engines, tmp_path_factory, name):
    """Random norm weights (0.5-1.5) and Qwen2's qkv bias (added after the 1 / rms scale)."""
    model = make_tiny_model(tmp_path_factory, name)
    check_against_hf(folded_llm(model), model)


def test_folded_kernels_give_hugging_faces_tokens(folded_engines, monkeypatch):
    """The folded ops through their Triton kernels (the interpreter), one prompt at a time: every step fits
    the kernel (prompts of up to 64 tokens), decode steps one row."""
    called = triton_on_cpu(monkeypatch, FOLDED_OPS)
    launches = record_launches(monkeypatch)
    llm = folded_llm(STORIES, block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    for prompt, ids in zip(PROMPTS[:2], tokenize(PROMPTS[:2])):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(STORIES, ids, 6), prompt
    assert called == set(FOLDED_OPS), called
    # (prologue, gated): qkv, gate/up, and o and down with the residual in their epilogues
    assert set(launches) == {(S.RMS_NORM_FOLDED, False), (S.RMS_NORM_FOLDED, True), (S.PLAIN, False)}
    llm.engine.check_kv_pool_whole()


def test_only_16_or_32_bit_single_stage_models_fold():
    """FP8 projections (their norms quantize for them) and pipeline stages (they hand on a residual) keep
    their norms; a target model never folds."""
    hf = EngineConfig.from_kwargs(STORIES, dtype="float32").model.hf_config
    scheme = fp8.scheme_for("fp8", hf)
    assert build_model(hf, fold_norms=True).args.fold_norms
    assert not build_model(hf).args.fold_norms
    assert not build_model(hf, fp8=scheme, fold_norms=True).args.fold_norms
    assert not build_model(hf, ParallelRank.of(0, 1, 2), fold_norms=True).args.fold_norms


def test_a_draft_model_folds_and_the_target_does_not():
    llm = LLM(STORIES, device="cpu", dtype="float32", speculative_config={"model": "llama2xs-279K",
                                                                          "num_speculative_tokens": 2})
    runner = llm.engine.worker.runner
    assert runner.drafter.model.args.fold_norms and not runner.model.args.fold_norms
