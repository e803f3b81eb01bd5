"""fastllm.kernels dispatch: which implementation runs, the FASTLLM_KERNELS switch, the one-time log."""

from __future__ import annotations

import importlib
import inspect
import logging

import pytest
import torch

import fastllm.kernels.dispatch as kernels
from fastllm.kernels import reference


@pytest.mark.parametrize("name", kernels.KERNEL_NAMES)
def test_same_signature_everywhere(name):
    ref = inspect.signature(kernels.reference_impl(name))
    assert list(inspect.signature(getattr(kernels, name)).parameters) == list(ref.parameters)
    assert list(inspect.signature(kernels.triton_impl(name)).parameters) == list(ref.parameters)
    assert kernels.reference_impl(name) is getattr(reference, name)


def test_importing_a_kernel_module_keeps_the_dispatcher():
    importlib.import_module("fastllm.kernels.silu_and_mul")
    from fastllm.kernels.silu_and_mul import bytes_moved  # noqa: F401  (the module is still importable)

    assert kernels.silu_and_mul.__module__ == "fastllm.kernels.dispatch"
    assert callable(kernels.silu_and_mul) and not isinstance(kernels.silu_and_mul, type(kernels))


def test_unknown_name():
    with pytest.raises(KeyError):
        kernels.triton_impl("flash_attention")


def test_cpu_runs_reference_and_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_chosen", {})
    monkeypatch.setattr(kernels, "_logged", set())
    x = torch.randn(3, 16)
    w = torch.randn(16)
    with caplog.at_level(logging.INFO, logger="fastllm.kernels"):
        for _ in range(3):
            out = kernels.rms_norm(x, w, 1e-6)
    assert torch.equal(out, reference.rms_norm(x, w, 1e-6))
    msgs = [r.getMessage() for r in caplog.records if r.name == "fastllm.kernels"]
    assert msgs == ["rms_norm: reference path (tensors on cpu)"]


def test_every_op_dispatches_on_cpu(monkeypatch):
    monkeypatch.setattr(kernels, "_chosen", {})
    x = torch.randn(4, 2, 8)
    kernels.rotary_embedding(torch.arange(4), x, x.clone(), torch.randn(8, 8))
    assert kernels.silu_and_mul(torch.randn(2, 8)).shape == (2, 4)
    out, res = kernels.fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), 1e-6)
    assert out.shape == res.shape == (2, 8)
    cache = torch.zeros(2, 4, 2, 8)
    kernels.kv_cache_write(x[:, :2], x[:, :2], cache, cache.clone(), torch.tensor([0, 5, -1, 7]))
    assert torch.equal(cache[1, 1], x[1, :2])
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    q = torch.randn(1, 4, 8)
    dec = kernels.paged_decode_attention(q, cache, cache, bt, torch.tensor([6], dtype=torch.int32), 8, 0.3)
    pre = kernels.prefill_attention(q, cache[1, 1:2], cache[1, 1:2], cache, cache, bt, torch.tensor([6], dtype=torch.int32),
                                    torch.tensor([0, 1], dtype=torch.int32), 1, 0.3)
    assert torch.allclose(dec, pre)
    assert all(fn.__module__ == "fastllm.kernels.reference" for fn in kernels._chosen.values())


def test_env_forces_reference(monkeypatch):
    try:
        monkeypatch.setenv("FASTLLM_KERNELS", "reference")
        importlib.reload(kernels)
        assert kernels._MODE == "reference"
        monkeypatch.setenv("FASTLLM_KERNELS", "bogus")
        with pytest.raises(ValueError, match="FASTLLM_KERNELS"):
            importlib.reload(kernels)
    finally:
        monkeypatch.delenv("FASTLLM_KERNELS")
        importlib.reload(kernels)
    assert kernels._MODE == "auto"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_runs_triton(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_chosen", {})
    monkeypatch.setattr(kernels, "_logged", set())
    x = torch.randn(3, 64, device="cuda", dtype=torch.float16)
    with caplog.at_level(logging.INFO, logger="fastllm.kernels"):
        kernels.silu_and_mul(x)
    assert kernels._chosen[("silu_and_mul", "cuda")] is kernels.triton_impl("silu_and_mul")
    # dispatch's own records: the kernel's first launch in a process also logs pdl.py's mode, once
    msgs = [r.getMessage() for r in caplog.records if r.name == "fastllm.kernels" and r.module == "dispatch"]
    assert msgs == ["silu_and_mul: triton path (tensors on cuda)"]
