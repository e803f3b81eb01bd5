"""Triton argmax vs torch.argmax: exact indices, the first index among tied maxima, both passes.

Rows are random, then given planted ties: the maximum repeated at a later column of the same chunk,
of a later chunk, and of the last (partial) chunk, so a kernel that kept the last occurrence, or the
first chunk's value rather than its index, fails.
"""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import reference_impl, triton_impl
from fastllm.kernels.argmax import _BLOCK
from tests.kernels.kernel_testing import HAS_CUDA, gpu


def _plant_ties(x: torch.Tensor, gen: torch.Generator) -> None:
    """In every other row, copy a value above the row's max to a few columns, first one random."""
    batch, n = x.shape
    for b in range(0, batch, 2):
        cols = torch.randint(0, n, (3,), generator=gen).tolist() + [n - 1]
        x[b, cols] = x[b].max() + 1


def _check(x: torch.Tensor) -> None:
    ref = reference_impl("argmax")(x)
    got = triton_impl("argmax")(x)
    assert got.dtype == torch.int64 and got.shape == ref.shape
    assert torch.equal(got.cpu(), ref.cpu()), (got.cpu()[got != ref].tolist(), ref.cpu()[got != ref].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,n_cols", [(1, 1), (1, 7), (3, _BLOCK), (1, _BLOCK + 1), (2, 5000), (17, 3000)])
def test_argmax_matches_torch(device, gen, dtype, batch, n_cols):
    x = torch.randn(batch, n_cols, generator=gen).to(device=device, dtype=dtype)
    _plant_ties(x, gen)
    _check(x)


def test_argmax_strided_rows_and_out(device, gen):
    """Rows of a wider buffer (the logits are a view of a static buffer), written into a slice of `out`."""
    buf = torch.randn(4, 3000, generator=gen).half().to(device)
    logits = buf[:3, :2500]
    out = torch.full((6,), -7, dtype=torch.int64, device=device)
    got = triton_impl("argmax")(logits, out=out[:3])
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out[:3].cpu(), logits.cpu().argmax(-1))
    assert (out[3:] == -7).all(), "wrote past its rows"


def test_argmax_ties_within_a_lane(device):
    """One chunk per row (parts = 1 at this batch), maxima a whole BLOCK apart: the same lane sees them in
    consecutive steps and must keep the first. Others sit on chunk-step edges (first and last column)."""
    batch, n = 17, 3 * _BLOCK
    x = torch.randn(batch, n, device=device)
    top = x.max() + 1
    x[0, [5, 5 + _BLOCK, 5 + 2 * _BLOCK]] = top  # lane 5, three steps
    x[1, [_BLOCK - 1, 2 * _BLOCK - 1]] = top  # the last lane of two steps
    x[2, [0, n - 1]] = top  # the first and the last column
    x[3, n - 1] = top  # only the last column
    got = triton_impl("argmax")(x)
    assert got[:4].tolist() == [5, _BLOCK - 1, 0, n - 1]
    assert torch.equal(got.cpu(), x.cpu().argmax(-1))


def test_argmax_special_values(device):
    n = 2 * _BLOCK + 100
    x = torch.full((4, n), float("-inf"), device=device)  # row 0: all -inf -> column 0, as torch
    x[1, 1500] = float("nan")  # row 1: a NaN is the maximum (counted as +inf: torch ranks it above +inf)
    x[2, 300], x[2, 1800] = float("inf"), float("inf")  # row 2: the first +inf
    x[3, n - 1] = -1e30  # row 3: the only finite value, in the last chunk
    assert triton_impl("argmax")(x).tolist() == [0, 1500, 300, n - 1]


@gpu
@pytest.mark.parametrize("batch", [1, 8, 33, 256, 512])
def test_argmax_vocab_sizes_gpu(batch):
    gen = torch.Generator().manual_seed(batch)
    for vocab in (32000, 128256, 151936):
        x = torch.randn(batch, vocab, generator=gen).to("cuda", torch.bfloat16)
        _plant_ties(x, gen)
        _check(x)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_argmax_in_cuda_graph():
    """Replays read the current logits (no value baked in at capture)."""
    x = torch.randn(8, 128256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(8, dtype=torch.int64, device="cuda")
    triton_impl("argmax")(x, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_impl("argmax")(x, out=out)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, x.argmax(-1))
