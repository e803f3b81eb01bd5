"""The one-shot all-reduce for small messages: our kernel (kernels/one_shot_all_reduce.py) over torch's
symmetric memory.

Each rank copies its input into its slot of a buffer every rank of the group maps (CUDA IPC over
NVLink), the ranks meet at a barrier of signals, and each rank reads all the slots and sums them: one
kernel, no NCCL protocol or channel setup. Unlike torch's one_shot_all_reduce, its waits also read an
abort flag, which the worker monitor raises when a rank dies (abort()), so that rank 0 is not left
spinning on a dead peer's signal. For a decode step's [batch, hidden] messages (tens of KB) latency is
everything and this beats NCCL's ring; for large ones NCCL's bandwidth-optimal algorithms win, so
messages above max_bytes go to NCCL. benchmarks/bench_all_reduce.py measures both at decode sizes and
says where they cross; FASTLLM_ONE_SHOT_MAX_BYTES sets the limit (0 turns it off).

Every rank of the group must take the same path for the same call: the decision to enable it is agreed
across the ranks at startup, and the per-call choice depends only on the message size.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Messages up to this size take the one-shot kernel, by group size. Each rank reads (size - 1) peer
# buffers, so the traffic grows with the group: the limit shrinks as it grows. Two ranks: the crossover
# bench_all_reduce.py measured on two H200s (README's table); four and eight: guesses on the same scale,
# to be replaced by the crossover it finds on the target machine.
DEFAULT_MAX_BYTES = {2: 64 * 1024, 4: 32 * 1024, 8: 16 * 1024}
ENV_MAX_BYTES = "FASTLLM_ONE_SHOT_MAX_BYTES"

# The groups this process has rendezvoused symmetric memory on, by name. torch keeps a group's rendezvous
# store by name for the life of the process, and a later engine's process groups take the same names
# (counted from 0 again once the groups are gone): its ranks would meet on different stores and wait
# forever, so a later engine in this process all-reduces over NCCL. (Reloading a model into the same
# ranks, reuse_workers, keeps the group: it takes the one-shot path again.)
_rendezvoused: dict[str, dist.ProcessGroup] = {}


def max_one_shot_bytes(group_size: int) -> int:
    value = os.environ.get(ENV_MAX_BYTES)
    if value is not None:
        return int(value)
    return DEFAULT_MAX_BYTES.get(group_size, 0)


def unavailable_reason(device: torch.device, dtype: torch.dtype, group_size: int) -> str | None:
    """Why this rank cannot take part in the one-shot all-reduce, or None."""
    if device.type != "cuda":
        return f"device {device.type}"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"the kernel sums bfloat16 and float32 only, not {dtype}"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return f"torch {torch.__version__} has no symmetric memory"
    if not hasattr(symm_mem, "rendezvous"):
        return f"torch {torch.__version__} has no symmetric-memory rendezvous"
    local = torch.cuda.device_count()
    if int(os.environ.get("LOCAL_WORLD_SIZE", local)) < group_size:
        return "the group spans nodes (symmetric memory maps GPUs of one node)"
    if not all(torch.cuda.can_device_access_peer(device.index, d) for d in range(local) if d != device.index):
        return "no peer-to-peer access between the GPUs"
    return None


class OneShotAllReduce:
    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        from fastllm.kernels.one_shot_all_reduce import signal_pad_bytes

        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.dtype, self.max_bytes = dtype, max_bytes
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        # Collective: maps every rank's buffer and signal pad here.
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        _rendezvoused[self.group_name] = group
        if handle.signal_pad_size < signal_pad_bytes(handle.world_size):
            raise RuntimeError(f"symmetric memory's signal pads hold {handle.signal_pad_size} bytes, the "
                               f"one-shot kernel needs {signal_pad_bytes(handle.world_size)}")
        self.rank = handle.rank
        self.buffers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.pads = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        # Host memory the kernel reads (pinned, so mapped into the GPU's address space): raising it is a
        # plain host write, which needs no CUDA call while the device is busy.
        self.abort_flag = torch.zeros(1, dtype=torch.int32).pin_memory()

    @classmethod
    def create(cls, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
               cpu_group: dist.ProcessGroup) -> "OneShotAllReduce | None":
        """The one-shot all-reduce if every rank of the group can run it (agreed over cpu_group),
        else None; the log says which path the all-reduces take."""
        size = dist.get_world_size(group)
        max_bytes = max_one_shot_bytes(size)
        reason = unavailable_reason(device, dtype, size) if max_bytes > 0 else f"{ENV_MAX_BYTES}=0"
        if reason is None and _rendezvoused.get(group.group_name, group) is not group:
            reason = (f"an earlier engine of this process rendezvoused on group name {group.group_name!r}, "
                      "and torch keeps its store for the process")
        ok = torch.tensor([0 if reason else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
        if reason is None and not ok.item():
            reason = "another rank cannot run it"
        if reason is not None:
            logger.info("all-reduce: NCCL for every size (one-shot all-reduce off: %s)", reason)
            return None
        logger.info("all-reduce: one-shot over symmetric memory up to %d KiB, NCCL above", max_bytes // 1024)
        return cls(group, device, dtype, max_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        # The kernel's vector loads want 16-byte multiples (hidden sizes of real models are).
        return x.dtype == self.dtype and nbytes <= self.max_bytes and nbytes % 16 == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        from fastllm.kernels.one_shot_all_reduce import one_shot_all_reduce

        return one_shot_all_reduce(x, self.buffers, self.pads, self.abort_flag, self.rank)

    def abort(self) -> None:
        """Make every running and later call leave its waits (their results are garbage): a peer is gone."""
        self.abort_flag[0] = 1
