"""The token embedding and the lm_head, split over the tensor-parallel ranks by vocabulary rows.

Each rank holds ceil(vocab / tp_size) consecutive rows of the table (the last rank's tail is zero
padding). The embedding looks up the ids in its own range, zeroes the others and all-reduces: each
output row has one non-zero term, so the sum is exact. The lm_head computes the logits of its rows and
gathers every rank's into the whole [T, vocab] on every rank, so every rank samples the same tokens
from the same logits. With one rank both are the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastllm.distributed.communication import get_tp_group
from fastllm.kernels import dispatch as kernels
from fastllm.layers.fp8 import FP8, is_fp8, quantize_weight
from fastllm.layers.linear import copy_into, shape_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_size, self.tp_size = vocab_size, tp_size
        self.rows = -(-vocab_size // tp_size)  # per rank
        self.start = tp_rank * self.rows
        self.num_real = max(0, min(self.rows, vocab_size - self.start))  # rows before the padding
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size, dtype=dtype), requires_grad=dtype != FP8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_real)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return torch.ops.fastllm.tp_all_reduce(rows)

    def load_weight(self, param_name: str, source) -> None:
        """This rank's rows of the whole [vocab, hidden] table."""
        rows = self.own_rows(param_name, source)
        with torch.no_grad():
            self.weight[self.num_real:].zero_()
        copy_into(self.weight[:self.num_real], rows, param_name)

    def own_rows(self, param_name: str, source):
        """This rank's rows of a whole [vocab, hidden] checkpoint tensor (a lazy slice reads just those)."""
        full = shape_of(source)
        if full != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"{param_name}: checkpoint shape {full} != "
                             f"({self.vocab_size}, {self.weight.shape[1]})")
        return source[self.start:self.start + self.num_real]


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ W^T over the whole vocabulary, W split by rows like the embedding (and the
    same tensor when the embeddings are tied). With `fp8` (quantize_lm_head) W is e4m3 with a float32 scale
    per vocabulary row, quantized as it loads (tied: from the embedding's table, a copy of its own), and the
    logits come from fp8_linear (the hidden states quantized per token)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1, fp8: bool = False):
        super().__init__(vocab_size, hidden_size, tp_rank, tp_size, dtype=FP8 if fp8 else None)
        self.fp8 = fp8
        if fp8:  # NaN until loaded (fp8.check_loaded); the padding rows' logits are cut off
            self.register_buffer("weight_scale", torch.full((self.rows,), float("nan"), dtype=torch.float32))

    def load_weight(self, param_name: str, source) -> None:
        """This rank's rows of the whole [vocab, hidden] table, quantized row by row with `fp8`."""
        if not self.fp8:
            return super().load_weight(param_name, source)
        if param_name != "weight" or is_fp8(source):
            raise ValueError(f"lm_head.{param_name}: an FP8 lm_head is quantized from a 16/32-bit checkpoint "
                             "tensor (quantize_lm_head); this checkpoint's is stored in FP8, which fastllm does "
                             "not load")
        weight, scale = quantize_weight(self.own_rows(param_name, source).to(self.weight.device), per_tensor=False)
        with torch.no_grad():
            self.weight.view(torch.uint8)[self.num_real:].zero_()
            self.weight[:self.num_real].copy_(weight)
            self.weight_scale.fill_(1.0)
            self.weight_scale[:self.num_real].copy_(scale)

    def _logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if not self.fp8:
            return kernels.linear(hidden, self.weight, None, out=out)
        logits = kernels.fp8_linear(hidden, self.weight, self.weight_scale, None)
        return logits if out is None else out.copy_(logits)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, vocab] in the model's dtype; out: write them there (a CUDA graph's static buffer)."""
        if self.tp_size == 1:
            return self._logits(hidden, out)
        local = self._logits(hidden)  # [T, rows]
        gathered = get_tp_group().all_gather(local)  # [tp, T, rows]
        logits = gathered.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, :self.vocab_size]
        if out is None:
            return logits.contiguous()
        return out.copy_(logits)
