"""The one-shot all-reduce kernel against the rank-order sum (reference.all_reduce_sum), and its abort flag.

On the CPU (TRITON_INTERPRET=1) the ranks' buffers and signal pads are ordinary (shared) memory: one rank
sums to itself; two ranks, each in a process of its own over shared memory (each maps the buffers at its
own addresses, as symmetric memory does), make several calls in a row and get the same sum, every block
counting two barriers a call; a rank whose peer never signals leaves once the flag goes up. The interpreter is sequentially
consistent, so this checks the protocol, not the fences: tests/distributed/test_gpu_parallel.py runs it
on two GPUs against NCCL. On one GPU: the abort flag in pinned host memory frees a spinning kernel.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from fastllm.kernels.one_shot_all_reduce import (
    MAX_PROGRAMS,
    launch_config,
    one_shot_all_reduce,
    signal_pad_bytes,
)
from fastllm.kernels.reference import all_reduce_sum

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def addresses(*tensors: torch.Tensor, device="cpu") -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def pad(world: int, device="cpu") -> torch.Tensor:
    return torch.zeros(signal_pad_bytes(world) // 4, dtype=torch.int32, device=device)


def barrier_counts(world: int, x: torch.Tensor, calls: int) -> torch.Tensor:
    """What a rank's pad holds after `calls` calls on x's size: two barriers a call, counted by each
    block that ran, from every rank (its own count included)."""
    want = torch.zeros(MAX_PROGRAMS, world, dtype=torch.int32)
    want[:launch_config(x.numel(), x.element_size())[0]] = 2 * calls
    return want.view(-1)


def test_launch_configs_by_message_size():
    """One program for a tiny message, the steps at 16 and 64 KB, and at most MAX_PROGRAMS."""
    assert launch_config(8, 2) == (1, 1024, 4)
    assert launch_config(8192, 2) == (8, 1024, 4)  # 16 KB
    assert launch_config(8193, 2) == (3, 4096, 16)
    assert launch_config(16384, 4) == (4, 4096, 16)  # 64 KB of float32
    assert launch_config(16385, 4) == (17, 1024, 4)
    assert launch_config(1 << 20, 2) == (MAX_PROGRAMS, 1024, 4)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [8, 1000, 3000, 30000, 40000])  # one program ... every program looping
def test_one_rank_sums_to_itself(numel, dtype):
    x = torch.randn(numel).to(dtype)
    buffer, pads, abort = torch.zeros(numel, dtype=dtype), pad(1), torch.zeros(1, dtype=torch.int32)
    for calls in (1, 2):
        out = one_shot_all_reduce(x, addresses(buffer), addresses(pads), abort, 0)
        assert torch.equal(out, x)
        assert torch.equal(pads, barrier_counts(1, x, calls))


def _rank(rank, world, buffers, pads, xs, results):
    abort = torch.zeros(1, dtype=torch.int32)
    outs = [one_shot_all_reduce(x[rank], addresses(*buffers), addresses(*pads), abort, rank) for x in xs]
    results.put((rank, [o.tolist() for o in outs]))  # (a tensor would go back as shared memory)


@interpreted
def test_two_ranks_in_two_processes_sum_alike():
    world, calls, numel = 2, 3, 3000
    buffers = [torch.zeros(numel).share_memory_() for _ in range(world)]
    pads = [pad(world).share_memory_() for _ in range(world)]
    xs = [[torch.randn(numel) for _ in range(world)] for _ in range(calls)]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, buffers, pads, xs, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        outs = dict(results.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for c in range(calls):
        want = all_reduce_sum(xs[c])
        assert all(torch.equal(torch.tensor(outs[r][c]), want) for r in range(world)), c
    assert all(torch.equal(p, barrier_counts(world, xs[0][0], calls)) for p in pads)


def _silent_peer(abort, done):
    world = 2
    buffers, pads = [torch.zeros(4096) for _ in range(world)], [pad(world) for _ in range(world)]
    one_shot_all_reduce(torch.randn(4096), addresses(*buffers), addresses(*pads), abort, 0)
    done.set()


@interpreted
def test_a_rank_whose_peer_is_silent_leaves_once_the_flag_goes_up():
    ctx = multiprocessing.get_context("spawn")
    abort, done = torch.zeros(1, dtype=torch.int32).share_memory_(), ctx.Event()
    proc = ctx.Process(target=_silent_peer, args=(abort, done))
    proc.start()
    try:
        assert not done.wait(timeout=5), "the kernel passed a barrier its peer never reached"
        abort.fill_(1)
        assert done.wait(timeout=120), "the kernel went on spinning with the abort flag up"
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_abort_flag_in_pinned_memory_frees_a_spinning_kernel():
    """A peer that never signals (its buffer and pad are this GPU's too): the kernel spins until the host
    raises the flag, then returns. One rank alone sums to itself first."""
    device = torch.device("cuda")
    x = torch.randn(3, 4096, device=device, dtype=torch.bfloat16)
    abort = torch.zeros(1, dtype=torch.int32).pin_memory()
    own, own_pad = torch.zeros(x.numel(), device=device, dtype=x.dtype), pad(1, device)
    assert torch.equal(one_shot_all_reduce(x, addresses(own, device=device), addresses(own_pad, device=device),
                                           abort, 0), x)
    buffers = [torch.zeros(x.numel(), device=device, dtype=x.dtype) for _ in range(2)]
    pads = [pad(2, device) for _ in range(2)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        one_shot_all_reduce(x, addresses(*buffers, device=device), addresses(*pads, device=device), abort, 0)
    finished = torch.cuda.Event()
    finished.record(stream)
    time.sleep(0.5)
    assert not finished.query(), "the kernel passed a barrier its peer never reached"
    abort[0] = 1  # a host write, as the worker monitor makes it
    deadline = time.monotonic() + 10
    while not finished.query():
        assert time.monotonic() < deadline, "the kernel went on spinning with the abort flag up"
        time.sleep(0.01)
