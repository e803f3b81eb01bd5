"""Linear layers, split over the tensor-parallel ranks as Megatron-LM splits them.

A column-parallel layer holds a slice of the output features (rows of W): its output is this rank's
slice and needs no communication. A row-parallel layer holds the matching slice of the input features
(columns of W): each rank's product is a partial sum, and an all-reduce adds them up. Attention's q/k/v
and the MLP's gate/up are column-parallel, o and down row-parallel, so each block of the decoder needs
one all-reduce. With one rank these are plain linears (no collective, no extra work per call).

QKV and gate/up are fused into one matmul each; a fused layer's output blocks are split one by one, so
this rank's slices of q, k and v sit side by side as the whole blocks do with one rank. The loader hands
each layer whole checkpoint tensors (or lazy safetensors slices: a rank reads only its part of the file).

With FP8 weights (layers/fp8.py) a layer's weight is e4m3 and it holds a float32 scale per output row,
`weight_scale`, sliced with the rows (a row-parallel layer's is whole on every rank, like its bias); a
16/32-bit checkpoint tensor is quantized whole as it loads, then sliced.
"""

from __future__ import annotations

import torch
from torch import nn

from fastllm.compile import custom_ops  # noqa: F401  (registers torch.ops.fastllm)
from fastllm.distributed import communication  # noqa: F401  (registers torch.ops.fastllm.tp_all_reduce)
from fastllm.layers.fp8 import FP8, Fp8Scheme, QuantizedActivation, checkpoint_scale, is_fp8, quantize_weight


