"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from torch import nn

from fastllm.distributed.parallel_state import ParallelRank
from fastllm.models.llama import LlamaArgs, LlamaForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def build_model(hf_config: dict, parallel: ParallelRank = ParallelRank()) -> nn.Module:
    """The model, or this rank's shard of it."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch](LlamaArgs.from_hf_config(hf_config), parallel)
    raise ValueError(
        f"unsupported architecture {archs or '(none given)'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
