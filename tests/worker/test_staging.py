"""StepInputStager: arrays packed into (pinned) host buffers come out on the device unchanged,
step after step, while the buffers alternate and grow."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastllm.worker.staging import StepInputStager

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_over_steps(device):
    stager = StepInputStager(torch.device(device))
    rng = np.random.default_rng(0)
    kept = []
    for step, n in enumerate([3, 1, 700, 5, 2000, 0, 9]):  # grows past the first buffers, and an empty array
        a64 = [rng.integers(-2**40, 2**40, n), rng.integers(0, 9, (2, n))]
        a32 = [rng.integers(-2**30, 2**30, (n, 3)).astype(np.int32), np.arange(n + 1, dtype=np.int32)]
        d64, d32 = stager.send(a64, a32)
        kept.append((a64, a32, d64, d32))
    if device == "cuda":
        torch.cuda.synchronize()
    for a64, a32, d64, d32 in kept:  # earlier steps' device tensors are not overwritten by later sends
        for a, d in zip(a64 + a32, d64 + d32):
            assert d.device.type == device and tuple(d.shape) == a.shape
            assert d.dtype == (torch.int64 if a.dtype == np.int64 else torch.int32)
            np.testing.assert_array_equal(d.cpu().numpy(), a)


@pytest.mark.parametrize("device", DEVICES)
def test_every_sent_array_starts_16_byte_aligned(device):
    """Triton compiles a kernel variant per pointer alignment: a view whose alignment followed the
    sizes of the arrays packed before it made steps JIT-compile new variants mid-serving."""
    stager = StepInputStager(torch.device(device))
    for n in [1, 3, 5, 7, 8, 13]:
        d64, d32 = stager.send([np.arange(n), np.arange(n + 1), np.arange(3)],
                               [np.arange(n, dtype=np.int32), np.ones((n, 3), np.int32), np.arange(2, dtype=np.int32)])
        for d in d64 + d32:
            assert d.data_ptr() % 16 == 0, (n, d.shape, d.dtype)
