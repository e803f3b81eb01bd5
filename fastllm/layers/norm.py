"""RMSNorm, with the residual add fused in when a residual is given."""

from __future__ import annotations

import torch
from torch import nn

from fastllm.compile import custom_ops  # noqa: F401  (registers torch.ops.fastllm)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x), or (norm(x + residual), x + residual) when residual is given."""
        if residual is None:
            return torch.ops.fastllm.rms_norm(x, self.weight, self.eps)
        return torch.ops.fastllm.fused_add_rms_norm(x, residual, self.weight, self.eps)
