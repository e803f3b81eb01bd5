"""Engine configuration: one frozen dataclass per concern, composed into EngineConfig.

Every value is validated at construction and a bad one raises ValueError naming the field.
EngineConfig.from_kwargs rejects unknown keyword arguments instead of dropping them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL = str(ASSETS / "stories260K")
SUPPORTED_DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name} {message}")


def resolve_model_path(model: str | None) -> str:
    """A directory path, or the name of an embedded model or config (e.g. 'llama2xs-279K',
    'llama-3.1-8b', any case)."""
    if model is None:
        return DEFAULT_MODEL
    if os.path.isdir(model):
        return model
    if model.lower() == "default":
        return DEFAULT_MODEL
    embedded = [*(ASSETS / "configs").iterdir(), *(p for p in ASSETS.iterdir() if (p / "config.json").is_file())]
    for candidate in embedded:
        if candidate.name.lower() == model.lower():
            return str(candidate)
    known = sorted(p.name for p in embedded)
    raise ValueError(
        f"model {model!r} is not a directory and not an embedded config (embedded: {', '.join(known)})"
    )


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None  # defaults to the config's max_position_embeddings
    seed: int = 0  # for dummy weights and the unseeded sampler
    hf_config: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        _check(self.dtype in SUPPORTED_DTYPES, "dtype", f"must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        _check(self.load_format in LOAD_FORMATS, "load_format", f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        config_file = Path(self.model) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model directory {self.model!r} has no config.json (does the path exist?)")
        if not self.hf_config:
            object.__setattr__(self, "hf_config", json.loads(config_file.read_text()))
        limit = self.max_position_embeddings
        window = self.hf_config.get("sliding_window") if self.hf_config.get("use_sliding_window", True) else None
        if window and window < limit:
            # Sliding-window attention is not implemented: within the window, full attention is exact.
            logger.warning("sliding_window=%d is not implemented: max_model_len is limited to it", window)
            limit = window
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", limit)
        _check(
            0 < self.max_model_len <= limit, "max_model_len", f"must be in [1, {limit}], got {self.max_model_len}"
        )

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 2048))

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or [""]
        return archs[0]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None  # override the profiling run (tests use small pools)
    cpu_kv_cache_gib: float = 0.25  # KV pool size when the model runs on the CPU
    swap_space_gib: float = 1.0  # CPU pool for preemption_mode="swap"
    num_cpu_blocks: int | None = None  # override swap_space_gib
    enable_prefix_caching: bool = True

    def __post_init__(self):
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", f"must be a power of two in [1, 128], got {self.block_size}")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.num_gpu_blocks is None or self.num_gpu_blocks >= 2, "num_gpu_blocks", f"must be >= 2, got {self.num_gpu_blocks}")
        _check(self.cpu_kv_cache_gib > 0, "cpu_kv_cache_gib", f"must be > 0, got {self.cpu_kv_cache_gib}")
        _check(self.swap_space_gib >= 0, "swap_space_gib", f"must be >= 0, got {self.swap_space_gib}")


# Requests per step when max_num_seqs is not given. vLLM runs larger batches by default on GPUs of
# 70 GiB or more (1024 there, 256 elsewhere): each decode step reads the weights once for every
# request in it. Ours stops at 512, the largest default CUDA graph: wider decode steps run without
# graphs and are host-bound (H100, 3000 x 128/128 throughput: 16,750 output tok/s at 512, 14,900
# at 256, 12,700 at 1024).
LARGE_GPU_GIB = 70
DEFAULT_MAX_NUM_SEQS = 256
LARGE_GPU_MAX_NUM_SEQS = 512


def default_max_num_seqs(device) -> int:
    if device.type == "cuda":
        import torch

        if torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_GIB * 2**30:
            return LARGE_GPU_MAX_NUM_SEQS
    return DEFAULT_MAX_NUM_SEQS


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192  # token budget per step
    max_num_seqs: int | None = None  # None: default_max_num_seqs of the device (EngineConfig.for_device)
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    # Schedule and launch step N+1 before step N's tokens reach the host, so host work overlaps
    # the GPU. False runs each step to completion (the same tokens, one step less lag).
    async_scheduling: bool = True

    def __post_init__(self):
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(self.preemption_mode in ("recompute", "swap"), "preemption_mode", f"must be 'recompute' or 'swap', got {self.preemption_mode!r}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self):
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class CompileConfig:
    enforce_eager: bool = False  # True: no torch.compile, no CUDA graphs (the debug path)
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode batch sizes to capture (default 1,2,4,8,16,24,...)
    compile_on_cpu: bool = False  # torch.compile is GPU-only by default (a CPU compile takes ~15 s a graph)

    def __post_init__(self):
        sizes = self.cuda_graph_sizes
        _check(sizes is None or (len(sizes) > 0 and all(isinstance(s, int) and s >= 1 for s in sizes)),
               "cuda_graph_sizes", f"must be positive integers, got {sizes!r}")


MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Draft-model speculative decoding: the draft proposes num_speculative_tokens tokens a step and
    the target verifies them in one forward. Off while speculative_model is None."""

    speculative_model: str | None = None  # a model directory or embedded config sharing the target's vocabulary
    num_speculative_tokens: int = 0

    def __post_init__(self):
        if self.speculative_model is None:
            _check(self.num_speculative_tokens == 0, "num_speculative_tokens",
                   f"needs speculative_model, got {self.num_speculative_tokens}")
            return
        object.__setattr__(self, "speculative_model", resolve_model_path(self.speculative_model))
        if self.num_speculative_tokens == 0:
            object.__setattr__(self, "num_speculative_tokens", 4)
        _check(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
               "num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens!r}")

    @property
    def enabled(self) -> bool:
        return self.speculative_model is not None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    compile: CompileConfig = CompileConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    device: str = "auto"  # "auto" picks cuda when present

    def __post_init__(self):
        _check(self.device in ("auto", "cpu", "cuda"), "device", f"must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if not self.scheduler.enable_chunked_prefill:
            _check(
                self.scheduler.max_num_batched_tokens >= self.model.max_model_len,
                "max_num_batched_tokens",
                f"must be >= max_model_len ({self.model.max_model_len}) without chunked prefill",
            )

    def for_device(self, device) -> "EngineConfig":
        """This config with the defaults that depend on the device filled in (max_num_seqs)."""
        if self.scheduler.max_num_seqs is not None:
            return self
        scheduler = dataclasses.replace(self.scheduler, max_num_seqs=default_max_num_seqs(device))
        return dataclasses.replace(self, scheduler=scheduler)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (LLM(...), the CLI); unknown names are an error."""
        parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "parallel": ParallelConfig, "compile": CompileConfig, "speculative": SpeculativeConfig}
        values: dict[str, dict[str, Any]] = {name: {} for name in parts}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            owner = next((p for p, c in parts.items() if key in {f.name for f in dataclasses.fields(c)}), None)
            if owner is not None and key != "hf_config":
                values[owner][key] = value
            elif key == "device":
                top[key] = value
            else:
                raise ValueError(f"unknown engine argument {key!r}")
        if "cuda_graph_sizes" in values["compile"] and values["compile"]["cuda_graph_sizes"] is not None:
            values["compile"]["cuda_graph_sizes"] = tuple(values["compile"]["cuda_graph_sizes"])
        values["model"]["model"] = resolve_model_path(model)
        built = {name: parts[name](**values[name]) for name in parts}
        return cls(**built, **top)
