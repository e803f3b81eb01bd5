"""interrupt_after_step: a first Ctrl-C during a multi-process engine's step raises when the step ends, a
second at once, and one that came before the step failed is not lost in the failure."""

from __future__ import annotations

import os
import signal

import pytest

from fastllm.engine.interrupts import interrupt_after_step
from tests.conftest import python_sigint_handler


@pytest.fixture(autouse=True)
def sigint_raises():
    with python_sigint_handler():
        yield


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_raises_once_the_block_is_done():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupt_after_step():
            ctrl_c()
            done.append("the rest of the step")
    assert done == ["the rest of the step"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_raises_at_once():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupt_after_step():
            ctrl_c()
            ctrl_c()
            done.append("the rest of the step")
    assert not done and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_before_the_block_fails_still_raises_with_the_failure_as_its_context():
    """It was dropped: the block's error went up alone, and the user's Ctrl-C did nothing."""
    with pytest.raises(KeyboardInterrupt) as raised:
        with interrupt_after_step():
            ctrl_c()
            raise RuntimeError("the step failed")
    assert isinstance(raised.value.__context__, RuntimeError)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_a_ctrl_c_the_block_and_its_errors_are_untouched():
    with pytest.raises(RuntimeError, match="the step failed"):
        with interrupt_after_step():
            raise RuntimeError("the step failed")
    with interrupt_after_step():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
