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
                fp8: Fp8Scheme | None = None, fold_norms: bool = False) -> nn.Module:
    """The model, or this rank's shard of it (with FP8 linear weights when fp8 is given; fold_norms: the
    decoder's norms folded into its projections after loading, where its weights are 16/32-bit in one
    pipeline stage)."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            args = dataclasses.replace(LlamaArgs.from_hf_config(hf_config), fp8=fp8,
                                       fold_norms=fold_norms and fp8 is None and parallel.pp_size == 1)
            return _MODELS[arch](args, parallel)
    raise ValueError(
        f"unsupported architecture {archs or '(none given)'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
