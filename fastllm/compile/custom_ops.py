"""Our kernels as torch.library custom ops, so torch.compile sees each as one opaque node with a
fake (shape-only) implementation and never breaks the graph on them.

The eager model calls these same ops: one code path, compiled or not (a custom-op call costs a
few microseconds of dispatch in eager mode; the compiled runner replays CUDA graphs).

Attention is one op, `fastllm::attention`, taking the layer's number in its model: it finds the
layer (and so its KV cache) and the step's metadata in the forward context. Dynamo therefore never
guards on per-step values (sequence lengths, max_query_len), the graph holds no reference to a
particular model instance, and the kernels launched inside are captured into CUDA graphs like any other.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm.kernels import dispatch as kernels
from fastllm.worker.attn_metadata import get_forward_context


@torch.library.custom_op("fastllm::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return kernels.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("fastllm::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return kernels.fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("fastllm::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    return kernels.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("fastllm::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return kernels.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("fastllm::add_rms_norm_linear", mutates_args=())
def add_rms_norm_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                        bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """(linear(rms_norm(x + residual)), x + residual): a decoder's pre-norm projection, one launch at decode
    rows (the norm computed in the projection's loads: kernels/skinny_linear.py)."""
    return kernels.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)


@add_rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0])), torch.empty_like(x)


@torch.library.custom_op("fastllm::gated_linear", mutates_args=())
def gated_linear(x: Tensor, weight: Tensor) -> Tensor:
    """silu_and_mul(linear(x)) of weight [gate; up]: the MLP's activation, one launch at decode rows (the SiLU
    in the projection's epilogue: kernels/skinny_linear.py)."""
    return kernels.gated_linear(x, weight)


@gated_linear.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


@torch.library.custom_op("fastllm::add_rms_norm_gated_linear", mutates_args=())
def add_rms_norm_gated_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor
                              ) -> tuple[Tensor, Tensor]:
    """(gated_linear(rms_norm(x + residual)), x + residual): one launch at one decode row for small
    weights."""
    return kernels.add_rms_norm_gated_linear(x, residual, norm_weight, eps, weight)


@add_rms_norm_gated_linear.register_fake
def _(x, residual, norm_weight, eps, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2)), torch.empty_like(x)


@torch.library.custom_op("fastllm::rms_norm_folded_linear", mutates_args=())
def rms_norm_folded_linear(x: Tensor, unit_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None
                           ) -> Tensor:
    """linear(rms_norm(x)) for a weight that carries the norm's weight (the norm left with unit_weight, ones):
    one launch at decode rows (each row's 1 / rms applied to the sums: kernels/skinny_linear.py)."""
    return kernels.rms_norm_folded_linear(x, unit_weight, eps, weight, bias)


@rms_norm_folded_linear.register_fake
def _(x, unit_weight, eps, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("fastllm::rms_norm_folded_gated_linear", mutates_args=())
def rms_norm_folded_gated_linear(x: Tensor, unit_weight: Tensor, eps: float, weight: Tensor) -> Tensor:
    """gated_linear(rms_norm(x)) for a [gate; up] weight that carries the norm's weight."""
    return kernels.rms_norm_folded_gated_linear(x, unit_weight, eps, weight)


@rms_norm_folded_gated_linear.register_fake
def _(x, unit_weight, eps, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


@torch.library.custom_op("fastllm::linear_add", mutates_args=())
def linear_add(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    """linear(x) + residual: a projection onto the residual stream, the add in its epilogue at decode rows."""
    return kernels.linear_add(x, weight, bias, residual)


@linear_add.register_fake
def _(x, weight, bias, residual):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("fastllm::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
               input_scale: Tensor | None) -> Tensor:
    """x @ (e4m3 weight [N, K] x weight_scale [N])^T (+ bias), x quantized per token (or by the static
    input_scale) first: layers/fp8.py."""
    return kernels.fp8_linear(x, weight, weight_scale, bias, input_scale)


@fp8_linear.register_fake
def _(x, weight, weight_scale, bias, input_scale):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# Before a projection with FP8 weights (dynamic per-token scales) the kernel ahead of it quantizes its output:
# (e4m3, float32 scale [..., 1]) in place of the 16/32-bit tensor, and fp8_linear_quantized takes the pair.
def _quantized_like(x: Tensor, width: int) -> tuple[Tensor, Tensor]:
    return (x.new_empty((*x.shape[:-1], width), dtype=torch.float8_e4m3fn),
            x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))


@torch.library.custom_op("fastllm::rms_norm_fp8", mutates_args=())
def rms_norm_fp8(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return kernels.rms_norm_fp8(x, weight, eps)


@rms_norm_fp8.register_fake
def _(x, weight, eps):
    return _quantized_like(x, x.shape[-1])


@torch.library.custom_op("fastllm::fused_add_rms_norm_fp8", mutates_args=())
def fused_add_rms_norm_fp8(x: Tensor, residual: Tensor, weight: Tensor, eps: float
                           ) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.fused_add_rms_norm_fp8(x, residual, weight, eps)


@fused_add_rms_norm_fp8.register_fake
def _(x, residual, weight, eps):
    return *_quantized_like(x, x.shape[-1]), torch.empty_like(x)


@torch.library.custom_op("fastllm::silu_and_mul_fp8", mutates_args=())
def silu_and_mul_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    return kernels.silu_and_mul_fp8(x)


@silu_and_mul_fp8.register_fake
def _(x):
    return _quantized_like(x, x.shape[-1] // 2)


@torch.library.custom_op("fastllm::fp8_linear_quantized", mutates_args=())
def fp8_linear_quantized(x_q: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
                         out_dtype: torch.dtype) -> Tensor:
    return kernels.fp8_linear_quantized(x_q, x_scale, weight, weight_scale, bias, out_dtype)


@fp8_linear_quantized.register_fake
def _(x_q, x_scale, weight, weight_scale, bias, out_dtype):
    return x_q.new_empty((*x_q.shape[:-1], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("fastllm::attention", mutates_args=())
def attention(positions: Tensor, query: Tensor, key: Tensor, value: Tensor, layer_index: int,
              q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None,
              norm_eps: float = 1e-6) -> Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] before rotary -> [T, Hq, D]; rotates q and k (out of place)
    and writes the rotated key and the value into the layer's cache. With q/k norm weights [D] (Qwen3),
    each head of q and k is RMS-normed first, inside the same kernels."""
    layer = get_forward_context().attention_layers[layer_index]
    return layer.run(positions, query, key, value, q_norm_weight, k_norm_weight, norm_eps)


@attention.register_fake
def _(positions, query, key, value, layer_index, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6):
    return torch.empty_like(query)
