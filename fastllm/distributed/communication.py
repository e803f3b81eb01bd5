"""The collectives the sharded model calls.

The all-reduce after each row-parallel projection and the pipeline's send/recv are torch.library
custom ops, like our kernels (compile/custom_ops.py): torch.compile traces the whole forward with
them as opaque nodes (fullgraph, no breaks), and a decode step's CUDA graph captures the all-reduces
with everything else. Only a sharded model calls them: with one rank the layers skip them entirely.

The all-reduce is the one-shot kernel over symmetric memory for messages up to its size limit where it
is available (one_shot.py), NCCL (gloo on the CPU) otherwise; the choice is made per call by size, so a
captured graph holds the kernel of its own batch size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.13 renamed all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TensorParallelGroup:
    """One pipeline stage's tensor-parallel ranks."""

    def __init__(self, group: dist.ProcessGroup, size: int, device: torch.device):
        self.group, self.size, self.device = group, size, device
        self.one_shot = None  # a OneShotAllReduce once enable_one_shot() found it usable

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum over the group's ranks, out of place (bitwise the same result on every rank)."""
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot.all_reduce(x)
        out = x.contiguous().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, x: Tensor) -> Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape)

    def abort(self) -> None:
        """A peer is gone: one-shot calls waiting on it leave (NCCL's kernels leave when the groups abort)."""
        if self.one_shot is not None:
            self.one_shot.abort()

    def enable_one_shot(self, dtype: torch.dtype, cpu_group: dist.ProcessGroup) -> None:
        from fastllm.distributed.one_shot import OneShotAllReduce

        self.one_shot = OneShotAllReduce.create(self.group, self.device, dtype, cpu_group)


# This process's state while a multi-process engine runs.
_tp_group: TensorParallelGroup | None = None
_sending: tuple | None = None  # (work, tensor) of the last pp_send, until the next one


def set_tp_group(group: TensorParallelGroup | None) -> None:
    """Install (or, with None, drop) the groups of the engine starting (or ending) in this process."""
    global _tp_group, _sending
    _tp_group = group
    _sending = None


def get_tp_group() -> TensorParallelGroup:
    if _tp_group is None:
        raise RuntimeError("a tensor-parallel collective ran outside a multi-process engine")
    return _tp_group


@torch.library.custom_op("fastllm::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: Tensor) -> Tensor:
    return get_tp_group().all_reduce(x)


@tp_all_reduce.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("fastllm::pp_send", mutates_args=())
def pp_send(hidden: Tensor, residual: Tensor, dst: int) -> Tensor:
    """Hand a stage's output (hidden states and residual, [T, H] each) to the next stage, rank dst,
    without waiting for it to be received (gloo's send waits for the matching recv): the stage can
    go on to its next step, and an engine waiting on a silent next stage times out on its own terms.
    The send before must be done first (one in flight keeps the order and bounds the memory).
    Returns an empty tensor: the stage's forward returns it, so the send is never dead code."""
    global _sending
    if _sending is not None:
        _sending[0].wait()
    message = torch.stack((hidden, residual))
    _sending = dist.isend(message, dst), message
    return hidden.new_empty(0)


@pp_send.register_fake
def _(hidden, residual, dst):
    return hidden.new_empty(0)


@torch.library.custom_op("fastllm::pp_recv", mutates_args=())
def pp_recv(input_ids: Tensor, like: Tensor, src: int) -> Tensor:
    """The previous stage's (hidden states, residual) for this step's tokens, from rank src:
    [2, T, H] in like's dtype, H = like.shape[-1] (like: a [H] weight of the stage)."""
    out = like.new_empty((2, input_ids.shape[0], like.shape[-1]))
    dist.recv(out, src)
    return out


@pp_recv.register_fake
def _(input_ids, like, src):
    return like.new_empty((2, input_ids.shape[0], like.shape[-1]))
