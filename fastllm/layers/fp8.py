"""FP8 linear weights (quantization="fp8"): float8 e4m3 weights with float32 scales, activations
quantized per token at each projection.

A quantized linear (layers/linear.py) holds its weight [N, K] in e4m3 and one float32 scale per output row,
`weight_scale` [N]: the weight it stands for is weight.float() * weight_scale[:, None]. "fp8" gives each row
its own scale, amax(|row|) / 448 (448: e4m3's largest value); "fp8-per-tensor" one per checkpoint tensor (q,
k, v, gate and up each their own inside the fused layers), written on each of its rows, so both, and
checkpoints of either kind, run the same kernels. Activations are quantized per token, amax / 448: by the
RMSNorm and SiLU-and-mul kernels before qkv, gate_up and down (a QuantizedActivation; quantizes_ahead), by
o_proj as it starts; or, with the checkpoint's static `input_scale`, by every projection. The matmul then runs
on e4m3 operands (fastllm/kernels/fp8_linear.py); the reference dequantizes both and multiplies in float32.

Where the FP8 weights come from:
- a 16/32-bit checkpoint, or dummy weights: each whole checkpoint tensor is quantized as it loads, then
  sliced for this rank like any checkpoint tensor, so every tensor-parallel split holds exactly the
  single-rank model's FP8 weights (a rank reads the whole tensor of each projection to get its scales).
- an FP8 checkpoint (config.json's quantization_config, quant_method "fp8" or "compressed-tensors"): e4m3
  `weight`, `weight_scale` (a scalar, or [N, 1] per channel) and, with static activation scales,
  `input_scale`, as they are.
Embeddings and norms keep the model's dtype; lm_head too, unless quantize_lm_head puts it in e4m3 (a scale
per vocabulary row, quantized at load time; with tied embeddings a copy of the table of its own).

FP8 matmuls need a GPU of compute capability 8.9 or newer (Ada, Hopper): elsewhere the engine refuses
(check_device), never running the 16-bit model in its place. The CPU runs the references in tests only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from fastllm.config import QUANTIZE_LM_HEAD_NEEDS_FP8
from fastllm.kernels.reference import FP8, fp8_scale, quantize_fp8

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fp8Scheme:
    """How this model's linear weights are FP8 (a field of LlamaArgs, so of the compiled forward's key)."""

    per_tensor: bool = False  # quantized at load time: one scale per checkpoint tensor (else per row)
    static_input: bool = False  # activation scales from the checkpoint's input_scale (else per token)
    checkpoint: str | None = None  # the checkpoint's quant_method when its weights are FP8 already
    lm_head: bool = False  # lm_head in e4m3 too (quantize_lm_head): a scale per vocabulary row, dynamic inputs

    def describe(self) -> str:
        weights = (f"from the {self.checkpoint} checkpoint" if self.checkpoint else
                   f"quantized at load time, a scale per {'tensor' if self.per_tensor else 'output channel'}")
        inputs = ("static activation scales (input_scale), each projection quantizing its input"
                  if self.static_input else
                  "activations per token, quantized by the RMSNorm and SiLU-and-mul kernels ahead of qkv, "
                  "gate_up and down (o_proj by a launch of its own)")
        head = ("; lm_head in e4m3 too, quantized at load time, a scale per vocabulary row" if self.lm_head
                else "; lm_head in the model's dtype")
        return f"FP8 e4m3 linear weights {weights}; {inputs}{head}"


class QuantizedActivation(NamedTuple):
    """A projection's input quantized per token by the kernel before it (RMSNorm's, SiLU-and-mul's _fp8
    variants): e4m3 values [..., K], float32 scales [..., 1], and the dtype the projection outputs."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


def quantizes_ahead(scheme: Fp8Scheme | None) -> bool:
    """Whether the kernels before this model's FP8 projections quantize their outputs for them: with per-token
    scales (static input_scales belong to each projection, which quantizes its own input)."""
    return scheme is not None and not scheme.static_input


