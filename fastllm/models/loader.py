"""Build a model (or one rank's shard of it) and fill its weights: from safetensors files, or random
("dummy") weights.

A shard reads only its own part of each checkpoint tensor (safetensors slices are lazy), and skips the
tensors of other pipeline stages. Dummy weights are drawn whole, parameter by parameter from a
generator seeded by the parameter's name, and then sliced like a checkpoint: every shard holds exactly
its part of the single-rank model's weights, whatever the split.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from fastllm.config import ModelConfig
from fastllm.distributed.parallel_state import ParallelRank
from fastllm.layers import fp8
from fastllm.models.registry import build_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if model_config.dtype != "auto":
        return _DTYPES[model_config.dtype]
    name = model_config.hf_config.get("torch_dtype") or model_config.hf_config.get("dtype") or "float32"
    dtype = _DTYPES.get(str(name).replace("torch.", ""), torch.float32)
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        # Half-precision matmuls are slow on CPUs, and float32 is exact against the references.
        logger.info("%s checkpoint: the CPU runs it in float32 (dtype / --dtype chooses another)", name)
        dtype = torch.float32
    return dtype


def safetensors_files(model_dir: str) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / s for s in shards]
    else:
        files = sorted(root.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ValueError(f"no safetensors weights in {model_dir!r}{' (missing ' + ', '.join(missing) + ')' if missing else ''}"
                         "; use load_format=\"dummy\" for random weights")
    return files


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, object]]:
    """(name, lazy slice) per checkpoint tensor: indexing a slice reads just those rows or columns."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02,
                       dtype: torch.dtype | None = None) -> None:
    """Random weights of the real shapes: normal(0, std) matrices, unit norms, zero biases. Each
    parameter's whole (single-rank) tensor comes from its own generator, seeded by its name, and the
    model copies out its rank's part. FP8 weights are drawn in the model's `dtype` and quantized as they
    load: the FP8 model holds the 16-bit one's weights, quantized."""
    device = next(model.parameters()).device
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = model.full_shape(name)
            draw = dtype if param.dtype == fp8.FP8 else param.dtype
            # Drawn in place when the parameter is whole (one rank: no temporary copy).
            whole = tuple(param.shape) == shape and draw == param.dtype
            full = param if whole else torch.empty(shape, dtype=draw, device=device)
            if name.endswith("norm.weight"):
                full.fill_(1.0)
            elif name.endswith(".bias"):
                full.zero_()
            else:
                key = model.checkpoint_name(name).encode()
                generator = torch.Generator(device=device).manual_seed(seed + zlib.crc32(key))
                full.normal_(0.0, std, generator=generator)
            if not whole:
                model.load_param(name, full)


def load_model(model_config: ModelConfig, device: torch.device,
               parallel: ParallelRank = ParallelRank(), fold_norms: bool = False) -> nn.Module:
    """The model's weights on `device` (this rank's shard); fold_norms: as registry.build_model's."""
    start = time.perf_counter()
    dtype = resolve_dtype(model_config, device)
    scheme = fp8.scheme_for(model_config.quantization, model_config.hf_config, model_config.quantize_lm_head)
    if scheme is not None:
        fp8.check_device(device, scheme)
    load_format = model_config.load_format
    if load_format == "auto":
        load_format = "safetensors"
    if load_format == "safetensors":
        safetensors_files(model_config.model)  # fail early, before building the model
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(model_config.hf_config, parallel, scheme, fold_norms)
    finally:
        torch.set_default_dtype(default_dtype)
    if load_format == "dummy":
        std = model_config.hf_config.get("initializer_range", 0.02)
        init_dummy_weights(model, model_config.seed, std, dtype)
    else:
        model.load_weights(iterate_safetensors(model_config.model))
    model.process_weights_after_loading()
    if scheme is not None:
        fp8.check_loaded(model)
        logger.info("%s", scheme.describe())
    # Rotary tables stay float32 whatever the model dtype.
    for module in model.modules():
        if hasattr(module, "cos_sin_cache"):
            module.cos_sin_cache = module.cos_sin_cache.float()
    model.eval()
    logger.info("loaded %s (%s, %s weights) in %.2f s", model_config.model, dtype, load_format, time.perf_counter() - start)
    return model
