"""Programmatic dependent launch (pdl.py): on a Hopper GPU the decode-step kernels launch with PDL, and
inside a CUDA graph, each right after the GEMM that writes its input (as in a decode step), they give
bit-for-bit what they give launched plainly. A kernel that read its input before gdc_wait would race
with the GEMM; a large GEMM output keeps that window wide, and the graph is replayed many times."""

from __future__ import annotations

import pytest
import torch

from fastllm.kernels import pdl
from tests.kernels.kernel_testing import gpu


def _graph_outputs(fn, inputs, replays=20):
    """fn(inputs) captured once, replayed `replays` times on fresh inputs; every replay's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*inputs)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*inputs)
    outs = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(replays):
        for x in inputs:
            x.normal_(generator=gen)
        graph.replay()
        outs.append(tuple(o.clone() for o in (out if isinstance(out, tuple) else (out,))))
    return outs


def _cases():
    from fastllm.kernels import triton_impl

    hidden, inter, vocab = 4096, 14336, 32000
    w_norm = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)

    def norm(a, b, r):
        return triton_impl("fused_add_rms_norm")(a @ b, r, w_norm, 1e-5)

    def silu(a, b):
        return triton_impl("silu_and_mul")(a @ b)

    def argmax(a, b):
        return triton_impl("argmax")(a @ b)

    def mk(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    w_out = torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16)

    def linear(a, b):  # skinny_linear after the GEMM that writes its input
        return triton_impl("linear")(a @ b, w_out, None)

    heads, kv_heads, head_dim, page = 32, 8, 128, 16
    cos_sin = torch.randn(4096, head_dim, device="cuda")
    caches = torch.zeros(2, 64, page, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(100, 140, device="cuda")
    slots = torch.randperm(64 * page, device="cuda")[:40]

    def rotary_kv_write(a, b):  # a verify's 40 token rows: the qkv projection, then their rotary and KV write
        q, k, v = (a @ b).view(40, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], 1)
        write = triton_impl("rotary_kv_cache_write")
        q_out, _, _ = write(positions, q, k, v, cos_sin, True, caches[0], caches[1], slots, False)
        return q_out, caches

    return {"fused_add_rms_norm": (norm, (mk(64, 4096), mk(4096, hidden), mk(64, hidden))),
            "rotary_kv_cache_write": (rotary_kv_write,
                                      (mk(40, 4096), mk(4096, (heads + 2 * kv_heads) * head_dim))),
            "linear": (linear, (mk(8, 4096), mk(4096, hidden))),
            "silu_and_mul": (silu, (mk(64, 4096), mk(4096, 2 * inter))),
            "argmax": (argmax, (mk(32, 4096), mk(4096, vocab)))}


@gpu
@pytest.mark.parametrize("name", ["fused_add_rms_norm", "silu_and_mul", "argmax", "linear",
                                  "rotary_kv_cache_write"])
@pytest.mark.parametrize("setting", ["1", "trigger"])
def test_pdl_kernels_equal_plain_launch(device, name, setting, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or newer")
    monkeypatch.setenv("FASTLLM_PDL", setting)
    pdl._mode.cache_clear()
    assert pdl.launch_options(torch.device("cuda"))["USE_PDL"] == (2 if setting == "trigger" else 1)
    fn, inputs = _cases()[name]
    with_pdl = _graph_outputs(fn, inputs)
    monkeypatch.setenv("FASTLLM_PDL", "0")
    pdl._mode.cache_clear()
    plain = _graph_outputs(fn, inputs)
    for a, b in zip(with_pdl, plain):
        for x, y in zip(a, b):
            assert torch.equal(x, y), name


@pytest.fixture(autouse=True)
def _fresh_mode():
    yield
    pdl._mode.cache_clear()  # the next test reads FASTLLM_PDL as it is then