def scheme_for(quantization: str | None, hf_config: dict, lm_head: bool = False) -> Fp8Scheme | None:
    """The FP8 scheme of engine arguments `quantization` and `quantize_lm_head` (lm_head) and the checkpoint's
    quantization_config (an FP8 checkpoint is FP8 whatever the argument says, as in vLLM); None: 16-bit
    weights. Raises ValueError naming `quantization` for checkpoints it cannot run, and `quantize_lm_head`
    without FP8 weights (ModelConfig refuses it first; fastllm.bench.roofline relies on this)."""
    config = hf_config.get("quantization_config")
    if config is None:
        if quantization is None:
            if lm_head:
                raise ValueError(f"quantize_lm_head {QUANTIZE_LM_HEAD_NEEDS_FP8}")
            return None
        return Fp8Scheme(per_tensor=quantization == "fp8-per-tensor", lm_head=lm_head)
    method = config.get("quant_method")
    if method not in ("fp8", "compressed-tensors"):
        raise ValueError(f"quantization: the checkpoint's quantization_config has quant_method {method!r}; "
                         "supported: FP8 checkpoints ('fp8', 'compressed-tensors')")
    if quantization == "fp8-per-tensor":
        raise ValueError("quantization: 'fp8-per-tensor' says how to quantize 16-bit weights, but this "
                         "checkpoint's weights are FP8 already (use quantization=None or 'fp8')")
    static = _fp8_static_input(config) if method == "fp8" else _compressed_tensors_static_input(config)
    return Fp8Scheme(static_input=static, checkpoint=method, lm_head=lm_head)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"quantization: this checkpoint's quantization_config has {what}, which fastllm does "
                      "not run (FP8 e4m3 weights with per-tensor or per-channel scales only)")


def _fp8_static_input(config: dict) -> bool:
    if config.get("weight_block_size") is not None:
        raise _unsupported(f"block-wise weight scales (weight_block_size {config['weight_block_size']})")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _unsupported(f"activation_scheme {scheme!r}")
    return scheme == "static"


def _compressed_tensors_static_input(config: dict) -> bool:
    kv = config.get("kv_cache_scheme")
    if kv is not None and ((kv.get("num_bits"), kv.get("type")) != (8, "float") or kv.get("strategy") != "tensor"):
        raise _unsupported(f"kv_cache_scheme {kv} (FP8 KV caches with per-tensor scales only)")
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise _unsupported("no config_groups")
    static = set()
    for group in groups:
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if (weights.get("num_bits"), weights.get("type")) != (8, "float") or \
                weights.get("strategy") not in ("tensor", "channel") or weights.get("dynamic"):
            raise _unsupported(f"weights {weights}")
        if inputs is None:  # weight-only: the kernels still quantize the activations (per token)
            logger.info("FP8 checkpoint with 16-bit activations: fastllm quantizes them per token")
            static.add(False)
            continue
        if (inputs.get("num_bits"), inputs.get("type")) != (8, "float") or \
                (inputs.get("dynamic") is False and inputs.get("strategy") != "tensor"):
            raise _unsupported(f"input_activations {inputs}")
        static.add(inputs.get("dynamic") is False)
    if len(static) > 1:
        raise _unsupported("static and dynamic activation scales in different groups")
    return static.pop()


def check_device(device: torch.device, scheme: Fp8Scheme, field: str = "quantization") -> None:
    """FP8 weights run on GPUs of sm_89 or newer only: anything else is a ValueError naming the argument that
    asked for them (no silent 16-bit run)."""
    what = "the checkpoint's FP8 weights need" if scheme.checkpoint else "FP8 weights need"
    _require_fp8_gpu(device, field, what, "FP8 matmuls")


