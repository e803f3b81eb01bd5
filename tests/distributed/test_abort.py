"""ProcessGroups.abort on the CPU, with stand-in groups: the one-shot flag goes up, every device group's
abort starts at once and none is waited for, and destroy_distributed joins them before tearing down.

On GPUs an abort first raises its communicator's flag, which ends its kernels, then frees memory, which
waits for the whole device: aborted one after another, a group whose kernel still spins would hold up the
first abort forever (tests/distributed/test_gpu_parallel.py kills a worker mid-step on two GPUs)."""

from __future__ import annotations

import threading

from fastllm.distributed import parallel_state
from fastllm.distributed.parallel_state import ParallelRank, ProcessGroups


class BlockingGroup:
    """A group whose abort waits for every stand-in group's abort (and the test) to start, then for the
    test's release."""

    def __init__(self, started: threading.Barrier, release: threading.Event, name: str, log: list):
        self.started, self.release, self.name, self.log = started, release, name, log

    def abort(self):
        self.started.wait(timeout=10)  # broken if the aborts ran one after another
        self.release.wait(timeout=10)
        self.log.append(self.name)


class FakeTP:
    def __init__(self, log):
        self.log = log

    def abort(self):
        self.log.append("one-shot flag")


def test_abort_raises_the_one_shot_flag_and_aborts_every_group_at_once(monkeypatch):
    monkeypatch.setattr(parallel_state, "_aborting", [])
    log: list[str] = []
    started, release = threading.Barrier(3), threading.Event()
    groups = ProcessGroups(ParallelRank.of(0, 2, 1), cpu=None, tp=FakeTP(log),
                           device=[BlockingGroup(started, release, name, log) for name in ("world", "tp")])
    groups.abort()  # returns while both aborts wait
    started.wait(timeout=10)
    assert log == ["one-shot flag"]
    release.set()
    parallel_state.destroy_distributed()  # joins them (no process group here to leave)
    assert sorted(log[1:]) == ["tp", "world"], log
    assert parallel_state._aborting == []
