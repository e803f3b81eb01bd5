"""SiLU-and-mul for the gated MLP."""

from __future__ import annotations

import torch
from torch import nn

from fastllm.compile import custom_ops  # noqa: F401  (registers torch.ops.fastllm)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2I] as [gate | up] -> silu(gate) * up, [T, I]. Our kernel, not Inductor's fusion of
        the same two lines, which reached well under the copy bandwidth in the dynamic-shape model graph
        (README's kernel table; benchmarks/kernels/bench_silu_and_mul.py compares the two)."""
        return torch.ops.fastllm.silu_and_mul(x)