def check_kv_cache_device(device: torch.device) -> None:
    """An FP8 KV cache (kv_cache_dtype="fp8") runs on GPUs of sm_89 or newer only: anything else is a
    ValueError naming `kv_cache_dtype` (no silent 16-bit cache)."""
    _require_fp8_gpu(device, "kv_cache_dtype", "an FP8 KV cache needs", "e4m3 conversions")


def _require_fp8_gpu(device: torch.device, field: str, what_needs: str, why: str) -> None:
    if device.type != "cuda":
        raise ValueError(f"{field}: {what_needs} a CUDA GPU of compute capability 8.9 or newer ({why}); "
                         f"the engine runs on {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"{field}: {what_needs} a GPU of compute capability 8.9 or newer ({why}); "
                         f"{torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}")


def quantize_weight(weight: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A 16/32-bit weight [N, K] -> (e4m3 [N, K], float32 scale [N])."""
    amax = weight.abs().amax() if per_tensor else weight.abs().amax(dim=1)
    scale = fp8_scale(amax).expand(weight.shape[0]).contiguous()
    return quantize_fp8(weight, scale[:, None]), scale


def is_fp8(source) -> bool:
    """Whether a checkpoint tensor (or lazy safetensors slice) is e4m3."""
    return source.dtype == FP8 if isinstance(source, torch.Tensor) else source.get_dtype() == "F8_E4M3"


def checkpoint_scale(source, rows: int, name: str) -> torch.Tensor:
    """A checkpoint's weight_scale for a tensor of `rows` output rows (a scalar, or [rows, 1] / [rows] per
    channel) as this layer stores it: float32 [rows]."""
    scale = source[...].float()
    if scale.numel() == 1:
        return scale.reshape(1).expand(rows).contiguous()
    if tuple(scale.shape) in ((rows,), (rows, 1)):
        return scale.reshape(rows)
    raise ValueError(f"{name}: checkpoint scale of shape {tuple(scale.shape)} is neither per tensor nor per "
                     f"output channel ({rows}, 1)")


def check_loaded(model: nn.Module) -> None:
    """Every FP8 scale was loaded (they start as NaN): an FP8 checkpoint missing some is an error."""
    absent = [name for name, buf in model.named_buffers()
              if name.endswith(("weight_scale", "input_scale")) and torch.isnan(buf).any()]
    if absent:
        raise ValueError(f"checkpoint is missing {len(absent)} FP8 scales, e.g. {absent[:3]}")


# A checkpoint's FP8 KV-cache scales (compressed-tensors, AutoFP8, vLLM's names): suffix of the attention
# module's name -> which of K and V it scales.
_KV_SCALES = {"k_scale": "k", "v_scale": "v", "kv_scale": "kv", "k_proj.output_scale": "k",
              "v_proj.output_scale": "v"}


def kv_scale_name(name: str) -> tuple[str, str] | None:
    """(the attention module, "k" / "v" / "kv") when checkpoint tensor `name` is an FP8 KV-cache scale,
    e.g. model.layers.3.self_attn.k_scale; else None."""
    for suffix, which in _KV_SCALES.items():
        if name.endswith(".self_attn." + suffix):
            return name[:-len(suffix) - 1], which
    return None


def load_kv_scale(attn, which: str, source, name: str) -> None:
    """Set a layer's checkpoint KV scale (attention.Attention.checkpoint_kv_scales) from a per-tensor
    checkpoint tensor; they apply when kv_cache_dtype is "fp8"."""
    scale = source[...].float()
    if scale.numel() != 1 or not torch.isfinite(scale).all() or scale.item() <= 0:
        raise ValueError(f"{name}: FP8 KV-cache scales must be one positive number per tensor, got shape "
                         f"{tuple(scale.shape)}")
    k_scale, v_scale = attn.checkpoint_kv_scales or (1.0, 1.0)
    value = scale.item()
    attn.checkpoint_kv_scales = (value if which in ("k", "kv") else k_scale,
                                 value if which in ("v", "kv") else v_scale)