def shape_of(source) -> tuple[int, ...]:
    """The shape of a tensor or of a lazy safetensors slice (which reads nothing until indexed)."""
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def copy_into(target: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(source.shape) != tuple(target.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(source.shape)} != parameter {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(source)


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """weight [N, K] *= norm_weight [K] along K, in place (rounded once to weight's dtype): a projection after
    an RMSNorm then needs only each row's 1 / rms (rms_normed)."""
    weight.copy_((weight.float() * norm_weight.float()[None, :]).to(weight.dtype))


class Linear(nn.Module):
    """The whole weight on every rank; with `fp8`, in e4m3 with a scale per output row."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, fp8: Fp8Scheme | None = None):
        super().__init__()
        self.fp8 = fp8
        if fp8 is None:
            self.weight = nn.Parameter(torch.empty(output_size, input_size))
        else:
            self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8), requires_grad=False)
            # NaN until loaded (fp8.check_loaded)
            self.register_buffer("weight_scale", torch.full((output_size,), float("nan"),
                                                            dtype=torch.float32))
            self.register_buffer("input_scale", torch.full((), float("nan"), dtype=torch.float32)
                                 if fp8.static_input else None)
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        return self.matmul(x, self.bias, gated)

    def matmul(self, x: torch.Tensor | QuantizedActivation, bias: torch.Tensor | None, gated: bool = False
               ) -> torch.Tensor:
        """x @ W^T (+ bias): our few-row kernel at decode batch sizes, cuBLAS otherwise
        (fastllm/kernels/skinny_linear.py); FP8 weights: fastllm/kernels/fp8_linear.py, on x as it comes or
        quantized by the kernel before (a QuantizedActivation). gated: W is [gate; up] and the output
        silu(x @ gate^T) * (x @ up^T), the SiLU in the projection's epilogue at decode rows (16/32-bit
        weights, no bias)."""
        if gated:
            assert self.fp8 is None and bias is None, "gated: 16/32-bit weights, no bias (FP8: layers/fp8.py)"
            return torch.ops.fastllm.gated_linear(x, self.weight)
        if self.fp8 is None:
            return torch.ops.fastllm.linear(x, self.weight, bias)
        if isinstance(x, QuantizedActivation):
            return torch.ops.fastllm.fp8_linear_quantized(x.values, x.scales, self.weight, self.weight_scale, bias,
                                                          x.dtype)
        return torch.ops.fastllm.fp8_linear(x, self.weight, self.weight_scale, bias, self.input_scale)

    def load_weight(self, param_name: str, source) -> None:
        """Copy this rank's part of the whole checkpoint tensor of one parameter."""
        for name, tensor in self.stored_forms(param_name, source, self.weight.shape[0]):
            self.copy_whole(name, tensor)

    def copy_whole(self, name: str, source) -> None:
        copy_into(getattr(self, name), source[:], name)

    def stored_forms(self, param_name: str, source, rows: int) -> list[tuple[str, object]]:
        """What a checkpoint tensor (of `rows` output rows) loads as: itself, or with FP8 weights a 16/32-bit
        weight quantized (weight and weight_scale) and a checkpoint's scale made one per row. A fused layer's
        static input scales (one per checkpoint tensor, all of the same input) merge here: the largest."""
        if self.fp8 is None or param_name == "bias":
            return [(param_name, source)]
        if param_name == "weight" and not is_fp8(source):
            return list(zip(("weight", "weight_scale"),
                            quantize_weight(source[:].to(self.weight.device), self.fp8.per_tensor)))
        if param_name == "weight_scale":
            return [(param_name, checkpoint_scale(source, rows, param_name))]
        if param_name == "input_scale":  # (a layer without static scales has no such buffer to load)
            with torch.no_grad():
                scale = source[...].to(self.input_scale.device, torch.float32).reshape(())
                self.input_scale.copy_(torch.fmax(self.input_scale, scale))
            return []
        return [(param_name, source)]


class ColumnParallelLinear(Linear):
    """Output blocks side by side, [out_0 | out_1 | ...] = x @ [W_0; W_1; ...]^T, each block split
    into `partitions[i]` slices (tp_size of them by default) of which this rank holds one. A block
    with fewer slices than ranks (KV heads fewer than ranks) is replicated: tp_size // partitions
    consecutive ranks hold the same slice."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, partitions: list[int] | None = None, fp8: Fp8Scheme | None = None):
        partitions = list(partitions or [tp_size] * len(output_sizes))
        for full, parts in zip(output_sizes, partitions):
            if full % parts or tp_size % parts:
                raise ValueError(f"an output block of {full} features does not split into {parts} slices "
                                 f"over {tp_size} ranks (tensor_parallel_size)")
        self.full_sizes = list(output_sizes)
        self.output_sizes = [full // parts for full, parts in zip(output_sizes, partitions)]  # this rank's
        self.slice_index = [tp_rank * parts // tp_size for parts in partitions]
        super().__init__(input_size, sum(self.output_sizes), bias, fp8)

    def normed(self, norm, x: torch.Tensor, residual: torch.Tensor | None, gated: bool = False):
        """(self(norm(x + residual), gated), x + residual) for an RMSNorm `norm` (layers/norm.py); without a
        residual (a first layer), (self(norm(x), gated), x). With 16/32-bit weights one op: the norm in the
        projection's loads at one decode row."""
        if residual is None:
            return self(norm(x), gated), x
        if self.fp8 is not None or norm.quantize_output:
            normed, residual = norm(x, residual)
            return self(normed, gated), residual
        if gated:
            assert self.bias is None, "gated: no bias"
            return torch.ops.fastllm.add_rms_norm_gated_linear(x, residual, norm.weight, norm.eps,
                                                               self.weight)
        return torch.ops.fastllm.add_rms_norm_linear(x, residual, norm.weight, norm.eps, self.weight,
                                                     self.bias)

    def rms_normed(self, norm, h: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """self(norm(h), gated) for a weight that carries `norm`'s weight (LlamaDecoderLayer.fold_norms; the
        norm's own is ones since): each row's 1 / rms(h) scales the sums, one launch at decode rows."""
        if gated:
            assert self.bias is None, "gated: no bias"
            return torch.ops.fastllm.rms_norm_folded_gated_linear(h, norm.weight, norm.eps, self.weight)
        return torch.ops.fastllm.rms_norm_folded_linear(h, norm.weight, norm.eps, self.weight, self.bias)

    def load_shard(self, param_name: str, shard: int, source) -> None:
        """Copy this rank's slice of output block `shard` from the block's whole checkpoint tensor."""
        for name, tensor in self.stored_forms(param_name, source, self.full_sizes[shard]):
            self._copy_shard(name, shard, tensor)

    def _copy_shard(self, param_name: str, shard: int, source) -> None:
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
                 tp_size: int = 1, fp8: Fp8Scheme | None = None):
        if input_size % tp_size:
            raise ValueError(f"{input_size} input features do not split over {tp_size} ranks "
                             "(tensor_parallel_size)")
        super().__init__(input_size // tp_size, output_size, bias, fp8)
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The projection (+ residual: onto the residual stream, the add in the kernel's epilogue on one rank
        with 16/32-bit weights, after the all-reduce on several)."""
        if self.tp_size == 1:
            if residual is not None and self.fp8 is None:
                return torch.ops.fastllm.linear_add(x, self.weight, self.bias, residual)
            out = self.matmul(x, self.bias)
        else:
            out = torch.ops.fastllm.tp_all_reduce(self.matmul(x, None))
            out = out if self.bias is None else out + self.bias
        return out if residual is None else out + residual

    def copy_whole(self, param_name: str, source) -> None:
        if param_name != "weight":  # the bias and FP8 scales: whole on every rank
            return super().copy_whole(param_name, source)
        size = self.weight.shape[1]
        full = shape_of(source)
        if full != (self.weight.shape[0], size * self.tp_size):
            raise ValueError(f"{param_name}: checkpoint shape {full} != "
                             f"({self.weight.shape[0]}, {size * self.tp_size})")
        copy_into(self.weight, source[:, self.tp_rank * size:(self.tp_rank + 1) * size], param_name)
