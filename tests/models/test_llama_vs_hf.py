"""Greedy outputs equal to Hugging Face transformers, token for token.

Real models (stories260K, llama2xs-279K): 8 prompts in one batch, 64 new tokens, float32.
Random tiny configs of each architecture: logits compared within a tolerance; tokens compared
wherever the reference's top-2 margin is clear (random weights have near-ties).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from fastllm import SamplingParams
from tests.conftest import DRAFT, PROMPTS, STORIES, cached_llm, hf_greedy, hf_logits, tokenize

MAX_TOKENS = 64
SEED_OFFSET = int(os.environ.get("FASTLLM_TEST_SEED", "0"))


def greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **kw)


@pytest.mark.parametrize("model", [STORIES, DRAFT], ids=["stories260K", "llama2xs-279K"])
def test_real_model_matches_hf(model):
    llm = cached_llm(model)
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for ids, out in zip(tokenize(PROMPTS), outputs):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(model, ids, MAX_TOKENS), out.prompt


# Random tiny configs: (name, transformers config class, extra config fields)
TINY = {
    "llama3.1": ("LlamaConfig", dict(head_dim=64, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64), rope_theta=500000.0)),
    "mistral": ("MistralConfig", dict(head_dim=64, sliding_window=None)),
    "mistral-window": ("MistralConfig", dict(head_dim=64, sliding_window=16)),  # prompts + outputs pass it
    "qwen2": ("Qwen2Config", dict()),  # head_dim = hidden / heads = 64, qkv bias
    # layer 0 full attention, layer 1 a window (Qwen2's use_sliding_window from max_window_layers on)
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=128)),  # q/k norm
}


def make_tiny_model(tmp_path_factory, name: str) -> str:
    import transformers

    class_name, extra = TINY[name]
    config = getattr(transformers, class_name)(**{
        "vocab_size": 512, "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": 0.2, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        **extra})  # extra may override the defaults
    torch.manual_seed(zlib.crc32(name.encode()) + SEED_OFFSET)
    model = getattr(transformers, config.architectures[0] if config.architectures else
                    class_name.replace("Config", "ForCausalLM"))(config)
    # Random norm weights too, so a mix-up of q/k norms or of the two layer norms shows.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith("bias"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_model(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory, request.param)


EOS = 2
LOGPROB_TOL = 2e-4  # float32 on both sides: differences are summation-order rounding
MARGIN = 1e-3  # a top-2 logit gap below this is a near-tie: the argmax may go either way


def test_tiny_config_matches_hf(tiny_model):
    check_against_hf(cached_llm(tiny_model), tiny_model)


def check_against_hf(llm, tiny_model: str) -> None:
    """Greedy outputs of four random prompts: top-5 logprobs within LOGPROB_TOL of Hugging Face's, tokens
    equal until a near-tie, and at least 64 tokens compared."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 17, 33, 1)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(32, logprobs=5), use_tqdm=False)
    compared = 0
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        logits = hf_logits(tiny_model, prompt + tokens)
        ref_logprobs = torch.log_softmax(logits, dim=-1)
        for i, token in enumerate(tokens):
            row = logits[len(prompt) - 1 + i].clone()
            row[EOS] = float("-inf")  # min_tokens keeps EOS from being sampled
            # Our top-5 logprobs agree with the reference's.
            for tid, lp in out.outputs[0].logprobs[i].items():
                assert abs(lp.logprob - ref_logprobs[len(prompt) - 1 + i, tid].item()) < LOGPROB_TOL
            top2 = row.topk(2)
            if (top2.values[0] - top2.values[1]).item() < MARGIN:
                break  # a near-tie: the sequences may legitimately part here
            assert token == top2.indices[0].item(), f"token {i} of prompt {prompt[:5]}..."
            compared += 1
    assert compared >= 64, f"only {compared} tokens had a clear margin; the test checks too little"
