"""The GPU tests' readers-writer lock (tests/gpu_lock.py) across processes, as pytest-xdist's workers hold it:
GPU tests share the card, a whole_gpu test runs alone, and a waiting one holds back the tests after it."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import time

from tests.gpu_lock import gpu_lock

CTX = mp.get_context("spawn")
WAIT_S = 30


def _holder(directory: str, exclusive: bool, asking, holding, release) -> None:
    asking.set()
    with gpu_lock(exclusive, directory):
        holding.set()
        release.wait(WAIT_S)


class Holder:
    """A process that asks for the lock, says when it holds it, and lets go when released."""

    def __init__(self, directory, exclusive: bool):
        self.asking, self.holding, self.release = CTX.Event(), CTX.Event(), CTX.Event()
        self.proc = CTX.Process(target=_holder, args=(str(directory), exclusive, self.asking, self.holding,
                                                      self.release))
        self.proc.start()
        assert self.asking.wait(WAIT_S)

    def done(self) -> None:
        self.release.set()
        self.proc.join(WAIT_S)
        assert self.proc.exitcode == 0


def _turnstile_taken(directory) -> bool:
    with open(os.path.join(directory, "fastllm-gpu-tests.turnstile"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_shared_holders_overlap_and_an_exclusive_one_waits_for_them(tmp_path):
    r1, r2 = Holder(tmp_path, False), Holder(tmp_path, False)
    assert r1.holding.wait(WAIT_S) and r2.holding.wait(WAIT_S), "two GPU tests should run side by side"
    w = Holder(tmp_path, True)
    time.sleep(0.3)
    assert not w.holding.is_set(), "a whole_gpu test ran beside others"
    r1.done()
    time.sleep(0.1)
    assert not w.holding.is_set(), "a whole_gpu test ran beside another"
    r2.done()
    assert w.holding.wait(WAIT_S)
    w.done()


def test_a_waiting_exclusive_holder_goes_before_later_shared_ones(tmp_path):
    r1 = Holder(tmp_path, False)
    assert r1.holding.wait(WAIT_S)
    w = Holder(tmp_path, True)
    deadline = time.monotonic() + WAIT_S
    while not _turnstile_taken(tmp_path):  # w waits for r1, holding the turnstile
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r2 = Holder(tmp_path, False)
    time.sleep(0.3)  # (r2 is inside gpu_lock by now)
    assert not r2.holding.is_set(), "a GPU test went ahead of the whole_gpu test waiting before it"
    r1.done()
    assert w.holding.wait(WAIT_S)
    time.sleep(0.1)
    assert not r2.holding.is_set(), "a GPU test ran beside a whole_gpu one"
    w.done()
    assert r2.holding.wait(WAIT_S)
    r2.done()
