"""SiLU-and-mul for the gated MLP."""

from __future__ import annotations

import torch
from torch import nn

from fastllm.compile import custom_ops  # noqa: F401  (registers torch.ops.fastllm)
from fastllm.layers.fp8 import QuantizedActivation


class SiluAndMul(nn.Module):
    def __init__(self, quantize_output: bool = False):
        super().__init__()
        self.quantize_output = quantize_output  # before a down projection with FP8 weights

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedActivation:
        """x: [T, 2I] as [gate | up] -> silu(gate) * up, [T, I] (quantized per token with quantize_output).
        Our kernel, not Inductor's fusion of the same two lines, which reached well under the copy bandwidth
        in the dynamic-shape model graph (README's kernel table; benchmarks/kernels/bench_silu_and_mul.py)."""
        if self.quantize_output:
            return QuantizedActivation(*torch.ops.fastllm.silu_and_mul_fp8(x), x.dtype)
        return torch.ops.fastllm.silu_and_mul(x)
