"""Linear layers, split over the tensor-parallel ranks as Megatron-LM splits them.

A column-parallel layer holds a slice of the output features (rows of W): its output is this rank's
slice and needs no communication. A row-parallel layer holds the matching slice of the input features
(columns of W): each rank's product is a partial sum, and an all-reduce adds them up. Attention's q/k/v
and the MLP's gate/up are column-parallel, o and down row-parallel, so each block of the decoder needs
one all-reduce. With one rank these are plain linears (no collective, no extra work per call).

QKV and gate/up are fused into one matmul each; a fused layer's output blocks are split one by one, so
this rank's slices of q, k and v sit side by side as the whole blocks do with one rank. The loader hands
each layer whole checkpoint tensors (or lazy safetensors slices: a rank reads only its part of the file).
"""

from __future__ import annotations

import torch
from torch import nn

from fastllm.compile import custom_ops  # noqa: F401  (registers torch.ops.fastllm)
from fastllm.distributed import communication  # noqa: F401  (registers torch.ops.fastllm.tp_all_reduce)


def shape_of(source) -> tuple[int, ...]:
    """The shape of a tensor or of a lazy safetensors slice (which reads nothing until indexed)."""
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def copy_into(target: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(source.shape) != tuple(target.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(source.shape)} != parameter {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(source)


class Linear(nn.Module):
    """The whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Our few-row kernel at decode batch sizes, cuBLAS otherwise (fastllm/kernels/skinny_linear.py)."""
        return torch.ops.fastllm.linear(x, self.weight, self.bias)

    def load_weight(self, param_name: str, source) -> None:
        """Copy this rank's part of the whole checkpoint tensor of one parameter."""
        copy_into(getattr(self, param_name), source[:], param_name)


class ColumnParallelLinear(Linear):
    """Output blocks side by side, [out_0 | out_1 | ...] = x @ [W_0; W_1; ...]^T, each block split
    into `partitions[i]` slices (tp_size of them by default) of which this rank holds one. A block
    with fewer slices than ranks (KV heads fewer than ranks) is replicated: tp_size // partitions
    consecutive ranks hold the same slice."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, partitions: list[int] | None = None):
        partitions = list(partitions or [tp_size] * len(output_sizes))
        for full, parts in zip(output_sizes, partitions):
            if full % parts or tp_size % parts:
                raise ValueError(f"an output block of {full} features does not split into {parts} slices "
                                 f"over {tp_size} ranks (tensor_parallel_size)")
        self.full_sizes = list(output_sizes)
        self.output_sizes = [full // parts for full, parts in zip(output_sizes, partitions)]  # this rank's
        self.slice_index = [tp_rank * parts // tp_size for parts in partitions]
        super().__init__(input_size, sum(self.output_sizes), bias)

    def load_shard(self, param_name: str, shard: int, source) -> None:
        """Copy this rank's slice of output block `shard` from the block's whole checkpoint tensor."""
        full = shape_of(source)
        target = getattr(self, param_name)
        if full[0] != self.full_sizes[shard] or full[1:] != tuple(target.shape[1:]):
            raise ValueError(f"shard {shard} of {param_name} has shape {full}, expected "
                             f"({self.full_sizes[shard]}, {', '.join(map(str, target.shape[1:]))})")
        size = self.output_sizes[shard]
        start = self.slice_index[shard] * size
        offset = sum(self.output_sizes[:shard])
        copy_into(target[offset:offset + size], source[start:start + size], param_name)

    def load_weight(self, param_name: str, source) -> None:
        """The whole fused tensor (all blocks stacked, e.g. dummy weights): every block's slice."""
        offset = 0
        for shard, full in enumerate(self.full_sizes):
            self.load_shard(param_name, shard, source[offset:offset + full])
            offset += full


class RowParallelLinear(Linear):
    """Input features split over the ranks; the partial products are summed by an all-reduce (the
    bias, if any, is added once, after it)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1):
        if input_size % tp_size:
            raise ValueError(f"{input_size} input features do not split over {tp_size} ranks "
                             "(tensor_parallel_size)")
        super().__init__(input_size // tp_size, output_size, bias)
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return torch.ops.fastllm.linear(x, self.weight, self.bias)
        out = torch.ops.fastllm.tp_all_reduce(torch.ops.fastllm.linear(x, self.weight, None))
        return out if self.bias is None else out + self.bias

    def load_weight(self, param_name: str, source) -> None:
        if param_name == "bias":
            return super().load_weight(param_name, source)
        size = self.weight.shape[1]
        full = shape_of(source)
        if full != (self.weight.shape[0], size * self.tp_size):
            raise ValueError(f"{param_name}: checkpoint shape {full} != "
                             f"({self.weight.shape[0]}, {size * self.tp_size})")
        copy_into(self.weight, source[:, self.tp_rank * size:(self.tp_rank + 1) * size], param_name)
