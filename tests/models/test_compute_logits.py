"""compute_logits into a caller's buffer (what the decode CUDA graphs do) is the same GEMM as the
plain call: the same values bit for bit, written in place."""

from __future__ import annotations

import pytest
import torch

from fastllm.config import EngineConfig
from fastllm.models.loader import load_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@torch.inference_mode()  # as the runner calls it (out= does not take part in autograd)
def test_logits_into_a_buffer_equal_the_plain_call(device, dtype):
    model = load_model(EngineConfig.from_kwargs(None, dtype=dtype).model, torch.device(device))
    w = model.lm_head.weight
    hidden = torch.randn(5, w.shape[1], dtype=w.dtype, device=device)
    buf = torch.full((8, w.shape[0]), float("nan"), dtype=w.dtype, device=device)
    got = model.compute_logits(hidden, out=buf[:5])
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:5], model.compute_logits(hidden), rtol=0, atol=0)
    assert buf[5:].isnan().all()  # rows past the batch untouched
