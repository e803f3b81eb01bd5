"""Linear layers whose weights may be stored in the checkpoint as several separate matrices.

QKV and gate/up projections are fused into one matmul each (fewer, larger GEMMs); the loader
writes each checkpoint shard into its slice of the fused weight with load_shard().
Tensor parallelism will split these along the output (column) or input (row) dimension.
"""

from __future__ import annotations

import torch
from torch import nn

from fastllm.compile import custom_ops  # noqa: F401  (registers torch.ops.fastllm)


class Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Our few-row kernel at decode batch sizes, cuBLAS otherwise (fastllm/kernels/skinny_linear.py)."""
        return torch.ops.fastllm.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several output blocks side by side: [out_0 | out_1 | ...] = x @ [W_0; W_1; ...]^T."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        start = sum(self.output_sizes[:shard])
        target = getattr(self, param_name)
        if tensor.shape[0] != self.output_sizes[shard] or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(f"shard {shard} of {param_name} has shape {tuple(tensor.shape)}, "
                             f"expected ({self.output_sizes[shard]}, {', '.join(map(str, target.shape[1:]))})")
        with torch.no_grad():
            target[start:start + tensor.shape[0]].copy_(tensor)
