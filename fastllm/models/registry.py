"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

import dataclasses

from torch import nn

from fastllm.distributed.parallel_state import ParallelRank
from fastllm.layers.fp8 import Fp8Scheme
from fastllm.models.llama import LlamaArgs, LlamaForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def build_model(hf_config: dict, parallel: ParallelRank = ParallelRank(),
                fp8: Fp8Scheme | None = None) -> nn.Module:
    """The model, or this rank's shard of it (with FP8 linear weights when fp8 is given)."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch](dataclasses.replace(LlamaArgs.from_hf_config(hf_config), fp8=fp8), parallel)
    raise ValueError(
        f"unsupported architecture {archs or '(none given)'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
