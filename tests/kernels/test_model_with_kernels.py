"""End to end on the GPU: the model with our Triton kernels gives the same greedy tokens as with
the plain-PyTorch reference kernels (the same engine, FASTLLM_KERNELS-style switch per run)."""

from __future__ import annotations

import pytest
import torch

import fastllm.kernels.dispatch as dispatch
from fastllm import LLM, SamplingParams
from tests.conftest import BF16_MARGIN, PROMPTS, STORIES
from tests.models.test_llama_vs_hf import make_tiny_model

pytestmark = pytest.mark.gpu


def run(model, mode, prompts, max_tokens, dtype, monkeypatch, outputs=False, max_model_len=256):
    monkeypatch.setattr(dispatch, "_MODE", mode)
    monkeypatch.setattr(dispatch, "_chosen", {})
    llm = LLM(model, device="cuda", dtype=dtype, enforce_eager=True, num_gpu_blocks=1024,
              max_model_len=max_model_len)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2), use_tqdm=False)
    assert not any(o.error for o in outs), [o.error for o in outs]  # (a failed step, e.g. out of memory)
    chosen = {name: fn.__module__ for (name, _), fn in dispatch._chosen.items()}
    llm.engine.check_kv_pool_whole()
    if outputs:
        return outs, chosen
    return [o.outputs[0].token_ids for o in outs], chosen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stories_kernels_equal_reference(dtype, monkeypatch):
    ref, ref_paths = run(STORIES, "reference", PROMPTS, 64, dtype, monkeypatch)
    got, paths = run(STORIES, "auto", PROMPTS, 64, dtype, monkeypatch)
    assert all(m.endswith("reference") for m in ref_paths.values())
    assert paths and not any(m.endswith("reference") for m in paths.values()), paths
    if dtype == "float32":
        assert got == ref
    else:  # bf16: the kernels round differently from the reference; report where they part
        agree = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(g)) for g, r in zip(got, ref)]
        print(f"\nbf16 stories260K, Triton vs reference kernels: leading tokens agreeing {agree}")
        assert sum(a == 64 for a in agree) >= 6, agree


def tiny_llama31_head_dim_128(tmp_path_factory):
    import tests.models.test_llama_vs_hf as m

    m.TINY["llama3.1-hd128"] = ("LlamaConfig", dict(head_dim=128, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64), rope_theta=500000.0, max_position_embeddings=2048))
    return make_tiny_model(tmp_path_factory, "llama3.1-hd128")


def test_tiny_llama31_head_dim_128_bf16(tmp_path_factory, monkeypatch):
    partings = bf16_partings_at_near_ties(tiny_llama31_head_dim_128(tmp_path_factory), monkeypatch)
    print(f"\ntiny Llama-3.1 (head_dim 128) bf16, Triton vs reference: partings (prompt, position, margin) "
          f"{partings}")


def test_tiny_qwen3_bf16(tmp_path_factory, monkeypatch):
    """Qwen3's q/k norms run inside the rotary kernels (rotary_decode_attention on decode steps,
    rotary_kv_cache_write on prefill): the same bar as Llama's against the reference kernels."""
    partings = bf16_partings_at_near_ties(make_tiny_model(tmp_path_factory, "qwen3"), monkeypatch)
    print(f"\ntiny Qwen3 (q/k norm) bf16, Triton vs reference: partings (prompt, position, margin) "
          f"{partings}")


def test_tiny_qwen3_float32_equal_reference(tmp_path_factory, monkeypatch):
    model = make_tiny_model(tmp_path_factory, "qwen3")
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()}
               for n in (5, 17, 33, 1)]
    ref, _ = run(model, "reference", prompts, 32, "float32", monkeypatch)
    got, paths = run(model, "auto", prompts, 32, "float32", monkeypatch)
    assert paths["rotary_decode_attention"].endswith("paged_decode_attention"), paths
    assert paths["rotary_kv_cache_write"].endswith("rotary_kv_cache_write"), paths
    assert got == ref


