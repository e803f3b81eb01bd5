"""Kernel tests run natively on a GPU, or through Triton's interpreter on CPU tensors elsewhere
(the root conftest sets TRITON_INTERPRET=1 before anything imports triton)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def gen() -> torch.Generator:
    """CPU generator for index permutations."""
    return torch.Generator().manual_seed(1234)
