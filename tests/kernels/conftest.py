"""Kernel tests run natively on a GPU, or through Triton's interpreter on CPU tensors elsewhere.

TRITON_INTERPRET is read when a function is decorated with @triton.jit, i.e. when its module is
imported. Our kernel modules are imported lazily, after this file. triton.language's own @jit helpers
(tl.sum, tl.max, tl.cdiv, ...) are decorated when triton is first imported, which in a whole-suite run
can happen before this file is loaded (collecting tests/compile imports torch._dynamo, which imports
triton). Setting TRITON_INTERPRET=1 before pytest starts (or at the top of tests/conftest.py) avoids
that; otherwise _interpreter_fixup() rebuilds those helpers in interpreter mode.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch


def _interpreter_fixup() -> None:
    """Re-decorate triton.language's @jit helpers if triton was imported before TRITON_INTERPRET was set."""
    if "triton.language" not in sys.modules:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.sum, InterpretedFunction):
        return
    for name in ("triton.language.standard", "triton.language.random"):
        module = importlib.reload(sys.modules[name])  # its @jit now yields InterpretedFunctions
        for attr, value in vars(module).items():
            if isinstance(value, InterpretedFunction) and hasattr(tl, attr):
                setattr(tl, attr, value)


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        _interpreter_fixup()


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