def bf16_partings_at_near_ties(model, monkeypatch) -> list[tuple[int, int, float]]:
    """Greedy bf16 tokens of the Triton kernels against the reference kernels' on four random prompts; returns
    where they part (prompt length, position, the reference's top-2 margin there)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 31, 64, 100)]
    ref, _ = run(model, "reference", [{"prompt_token_ids": p} for p in prompts], 32, "bfloat16", monkeypatch,
                 outputs=True)
    monkeypatch.setattr(dispatch, "_MODE", "auto")
    monkeypatch.setattr(dispatch, "_chosen", {})
    llm = LLM(model, device="cuda", dtype="bfloat16", enforce_eager=True, num_gpu_blocks=1024, max_model_len=256)
    # Every one of the reference's tokens is checked: where the Triton path parts from it, the
    # reference's top-2 margin there must be a near-tie, and the Triton path is restarted from the
    # reference's own tokens after it (teacher forcing), so one tie does not end the comparison.
    partings = []
    for prompt, r in zip(prompts, ref):
        want, k = r.outputs[0], 0
        while k < len(want.token_ids):
            params = SamplingParams(temperature=0, max_tokens=len(want.token_ids) - k)
            [out] = llm.generate([{"prompt_token_ids": prompt + want.token_ids[:k]}], params, use_tqdm=False)
            got = out.outputs[0].token_ids
            n = next((i for i, (a, b) in enumerate(zip(got, want.token_ids[k:])) if a != b), min(len(got), len(want.token_ids) - k))
            if k + n >= len(want.token_ids):
                break
            top = sorted(want.logprobs[k + n].values(), key=lambda x: -x.logprob)
            margin = top[0].logprob - top[1].logprob
            assert margin < BF16_MARGIN, f"prompt {len(prompt)}: parted at {k + n} with margin {margin:.3g}"
            partings.append((len(prompt), k + n, round(margin, 4)))
            k += n + 1
    llm.engine.check_kv_pool_whole()
    return partings


def test_tiny_llama31_long_prompts_bf16(tmp_path_factory, monkeypatch):
    """Three prompts prefilled in one 2,700-token step: long enough that prefill attention takes the Gluon
    kernel on an H100 (prefill_attention_hopper, with 128-key tiles for the 1,100-token prompt), which the
    short prompts above never reach."""
    from fastllm.kernels import prefill_attention_hopper as hopper

    model = tiny_llama31_head_dim_128(tmp_path_factory)
    g = torch.Generator().manual_seed(1)
    lengths = (1100, 900, 700)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in lengths]
    ref, _ = run(model, "reference", prompts, 16, "bfloat16", monkeypatch, outputs=True, max_model_len=1200)
    calls = []
    gluon_kernel = hopper.prefill_attention_hopper
    monkeypatch.setattr(hopper, "prefill_attention_hopper", lambda *a: calls.append(a[8]) or gluon_kernel(*a))
    got, _ = run(model, "auto", prompts, 16, "bfloat16", monkeypatch, outputs=True, max_model_len=1200)
    if torch.cuda.get_device_capability()[0] == 9:
        assert calls and max(calls) >= hopper.LONG_QUERY, calls  # max_query_len of the Gluon steps
    for prompt, r, o in zip(prompts, ref, got):
        want, have = r.outputs[0], o.outputs[0]
        # the prefill's own logits: the top-two logprobs, not just the ranks
        shared = want.logprobs[0].keys() & have.logprobs[0].keys()
        assert shared, (want.logprobs[0], have.logprobs[0])
        for tok in shared:
            assert abs(have.logprobs[0][tok].logprob - want.logprobs[0][tok].logprob) < BF16_MARGIN
        n = next((i for i, (a, b) in enumerate(zip(have.token_ids, want.token_ids)) if a != b), None)
        if n is not None:  # they may part only where the reference's top two nearly tie
            top = sorted(want.logprobs[n].values(), key=lambda x: -x.logprob)
            margin = top[0].logprob - top[1].logprob
            length = len(prompt["prompt_token_ids"])
            assert margin < BF16_MARGIN, f"prompt of {length}: parted at {n}, margin {margin:.3g}"
