"""Where this process sits among the engine's ranks, and its torch.distributed groups.

The ranks form a grid of pp_size pipeline stages of tp_size tensor-parallel ranks each: global rank =
pp_rank * tp_size + tp_rank, so a stage's ranks are neighbours (on one node, adjacent GPUs). All ranks
join one default process group (NCCL on GPUs, gloo on the CPU). Each stage's ranks form a subgroup for
their all-reduces; stages hand their activations on point to point over the default group; a gloo group
carries the few host-side collectives (agreeing on the KV block count at startup).

torch.distributed has one default group per process, so a process holds one multi-process engine at a
time: a second one can start once the first has shut down.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fastllm.distributed.communication import TensorParallelGroup, set_tp_group

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelRank:
    """This process's place in the grid; the default (rank 0 of 1) is the single-device engine."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @classmethod
    def of(cls, rank: int, tp_size: int, pp_size: int) -> "ParallelRank":
        return cls(rank % tp_size, tp_size, rank // tp_size, pp_size)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_stage_rank(self) -> int:
        """The global rank this one receives its stage's input from (same TP rank, one stage up)."""
        return self.rank - self.tp_size

    @property
    def next_stage_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def is_output_rank(self) -> bool:
        """The rank whose sampled tokens the engine reads: TP rank 0 of the last stage (every rank of
        the last stage samples the same tokens from the same gathered logits)."""
        return self.is_last_stage and self.tp_rank == 0


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The decoder layers of one pipeline stage: contiguous and as even as possible, the earlier
    stages taking one more where they do not divide (5 layers on 2 stages: 3 + 2)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


@dataclass
class ProcessGroups:
    rank: ParallelRank
    cpu: dist.ProcessGroup  # gloo, for host-side collectives (the default group itself on the CPU)
    device: list[dist.ProcessGroup]  # the default group and this rank's tensor-parallel group
    tp: TensorParallelGroup | None = None  # the collectives over the tensor-parallel group (tp_size > 1)

    def abort(self) -> None:
        """Make the kernels of every collective whose peer is gone return: the one-shot all-reduce's flag
        goes up, and the device groups' communicators abort (NCCL; a gloo collective fails on its own when
        a peer's connection closes).

        The communicators abort all at once, each in a thread of its own, not waited for: an abort first
        raises its communicator's abort flag, which ends that communicator's kernels, and then frees its
        resources; a free waits for the whole device, where another group's kernel may still spin (and
        NCCL waits for the CUDA graphs that captured its collectives, which live until shutdown).
        destroy_distributed joins the threads."""
        if self.tp is not None:
            self.tp.abort()
        for group in self.device:
            thread = threading.Thread(target=_abort_group, args=(group,), name="fastllm-abort-group",
                                      daemon=True)
            thread.start()
            _aborting.append(thread)


_aborting: list[threading.Thread] = []  # ProcessGroups.abort's threads, joined before the groups go
ABORT_JOIN_S = 60.0


def _abort_group(group: dist.ProcessGroup) -> None:
    try:
        group.abort()
    except Exception as e:  # noqa: BLE001  (best effort: the timeout still ends the wait)
        logger.warning("could not abort a process group: %s", e)


def check_no_process_group() -> None:
    """Raise if this process holds a process group already (another multi-process engine's)."""
    if dist.is_initialized():
        raise RuntimeError("this process already holds a multi-process engine's process group: shut that "
                           "engine down (LLMEngine.shutdown()) before starting another")


def init_distributed(rank: ParallelRank, device: torch.device, init_method: str,
                     timeout_s: float) -> ProcessGroups:
    """Join the engine's default process group (every rank calls this) and build the subgroups."""
    check_no_process_group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra = {"device_id": device} if device.type == "cuda" else {}
    timeout = timedelta(seconds=timeout_s)  # (every group's: a new group does not take the default one's)
    dist.init_process_group(backend, init_method=init_method, rank=rank.rank, world_size=rank.world_size,
                            timeout=timeout, **extra)
    tp_group = None
    for stage in range(rank.pp_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(stage * rank.tp_size, (stage + 1) * rank.tp_size)), timeout=timeout)
        if stage == rank.pp_rank:
            tp_group = group
    cpu = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    tp = TensorParallelGroup(tp_group, rank.tp_size, device) if rank.tp_size > 1 else None
    set_tp_group(tp)
    logger.info("rank %d of %d (tensor-parallel rank %d of %d, pipeline stage %d of %d) joined over %s",
                rank.rank, rank.world_size, rank.tp_rank, rank.tp_size, rank.pp_rank, rank.pp_size, backend)
    return ProcessGroups(rank, cpu, [dist.group.WORLD, tp_group], tp)


def destroy_distributed() -> None:
    """Leave the engine's process groups, without waiting for the other ranks. The model's CUDA graphs
    must be gone first (Worker.release_graphs): NCCL waits for them.

    NCCL communicators are aborted, not finalized: the ranks leave one after another (rank 0 after its
    workers have exited), and abort never waits on a peer. Every step has finished by now: nothing in
    flight is lost. A gloo group's teardown is local already."""
    set_tp_group(None)
    while _aborting:
        thread = _aborting.pop()
        thread.join(timeout=ABORT_JOIN_S)
        if thread.is_alive():  # tearing the groups down under a running abort would free them twice
            logger.error("a process group's abort is still running after %.0f s: the groups are left to the "
                         "process's exit", ABORT_JOIN_S)
            _aborting.clear()
            return
    if dist.is_initialized():
        try:
            if dist.get_backend() == "nccl":
                dist.distributed_c10d._abort_process_group()  # every group, the gloo one included
            else:
                dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001  (an aborted group may refuse; the process goes on)
            logger.warning("leaving the process group: %s", e)
