"""The one-shot all-reduce (our kernel over symmetric memory) against NCCL's and torch's one-shot kernel,
at a decode step's message sizes.

    torchrun --nproc-per-node 2 benchmarks/bench_all_reduce.py --output-csv all_reduce_tp2.csv
    torchrun --nproc-per-node 4 benchmarks/bench_all_reduce.py

A decode step of B requests all-reduces [B, hidden] after every attention and MLP block: B x hidden x 2
bytes in bf16 (Llama-3.1-8B: hidden 4096, 70B: 8192). Each size is timed in the steady state of a
decode step's CUDA graph (fastllm/bench/all_reduce.py: 32 calls a graph, median of 5 replays), NCCL
and one-shot on the same tensors; the two sums are compared too (they may differ in the last bit:
they add the ranks in different orders). The last line is the limit to give FASTLLM_ONE_SHOT_MAX_BYTES:
the largest size up to which the one-shot kernel wins at every size.
"""

from __future__ import annotations

import argparse
import os
import sys

import pandas as pd
import torch
import torch.distributed as dist

from fastllm.bench import ceilings, report
from fastllm.bench.all_reduce import time_calls
from fastllm.distributed.one_shot import OneShotAllReduce, unavailable_reason

HIDDEN = {"8B": 4096, "70B": 8192}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def nccl_all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


def torch_one_shot(group_name: str, max_bytes: int, dtype: torch.dtype, device: torch.device):
    """torch's kernel (ours follows its protocol but counts barriers, and adds the abort flag), on a buffer
    and signal pads of its own; None if this torch has none."""
    import torch.distributed._symmetric_memory as symm_mem

    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return None
    buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
    symm_mem.rendezvous(buffer, group_name)

    def call(x: torch.Tensor) -> torch.Tensor:
        slot = buffer[:x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(slot, x, "sum", group_name)
    return call


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--output-csv", default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = sorted({rows * hidden * dtype.itemsize for hidden in HIDDEN.values() for rows in ROWS})
    reason = unavailable_reason(device, dtype, world)
    if reason is not None:
        print(f"rank {rank}: the one-shot all-reduce cannot run here: {reason}", file=sys.stderr)
        return 1
    one_shot = OneShotAllReduce(dist.group.WORLD, device, dtype, max(sizes))
    torch_kernel = torch_one_shot(one_shot.group_name, max(sizes), dtype, device)
    rows = []
    for size in sizes:
        x = torch.randn(size // dtype.itemsize, device=device).to(dtype) * (rank + 1)
        diff = (one_shot.all_reduce(x).float() - nccl_all_reduce(x).float()).abs().max().item()
        nccl_ms, one_shot_ms = time_calls(nccl_all_reduce, x), time_calls(one_shot.all_reduce, x)
        row = {"bytes": size,
               **{f"rows@{name}": size / (hidden * dtype.itemsize) for name, hidden in HIDDEN.items()},
               "nccl_us": nccl_ms * 1e3, "one_shot_us": one_shot_ms * 1e3, "speedup": nccl_ms / one_shot_ms,
               "max_abs_diff": diff}
        if torch_kernel is not None:
            torch_ms = time_calls(torch_kernel, x)
            theirs = torch_kernel(x).float() - one_shot.all_reduce(x).float()
            row.update(torch_one_shot_us=torch_ms * 1e3, vs_torch=torch_ms / one_shot_ms,
                       torch_diff=theirs.abs().max().item())
        rows.append(row)
    if rank == 0:
        frame = pd.DataFrame(rows)
        env = ceilings.environment(device)
        print(f"all-reduce, {world} ranks, {args.dtype}, on {env['device']} | torch {env['torch']} | "
              f"commit {env['commit']}")
        print(report.format_frame(frame))
        limit = 0
        for row in rows:
            if row["speedup"] <= 1.0:
                break
            limit = row["bytes"]
        print(f"one-shot wins up to {limit} bytes: FASTLLM_ONE_SHOT_MAX_BYTES={limit} for {world} ranks")
        if args.output_csv:
            frame.assign(world_size=world, dtype=args.dtype, device=env["device"], torch=env["torch"],
                         commit=env["commit"]).to_csv(args.output_csv, index=False)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
