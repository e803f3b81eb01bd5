"""Engine configuration: one frozen dataclass per concern, composed into EngineConfig.

Every value is validated at construction and a bad one raises ValueError naming the field.
EngineConfig.from_kwargs rejects unknown keyword arguments instead of dropping them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL = str(ASSETS / "stories260K")
SUPPORTED_DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("fp8", "fp8-per-tensor")  # None: the checkpoint's weights as they are (layers/fp8.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")  # any one: a tokenizer directory
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: float8 e4m3 (layers/fp8.py, kv_cache_dtype)


def arg(default: Any = None, help: str = "", choices: tuple | None = None, **kwargs: Any):
    """A config field that is an engine argument: a keyword of LLM(...) and a flag of every command,
    which the CLI builds from the field's name, type, default, help text and choices."""
    return field(default=default, metadata={"help": help, "choices": choices}, **kwargs)


QUANTIZE_LM_HEAD_NEEDS_FP8 = ("puts lm_head in FP8 beside FP8 linear weights, and this model has none: give "
                              "quantization='fp8' too (or load an FP8 checkpoint)")


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name} {message}")


def _at_default(config, name: str) -> bool:
    """Whether a field holds its default (a dataclass's class attribute), i.e. was not given."""
    return getattr(config, name) == getattr(type(config), name)


_TYPE_NAMES = {bool: "True or False", int: "an integer", float: "a finite number", str: "a string"}


def _is(value: Any, kind: Any) -> bool:
    """value fits the annotation `kind`: bool is not an int, a float is finite, tuple[int, ...] holds ints."""
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if typing.get_origin(kind) is tuple:
        return isinstance(value, tuple) and all(_is(v, typing.get_args(kind)[0]) for v in value)
    return isinstance(value, kind)


def _check_types(config: Any) -> None:
    """Each engine argument (an arg() field) against its annotation, before the ranges each class checks."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        if "help" not in f.metadata:
            continue
        kind, value = hints[f.name], getattr(config, f.name)
        kinds = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
        if not any(_is(value, k) for k in kinds):
            names = [_TYPE_NAMES.get(k, "a tuple of integers" if typing.get_origin(k) is tuple else "None")
                     for k in kinds]
            raise ValueError(f"{f.name} must be {' or '.join(names)}, got {value!r}")


def has_tokenizer(path: str) -> bool:
    """Whether a directory holds a tokenizer (any one of TOKENIZER_FILES)."""
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def resolve_model_path(model: str | None) -> str:
    """A directory path, or the name of an embedded model or config (e.g. 'llama2xs-279K',
    'llama-3.1-8b', any case)."""
    if model is None:
        return DEFAULT_MODEL
    _check(isinstance(model, str), "model", f"must be a directory or an embedded model's name, got {model!r}")
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
    model: str = arg(DEFAULT_MODEL, "a Hugging Face model directory, or the name of an embedded model or "
                     "config (e.g. llama-3.1-8b) (default: the embedded TinyStories stories260K)")
    tokenizer: str | None = arg(None, "tokenizer directory (default: the model directory)")
    dtype: str = arg("auto", "weights and activations ('auto': the checkpoint's)", SUPPORTED_DTYPES)
    load_format: str = arg("auto", "'dummy': random weights of the model's config", LOAD_FORMATS)
    max_model_len: int | None = arg(None, "context length (default: the model's max_position_embeddings)")
    seed: int = arg(0, "seed for dummy weights and unseeded sampling")
    quantization: str | None = arg(None, "'fp8': linear weights in float8 e4m3 with a scale per output "
                                   "channel ('fp8-per-tensor': one per checkpoint tensor), activations per "
                                   "token; needs a GPU of sm_89 or newer (default: none, or the checkpoint's "
                                   "FP8)", QUANTIZATIONS)
    quantize_lm_head: bool = arg(False, "with FP8 weights (quantization, or an FP8 checkpoint): lm_head in "
                                 "float8 e4m3 too, a scale per vocabulary row, its activations per token (half "
                                 "its bytes a step; the logits take FP8's rounding) (default: lm_head in the "
                                 "model's dtype)")
    hf_config: dict = field(default_factory=dict, repr=False, compare=False)  # config.json (not an argument)

    def __post_init__(self):
        _check_types(self)
        _check(self.dtype in SUPPORTED_DTYPES, "dtype", f"must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        _check(self.load_format in LOAD_FORMATS, "load_format", f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
               f"must be None or one of {QUANTIZATIONS}, got {self.quantization!r}")
        _check(-2**63 <= self.seed < 2**64, "seed", f"must be in [-2**63, 2**64) (torch's seeds), got {self.seed}")
        _check(self.tokenizer is None or has_tokenizer(self.tokenizer),
               "tokenizer", f"must be a directory holding a tokenizer (one of {TOKENIZER_FILES}), got {self.tokenizer!r}")
        config_file = Path(self.model) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model directory {self.model!r} has no config.json (does the path exist?)")
        if not self.hf_config:
            object.__setattr__(self, "hf_config", json.loads(config_file.read_text()))
        _check(not self.quantize_lm_head or self.quantization is not None or "quantization_config" in self.hf_config,
               "quantize_lm_head", QUANTIZE_LM_HEAD_NEEDS_FP8)
        limit = self.max_position_embeddings
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", limit)
        _check(
            0 < self.max_model_len <= limit, "max_model_len", f"must be in [1, {limit}], got {self.max_model_len}"
        )

    @property
    def tokenizer_path(self) -> str:
        """The directory the tokenizer comes from: `tokenizer`, else the model's."""
        return self.tokenizer or self.model

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 2048))

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or [""]
        return archs[0]

    @property
    def kv_sliding_window(self) -> int | None:
        """The window every layer attends within, when all of them have one: KV blocks wholly before it are
        never read again and go back to the pool while the request runs. None when a layer sees everything."""
        windows = sliding_windows(self.hf_config)
        return None if None in windows else max(windows)


