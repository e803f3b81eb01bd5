"""The matmul-chain floor: a decode step's weight matmuls and nothing else.

Per layer qkv, o, gate_up and down, then lm_head: F.linear at batch B on the engine's own weights
(same dtype, same layout, no extra memory; FP8 weights: torch._scaled_mm on e4m3 inputs, their
quantization left out, summed as fp8_linear sums that dtype's outputs), captured as one CUDA graph and
replayed, so neither launch overhead nor attention, norms or sampling count. The engine's step time minus this is what
everything but the weight GEMMs costs. On the CPU (no graphs) the chain runs eagerly.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from fastllm.bench.ceilings import cuda_time_ms
from fastllm.kernels.fp8_linear import fast_accum
from fastllm.kernels.reference import FP8

logger = logging.getLogger(__name__)


def decode_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weight of every matmul of one decode step, in execution order."""
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
    weights.append(model.lm_head.weight)
    return weights


def make_chain(weights: list[torch.Tensor], batch_size: int, dtype: torch.dtype):
    """A function running x_in @ W^T for each weight, x_in a fixed random [B, in_features] input in the
    model's dtype (e4m3 for e4m3 weights, with unit row-wise scales: the FP8 GEMM's time)."""
    device = weights[-1].device
    inputs = {(w.shape[1], w.dtype): torch.randn(batch_size, w.shape[1], device=device, dtype=dtype)
              .to(w.dtype) for w in weights}
    ones = torch.ones(max(batch_size, max(w.shape[0] for w in weights)), device=device)

    def chain() -> None:
        for w in weights:
            x = inputs[(w.shape[1], w.dtype)]
            if w.dtype == FP8:
                torch._scaled_mm(x, w.t(), scale_a=ones[:batch_size, None], scale_b=ones[None, :w.shape[0]],
                                 out_dtype=dtype, use_fast_accum=fast_accum(dtype))
            else:
                F.linear(x, w)

    return chain


@torch.inference_mode()
def matmul_floor_ms(model: nn.Module, batch_size: int, repeats: int = 20) -> tuple[float, str]:
    """Median time of the chain in ms, and how it ran: "cuda-graph", "eager" (CPU, or capture failed)."""
    weights = decode_weights(model)
    chain = make_chain(weights, batch_size, model.dtype)
    if weights[0].device.type != "cuda":
        chain()
        times = []
        for _ in range(max(3, repeats // 4)):
            start = time.perf_counter()
            chain()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), "eager"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up cuBLAS off the capture stream
            for _ in range(2):
                chain()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        ms = cuda_time_ms(graph.replay, warmup=3, repeats=repeats)
        del graph
        return ms, "cuda-graph"
    except Exception as e:  # a capture failure must not cost the run its numbers
        logger.warning("CUDA-graph capture of the matmul chain failed (%s); timing it eagerly", e)
        return cuda_time_ms(chain, warmup=2, repeats=repeats), "eager"
