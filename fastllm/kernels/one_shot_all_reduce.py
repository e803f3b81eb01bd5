"""The one-shot all-reduce: one kernel over buffers every rank of the group maps (torch's symmetric
memory, CUDA IPC over NVLink), whose waits also read an abort flag.

Each program (block b) copies its chunks of x into this rank's buffer, meets block b of every rank at a
barrier, sums every rank's chunks in rank order (the same bits on every rank), and meets them again, so
that no rank's next call overwrites its buffer while a peer still reads it. This is the protocol of
torch's one_shot_all_reduce, with two differences:
- a rank whose peer died spins at torch's barrier forever, wedging the GPU and the engine waiting on it.
  Here every spin also polls `abort` (an int32 in pinned host memory, which the engine's worker monitor
  sets with a plain host write), and leaves once it is non-zero: the result is then garbage, and the
  engine fails the step;
- the barriers count rather than flip flags (below), so a signal never waits for its slot to be consumed.

Signal pads hold counters: pads[target][b * WORLD + source] counts the barriers block b of the source
has reached (an add from the source, which never waits), pads[r][b * WORLD + r] those block b of rank r
has passed; a barrier waits for every peer's count to reach its own. The test oracle is
reference.all_reduce_sum (on the CPU the engine all-reduces over gloo, not through this kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PROGRAMS = 24  # (each program signals every peer twice a call: more programs, more signals)
ABORT_EVERY = 256  # spins between reads of the abort flag, which cross PCIe
# (largest message in bytes, elements a program moves per iteration, warps), from sweeps on two H200s
# (README, "Several GPUs"): up to 64 KB, wide blocks of 16 warps beat (1024, 4) (6.3 against 8.0 us at 64
# KB). Above 64 KB (NCCL's range at 2 ranks) configs of 32-64 programs of 2048 elements ran 1.3-1.8x faster
# than (1024, 4) in some processes and stalled ~0.4-1.8 ms a call in others (not explained), so they are
# not taken.
LAUNCH_CONFIGS = ((16 << 10, 1024, 4), (64 << 10, 4096, 16), (None, 1024, 4))


def launch_config(numel: int, element_size: int) -> tuple[int, int, int]:
    """(programs, BLOCK, warps) for a message of numel elements."""
    nbytes = numel * element_size
    block, warps = next((b, w) for limit, b, w in LAUNCH_CONFIGS if limit is None or nbytes <= limit)
    return min(MAX_PROGRAMS, triton.cdiv(numel, block)), block, warps


def signal_pad_bytes(world: int) -> int:
    """The signal pad the kernel needs on each rank."""
    return MAX_PROGRAMS * world * 4


@triton.jit
def _wait_for(ptr, epoch, abort_ptr, ABORT_EVERY: tl.constexpr):
    """Spin until the counter at ptr reaches epoch (wrapping int32 arithmetic), or *abort_ptr is set."""
    got = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while got - epoch < 0:
        got = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        spins += 1
        if spins % ABORT_EVERY == 0:
            if tl.load(abort_ptr, volatile=True) != 0:
                got = epoch


@triton.jit
def _barrier(pads, abort_ptr, block, rank, WORLD: tl.constexpr, ABORT_EVERY: tl.constexpr):
    """Block `block` of every rank meets here. Counters, not flags: a signal is a fire-and-forget add to
    the peer's pad, and nothing waits for a slot to be consumed."""
    tl.debug_barrier()  # every thread's stores before this block's signals (released at system scope)
    mine = tl.load(pads + rank).to(tl.pointer_type(tl.int32))
    epoch = tl.load(mine + block * WORLD + rank) + 1  # this block's own count of barriers passed
    for peer in tl.static_range(WORLD):
        if peer != rank:
            theirs = tl.load(pads + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_add(theirs + block * WORLD + rank, 1, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != rank:
            _wait_for(mine + block * WORLD + peer, epoch, abort_ptr, ABORT_EVERY)
    tl.debug_barrier()  # every thread has read the count and passed the waits
    tl.store(mine + block * WORLD + rank, epoch)


@triton.jit
def _one_shot_all_reduce_kernel(x_ptr, out_ptr, buffers, pads, abort_addr, numel, rank,
                                WORLD: tl.constexpr, BLOCK: tl.constexpr, ABORT_EVERY: tl.constexpr):
    block = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    dtype = x_ptr.dtype.element_ty
    abort_ptr = abort_addr.to(tl.pointer_type(tl.int32))
    # (Symmetric-memory buffers are page-aligned: the hint lets the loads and stores go 16 B wide.)
    mine = tl.multiple_of(tl.load(buffers + rank).to(tl.pointer_type(dtype)), 16)
    for start in range(block * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < numel
        tl.store(mine + offs, tl.load(x_ptr + offs, mask=ok), mask=ok)
    _barrier(pads, abort_ptr, block, rank, WORLD, ABORT_EVERY)
    for start in range(block * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):
            buf = tl.multiple_of(tl.load(buffers + peer).to(tl.pointer_type(dtype)), 16)
            acc += tl.load(buf + offs, mask=ok, other=0.0, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dtype), mask=ok)
    _barrier(pads, abort_ptr, block, rank, WORLD, ABORT_EVERY)


def one_shot_all_reduce(x: torch.Tensor, buffers: torch.Tensor, pads: torch.Tensor, abort: torch.Tensor,
                        rank: int) -> torch.Tensor:
    """The sum of x over the ranks. buffers / pads: int64 device tensors of every rank's buffer and signal
    pad address, as this process maps them (each buffer holds at least x.numel() elements of x.dtype,
    each pad signal_pad_bytes(world), zeroed once); abort: one int32 every spin polls."""
    x = x.contiguous()
    out = torch.empty_like(x)
    programs, block, warps = launch_config(x.numel(), x.element_size())
    _one_shot_all_reduce_kernel[(programs,)](x, out, buffers, pads, abort.data_ptr(), x.numel(), rank,
                                             WORLD=buffers.numel(), BLOCK=block, ABORT_EVERY=ABORT_EVERY,
                                             num_warps=warps)
    return out