def sliding_windows(hf_config: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), read as Hugging Face transformers reads the config.
    The row at position p then sees keys p - window < k <= p. Mistral applies sliding_window (4096 when the
    key is absent) to every layer; Qwen2 and Qwen3 only with use_sliding_window, to the layers layer_types
    marks "sliding_attention" (by default those from max_window_layers on); Llama has none. A window that
    covers every position the model addresses is full attention."""
    num_layers = hf_config["num_hidden_layers"]
    arch = (hf_config.get("architectures") or [""])[0]
    if arch == "MistralForCausalLM":
        windows = [hf_config.get("sliding_window", 4096)] * num_layers
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf_config.get("use_sliding_window", False):
        window = hf_config.get("sliding_window", 4096)
        first = hf_config.get("max_window_layers", 28)
        types = hf_config.get("layer_types") or [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)]
        windows = [window if t == "sliding_attention" else None for t in types]
    else:
        windows = [None] * num_layers
    limit = int(hf_config.get("max_position_embeddings", 2048))
    return tuple(w if w is not None and w < limit else None for w in windows)


DEFAULT_SWAP_SPACE_GIB = 1.0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = arg(16, "tokens per KV block")
    gpu_memory_utilization: float = arg(0.9, "fraction of GPU memory the engine may use")
    num_gpu_blocks: int | None = arg(None, "KV blocks, overriding the profiling run (default: as many as "
                                           "fit)")
    cpu_kv_cache_gib: float = arg(0.25, "KV pool size in GiB when the model runs on the CPU")
    swap_space_gib: float | None = arg(None, "CPU pool in GiB for preemption_mode swap (default: "
                                             f"{DEFAULT_SWAP_SPACE_GIB})")
    num_cpu_blocks: int | None = arg(None, "CPU swap blocks (default: as many as swap_space_gib holds)")
    enable_prefix_caching: bool = arg(True, "reuse the KV of prompt blocks seen before (prefix caching)")
    # Requests that share leading KV blocks attend to that prefix once per group (worker/cascade.py).
    cascade_attention: bool | None = arg(None, "read a prefix that requests share once per group: on for every "
                                         "such group, off never (default: where its cost model says it pays)")
    kv_cache_dtype: str = arg("auto", "'auto': the KV cache in the model's dtype; 'fp8': float8 e4m3 with a "
                                      "scale per layer for K and for V, twice the blocks (GPUs of sm_89+)")
    calculate_kv_scales: bool = arg(False, "with kv_cache_dtype='fp8': each layer's K and V scales from a "
                                           "calibration forward at startup (amax / 200, / 100, as vLLM), in "
                                           "place of the checkpoint's or 1.0")

    def __post_init__(self):
        _check_types(self)
        _check(any(self.cascade_attention is v for v in (None, True, False)), "cascade_attention",
               f"must be None (where it pays), True or False, got {self.cascade_attention!r}")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", f"must be a power of two in [1, 128], got {self.block_size}")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.num_gpu_blocks is None or self.num_gpu_blocks >= 2, "num_gpu_blocks", f"must be >= 2, got {self.num_gpu_blocks}")
        _check(self.cpu_kv_cache_gib > 0, "cpu_kv_cache_gib", f"must be > 0, got {self.cpu_kv_cache_gib}")
        _check(self.swap_space_gib is None or self.swap_space_gib >= 0, "swap_space_gib",
               f"must be >= 0, got {self.swap_space_gib}")
        _check(self.num_cpu_blocks is None or self.num_cpu_blocks >= 0, "num_cpu_blocks",
               f"must be >= 0, got {self.num_cpu_blocks}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(not self.calculate_kv_scales or self.kv_cache_dtype == "fp8", "calculate_kv_scales",
               f"scales an FP8 KV cache: it does nothing with kv_cache_dtype={self.kv_cache_dtype!r}")
        for name in ("gpu_memory_utilization", "cpu_kv_cache_gib"):
            _check(self.num_gpu_blocks is None or _at_default(self, name), name,
                   f"sizes the KV pool, which num_gpu_blocks={self.num_gpu_blocks} sets")
        _check(self.num_cpu_blocks is None or self.swap_space_gib is None, "swap_space_gib",
               f"sizes the CPU swap pool, which num_cpu_blocks={self.num_cpu_blocks} sets")


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


DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# The defaults `fastllm serve` (and `bench serving`, which measures it) use instead of the library's. A step's
# prompt tokens beside the decodes set every stream's inter-token latency, which a server is judged by; offline
# runs want the larger steps' throughput (README's serving section has both).
SERVING_DEFAULTS: dict[str, Any] = {"max_num_batched_tokens": 2048}


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = arg(DEFAULT_MAX_NUM_BATCHED_TOKENS, "token budget of one step (default: "
                                      f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}; serve and bench serving: "
                                      f"{SERVING_DEFAULTS['max_num_batched_tokens']}, for inter-token latency)")
    # None: default_max_num_seqs of the device (EngineConfig.for_device)
    max_num_seqs: int | None = arg(None, f"most requests in one step (default: {LARGE_GPU_MAX_NUM_SEQS} on "
                                         f"GPUs of {LARGE_GPU_GIB} GiB or more, else {DEFAULT_MAX_NUM_SEQS})")
    enable_chunked_prefill: bool = arg(True, "split long prompts into chunks so decodes keep flowing")
    preemption_mode: str = arg("recompute", "what preemption does to a request's KV when blocks run out",
                               ("recompute", "swap"))
    # Schedule and launch step N+1 before step N's tokens reach the host, so host work overlaps
    # the GPU. False runs each step to completion (the same tokens, one step less lag).
    async_scheduling: bool = arg(True, "schedule and launch step N+1 before step N's tokens reach the host")
    beam_run_ahead: bool = arg(True, "beam searches run ahead while only they run: the device picks each "
                                      "step's beams and the next step launches before the host reads them")

    def __post_init__(self):
        _check_types(self)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(self.preemption_mode in ("recompute", "swap"), "preemption_mode", f"must be 'recompute' or 'swap', got {self.preemption_mode!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size x pipeline_parallel_size ranks, one process and one device each
    (fastllm/distributed/). Above one rank the engine starts the other ranks' worker processes, or
    joins the ranks torchrun started (see the README)."""

    tensor_parallel_size: int = arg(1, "GPUs each layer is split over (tensor parallelism: one worker process "
                                    "each; under torchrun, the ranks torchrun started)")
    pipeline_parallel_size: int = arg(1, "pipeline stages the layers are split into, of tensor_parallel_size "
                                      "GPUs each")
    distributed_timeout_s: float = arg(600.0, "seconds a collective or a worker's answer may take before it is "
                                       "an error naming the rank")
    reuse_workers: bool = arg(False, "keep the worker processes when the engine shuts down, for this process's "
                              "next engine with the same ranks (it loads its model into them: tests, notebooks)")

    def __post_init__(self):
        _check_types(self)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            _check(value >= 1, name, f"must be an integer >= 1, got {value!r}")
        _check(self.distributed_timeout_s > 0, "distributed_timeout_s",
               f"must be > 0, got {self.distributed_timeout_s}")
        _check(not self.reuse_workers or self.world_size > 1, "reuse_workers", "needs more than one rank")
        _check(_at_default(self, "distributed_timeout_s") or self.world_size > 1,
               "distributed_timeout_s",
               "bounds the wait for other ranks' workers and collectives: one rank has none")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_model(self, hf_config: dict) -> None:
        """The model splits this way: tensor_parallel_size divides the attention heads, the KV heads
        (or is a multiple of them: each is then replicated) and the MLP's width; there are no more
        pipeline stages than layers."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        heads = hf_config.get("num_attention_heads", 1)
        kv_heads = hf_config.get("num_key_value_heads") or heads
        _check(heads % tp == 0, "tensor_parallel_size", f"({tp}) must divide the {heads} attention heads")
        _check(kv_heads % tp == 0 or tp % kv_heads == 0, "tensor_parallel_size",
               f"({tp}) must divide the {kv_heads} KV heads or be a multiple of them")
        width = hf_config.get("intermediate_size", 0)
        _check(width % tp == 0, "tensor_parallel_size", f"({tp}) must divide the intermediate size {width}")
        layers = hf_config.get("num_hidden_layers", 1)
        _check(pp <= layers, "pipeline_parallel_size", f"({pp}) must not exceed the {layers} decoder layers")


@dataclass(frozen=True)
class CompileConfig:
    enforce_eager: bool = arg(False, "no torch.compile, no CUDA graphs (the debug path)")
    cuda_graph_sizes: tuple[int, ...] | None = arg(None, "decode batch sizes to capture as CUDA graphs "
                                                   "(default: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs)")
    # torch.compile is GPU-only by default (a CPU compile takes ~15 s a graph)
    compile_on_cpu: bool = arg(False, "torch.compile on the CPU too (slow to compile)")
    mixed_cuda_graph_max_tokens: int = arg(2048, "prefill and mixed steps of up to this many tokens replay "
                                           "CUDA graphs captured per token bucket (0: they run compiled, "
                                           "without)")

    def __post_init__(self):
        _check_types(self)
        sizes = self.cuda_graph_sizes
        _check(sizes is None or (len(sizes) > 0 and all(s >= 1 for s in sizes)),
               "cuda_graph_sizes", f"must be positive integers, got {sizes!r}")
        _check(sizes is None or not self.enforce_eager, "cuda_graph_sizes",
               "are the batch sizes of CUDA graphs, which enforce_eager=True turns off")
        tokens = self.mixed_cuda_graph_max_tokens
        _check(tokens == 0 or tokens >= 16, "mixed_cuda_graph_max_tokens",
               f"must be 0 (off) or at least 16, got {tokens!r}")
        _check(_at_default(self, "mixed_cuda_graph_max_tokens") or not self.enforce_eager,
               "mixed_cuda_graph_max_tokens", "sizes CUDA graphs, which enforce_eager=True turns off")
        _check(not (self.compile_on_cpu and self.enforce_eager), "compile_on_cpu",
               "turns torch.compile on for the CPU, which enforce_eager=True turns off")


MAX_SPECULATIVE_TOKENS = 16
SPECULATIVE_METHODS = ("draft_model", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's `speculative_config`: a proposer drafts up to
    num_speculative_tokens tokens after each request's newest one and the target verifies them in one
    forward. The proposer is a draft model sharing the target's vocabulary (method "draft_model",
    implied by `model`) or prompt lookup (method "ngram": the last n tokens, n from prompt_lookup_max
    down to prompt_lookup_min, matched earlier in the request's tokens; what followed is proposed).
    Off while method is None."""

    method: str | None = None
    model: str | None = None  # the draft: a model directory or embedded name sharing the target's vocabulary
    num_speculative_tokens: int | None = None  # k; 4 with a method when not given
    prompt_lookup_max: int | None = None  # ngram only (default 4)
    prompt_lookup_min: int | None = None  # ngram only (default 2)
    # draft_model only, vLLM's field: 'fp8' puts the draft's linear weights in e4m3 as `quantization` does the
    # target's (a draft checkpoint in FP8 loads as one without it); None: the draft's weights as they are.
    quantization: str | None = None
    # Lower k (to 0) while proposals do not pay for themselves, from measured step costs and acceptance.
    adaptive: bool = True
    # Benchmark only (benchmarks/bench_spec_decode.py): the verifier accepts each draft token with this
    # probability whatever its value, so that random-weight models show the cost of speculation at a
    # chosen acceptance rate (and an n-gram lookup that finds nothing proposes anyway). Not reachable from
    # LLM(...), the CLI or the server.
    synthetic_acceptance_rate: float | None = None

    def __post_init__(self):
        if self.method is None and self.model is not None:
            object.__setattr__(self, "method", "draft_model")
        if self.method is None:
            for name in ("model", "prompt_lookup_max", "prompt_lookup_min", "quantization", "synthetic_acceptance_rate"):
                _check(getattr(self, name) is None, f"speculative_config.{name}", "needs a method or a model")
            _check(self.num_speculative_tokens is None, "num_speculative_tokens",
                   f"needs a speculative model or method, got {self.num_speculative_tokens}")
            _check(self.adaptive is True, "speculative_config.adaptive", "needs a method or a model")
            return
        _check(self.method in SPECULATIVE_METHODS, "speculative_config.method",
               f"must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.method == "draft_model":
            _check(isinstance(self.model, str), "speculative_config.model",
                   f"is required by method 'draft_model': a directory or an embedded model's name, got {self.model!r}")
            object.__setattr__(self, "model", resolve_model_path(self.model))
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                _check(getattr(self, name) is None, f"speculative_config.{name}", "applies to method 'ngram' only")
            _check(self.quantization is None or self.quantization in QUANTIZATIONS, "speculative_config.quantization",
                   f"must be None or one of {QUANTIZATIONS}, got {self.quantization!r}")
        else:
            for name in ("model", "quantization"):
                _check(getattr(self, name) is None, f"speculative_config.{name}", "applies to method 'draft_model' only")
            lookup_max = 4 if self.prompt_lookup_max is None else self.prompt_lookup_max
            lookup_min = min(2, lookup_max) if self.prompt_lookup_min is None else self.prompt_lookup_min
            _check(_is(lookup_min, int) and lookup_min >= 1, "speculative_config.prompt_lookup_min",
                   f"must be an integer >= 1, got {lookup_min!r}")
            _check(_is(lookup_max, int) and lookup_max >= lookup_min, "speculative_config.prompt_lookup_max",
                   f"must be an integer >= prompt_lookup_min ({lookup_min}), got {lookup_max!r}")
            object.__setattr__(self, "prompt_lookup_max", lookup_max)
            object.__setattr__(self, "prompt_lookup_min", lookup_min)
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", 4)
        k = self.num_speculative_tokens
        _check(_is(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
               "num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        _check(isinstance(self.adaptive, bool), "speculative_config.adaptive", f"must be a bool, got {self.adaptive!r}")
        alpha = self.synthetic_acceptance_rate
        _check(alpha is None or (isinstance(alpha, (int, float)) and 0 <= alpha <= 1),
               "synthetic_acceptance_rate", f"must be in [0, 1], got {alpha!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def lookahead(self) -> int:
        """Draft tokens a request may hold past its newest one: k, or 0 without speculation."""
        return self.num_speculative_tokens if self.enabled else 0

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_user(cls, spec: dict | str | None, model: str | None = None,
                  num_speculative_tokens: int | None = None) -> "SpeculativeConfig":
        """From `speculative_config` (a dict, or its JSON text as the CLI gives it) and the shorthands
        speculative_model / num_speculative_tokens. Unknown keys, and the benchmark-only
        synthetic_acceptance_rate, are a ValueError."""
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        _check(spec is None or isinstance(spec, dict), "speculative_config",
               f"must be a dict (or its JSON text), got {type(spec).__name__}")
        _check(spec != {}, "speculative_config", "is empty: give 'model' or 'method' (None turns speculation off)")
        values = dict(spec or {})
        known = {f.name for f in dataclasses.fields(cls)} - {"synthetic_acceptance_rate"}
        unknown = sorted(set(values) - known)
        _check(not unknown, "speculative_config", f"has unknown keys {unknown} (known: {sorted(known)})")
        for key, value in (("model", model), ("num_speculative_tokens", num_speculative_tokens)):
            if value is None:
                continue
            shorthand = "speculative_model" if key == "model" else key
            _check(values.get(key, value) == value, shorthand,
                   f"disagrees with speculative_config[{key!r}] ({values.get(key)!r} != {value!r})")
            values[key] = value
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    compile: CompileConfig = CompileConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    device: str = arg("auto", "'auto' picks cuda when present", ("auto", "cpu", "cuda"))

    def __post_init__(self):
        _check_types(self)
        _check(self.device in ("auto", "cpu", "cuda"), "device", f"must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        self.parallel.check_model(self.model.hf_config)
        if self.scheduler.preemption_mode != "swap":  # (the swap pool's size, where nothing swaps)
            for name in ("num_cpu_blocks", "swap_space_gib"):
                _check(getattr(self.cache, name) is None, name,
                       f"sizes the CPU swap pool, which only preemption_mode='swap' uses (it is "
                       f"{self.scheduler.preemption_mode!r})")
        if self.speculative.enabled:
            _check(self.parallel.pipeline_parallel_size == 1, "pipeline_parallel_size",
                   "must be 1 with speculative decoding (not supported across pipeline stages yet)")
        if not self.scheduler.enable_chunked_prefill:
            _check(
                self.scheduler.max_num_batched_tokens >= self.model.max_model_len,
                "max_num_batched_tokens",
                f"must be >= max_model_len ({self.model.max_model_len}) without chunked prefill",
            )

    def tokens_a_request_holds(self) -> int:
        """The most KV slots one request can hold: its whole context, or with a window on every layer the
        window and one step's tokens (and the draft's lookahead) in whole blocks, since the blocks behind the
        window go back to the pool as it runs (kv_cache_manager.py)."""
        window, block = self.model.kv_sliding_window, self.cache.block_size
        if window is None:
            return self.model.max_model_len
        step = self.scheduler.max_num_batched_tokens + self.speculative.lookahead
        return min(self.model.max_model_len, (-(-(window - 2 + step) // block) + 1) * block)

    def most_blocks_in_use(self) -> int:
        """The most KV blocks requests can hold at once: max_num_seqs of them, each its
        tokens_a_request_holds(), and the null block."""
        per_request = -(-self.tokens_a_request_holds() // self.cache.block_size)
        return self.scheduler.max_num_seqs * per_request + 1

    def for_device(self, device) -> "EngineConfig":
        """This config on the device it runs on (a torch.device): the arguments that do nothing there are
        errors, and the defaults that depend on it are filled in (max_num_seqs)."""
        self.check_device_args(device.type)
        if self.scheduler.max_num_seqs is not None:
            return self
        scheduler = dataclasses.replace(self.scheduler, max_num_seqs=default_max_num_seqs(device))
        return dataclasses.replace(self, scheduler=scheduler)

    def check_device_args(self, device_type: str) -> None:
        """A GPU's arguments on the CPU and the CPU's on a GPU are errors (an argument at its default was not
        given)."""
        cache, compile = self.cache, self.compile
        if device_type == "cuda":
            _check(_at_default(cache, "cpu_kv_cache_gib"), "cpu_kv_cache_gib",
                   "sizes the KV pool on the CPU; on a GPU gpu_memory_utilization or num_gpu_blocks does")
            _check(not compile.compile_on_cpu, "compile_on_cpu",
                   "turns torch.compile on for the CPU; on a GPU it is on unless enforce_eager=True")
            return
        _check(_at_default(cache, "gpu_memory_utilization"), "gpu_memory_utilization",
               f"sizes the KV pool on a GPU; on the {device_type} cpu_kv_cache_gib or num_gpu_blocks does")
        _check(compile.cuda_graph_sizes is None, "cuda_graph_sizes",
               f"are the batch sizes of CUDA graphs, which run on GPUs only (the engine runs on the "
               f"{device_type})")
        _check(_at_default(compile, "mixed_cuda_graph_max_tokens"), "mixed_cuda_graph_max_tokens",
               f"sizes CUDA graphs, which run on GPUs only (the engine runs on the {device_type})")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (LLM(...), the CLI); unknown names are an error."""
        parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "parallel": ParallelConfig, "compile": CompileConfig}
        values: dict[str, dict[str, Any]] = {name: {} for name in parts}
        top: dict[str, Any] = {"speculative": SpeculativeConfig.from_user(
            kwargs.pop("speculative_config", None), kwargs.pop("speculative_model", None),
            kwargs.pop("num_speculative_tokens", None))}
        for key, value in kwargs.items():
            owner = next((p for p, c in parts.items() if key in {f.name for f in dataclasses.fields(c)}), None)
            if owner is not None and key != "hf_config":
                values[owner][key] = value
            elif key == "device":
                top[key] = value
            else:
                raise ValueError(f"unknown engine argument {key!r}")
        if isinstance(values["compile"].get("cuda_graph_sizes"), list):  # (the CLI's lists; else checked as given)
            values["compile"]["cuda_graph_sizes"] = tuple(values["compile"]["cuda_graph_sizes"])
        values["model"]["model"] = resolve_model_path(model)
        built = {name: parts[name](**values[name]) for name in parts}
        return cls(**built, **top)
