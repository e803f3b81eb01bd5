"""RMSNorm, with the residual add fused in when a residual is given; before a projection with FP8 weights,
its output quantized per token in the same kernel (quantize_output)."""

from __future__ import annotations

import torch
from torch import nn

from fastllm.compile import custom_ops  # noqa: F401  (registers torch.ops.fastllm)
from fastllm.layers.fp8 import QuantizedActivation


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, quantize_output: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.quantize_output = quantize_output

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x), or (norm(x + residual), x + residual) when residual is given; norm(x) is a
        QuantizedActivation with quantize_output."""
        if self.quantize_output:
            if residual is None:
                return QuantizedActivation(*torch.ops.fastllm.rms_norm_fp8(x, self.weight, self.eps), x.dtype)
            q, scale, residual = torch.ops.fastllm.fused_add_rms_norm_fp8(x, residual, self.weight, self.eps)
            return QuantizedActivation(q, scale, x.dtype), residual
        if residual is None:
            return torch.ops.fastllm.rms_norm(x, self.weight, self.eps)
        return torch.ops.fastllm.fused_add_rms_norm(x, residual, self.weight, self.eps)
