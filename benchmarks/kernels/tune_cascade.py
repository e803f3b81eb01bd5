"""Time the decode cascade's launch choices at Llama-3-8B shapes (GPU only): the prefix kernel's split count
and the suffix kernel's tile and split count, against plain paged decode on the same data.

    python benchmarks/kernels/tune_cascade.py
    python benchmarks/kernels/tune_cascade.py --shapes 64x2048x128,64x2048x128+3 --bound 8192

Shapes are requests x shared prefix x own tokens, +L: the last L requests share nothing with the group
(another prompt of the same length), so their suffix is their whole context (bench_cascade_attention's
problem). Each shape is timed with the chosen launch, with
the prefix split twice as many ways, with each candidate suffix tile and suffix split count;
the host bounds are --bound (a CUDA graph's max_model_len), then the exact lengths. Last, the chosen launch
over the plan as a decode step's CUDA graph holds it (worker/cascade.py's CascadeGraphInputs: MAX_GROUPS group
columns, the unused ones empty, rows padded with -1, bounds at --bound), which is what the engine runs;
with lone requests, also with each of them a group of its own.
Times are kbench.steady_ms (CUDA-graph replays over input sets that span the L2), in us; the ratio is plain
decode's time over it. README's "Kernel choices" rows for the cascade come from here.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import kbench
import numpy as np
import torch
from bench_cascade_attention import shared_prefix_problem

import fastllm.kernels.cascade_attention as cascade_kernels
import fastllm.kernels.paged_decode_attention as decode_kernels
from fastllm.worker.cascade import MAX_GROUPS, CascadeGraphInputs, CascadePlan

SUFFIX_TILES = [(64, 4, 2), (16, 2, 2), (32, 2, 2), (64, 2, 2)]  # (block_n, num_warps, num_stages)
SUFFIX_SPLITS = [2, 4, 8]
SHAPES = "64x2048x128,64x2048x128+3,16x4096x512,128x2048x128,32x1024x256,8x2048x128,64x512x64"


class Shape(NamedTuple):
    batch: int
    prefix: int
    own: int
    lone: int = 0

    @classmethod
    def parse(cls, text: str) -> Shape:
        sizes, _, lone = text.partition("+")
        return cls(*(int(x) for x in sizes.split("x")), int(lone or 0))

    def __str__(self) -> str:
        return f"B{self.batch} x ({self.prefix} + {self.own})" + (f", {self.lone} alone" if self.lone else "")

    @property
    def max_suffix(self) -> int:  # a lone request attends its whole context
        return self.prefix + self.own if self.lone else self.own


def time_us(calls) -> float:
    return kbench.steady_ms(calls) * 1e3


def launches():
    """(name, patches) of each launch to time: the chosen one, then one change at a time."""
    chosen_splits = cascade_kernels.choose_num_splits
    yield "chosen", {}
    yield "prefix splits x2", {"splits": lambda *a, **k: 2 * chosen_splits(*a, **k)}
    for tile in SUFFIX_TILES:
        block_n, warps, stages = tile
        config = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
        yield f"suffix tile {tile}", {"config": config}
    for splits in SUFFIX_SPLITS:
        yield f"suffix splits {splits}", {"config": {"num_splits": splits}}


def _with(choose_config, fields: dict, *args, **kwargs):
    return choose_config(*args, **kwargs)._replace(**fields)


def graph_plan(shape: Shape, bound: int, lone_groups: bool = False) -> list:
    """The plan as a decode step's CUDA graph receives it: cascade_decode_attention's plan arguments from
    kv_start on, through the engine's own padding (CascadeGraphInputs.pack, then .metadata). lone_groups:
    each lone request is a group of its own (its prompt's blocks as its prefix, read by the prefix kernel)."""
    i32, grouped = np.int32, shape.batch - shape.lone
    singles = shape.lone if lone_groups else 0
    kv_start = np.array([shape.prefix] * (grouped + singles) + [0] * (shape.lone - singles), i32)
    row_start = np.array([0, grouped] + [grouped + 1 + i for i in range(singles)], i32)
    plan = CascadePlan(kv_start, row_start[:-1],
                       np.array([shape.prefix] * (1 + singles), i32), np.arange(grouped + singles, dtype=i32),
                       row_start, grouped, shape.prefix, shape.own if lone_groups else shape.max_suffix)
    inputs = CascadeGraphInputs(shape.batch, bound, torch.device(kbench.DEVICE))
    inputs.buffer.copy_(torch.from_numpy(inputs.pack(plan)))
    md = inputs.metadata(shape.batch)
    return [md.kv_start, md.prefix_rows, md.prefix_lens, md.rows, md.row_start, md.max_group_rows,
            md.max_prefix_len, md.max_suffix_len]


def run_shape(shape: Shape, bounds: list[int | None], graph_bound: int) -> list[str]:
    scale = kbench.HEAD_DIM**-0.5
    batch, prefix, own, lone = shape
    token_bytes = kbench.HKV * kbench.HEAD_DIM * 4  # K and V, bf16
    sets = kbench.input_sets(lambda: shared_prefix_problem(batch, prefix, own, lone),
                             lambda args: ((1 + lone) * prefix + batch * own) * token_bytes)
    plain = time_us([functools.partial(decode_kernels.paged_decode_attention, *args[:5], prefix + own, scale)
                     for args in sets])
    lines = [f"{shape}: plain paged decode {plain:.1f} us"]
    real_splits, real_config = cascade_kernels.choose_num_splits, decode_kernels.choose_config
    for bound in bounds:
        prefix_bound, suffix_bound = (bound, bound) if bound else (prefix, shape.max_suffix)
        for name, patch in launches():
            cascade_kernels.choose_num_splits = patch.get("splits", real_splits)
            if "config" in patch:
                decode_kernels.choose_config = functools.partial(_with, real_config, patch["config"])
            try:
                calls = [functools.partial(cascade_kernels.cascade_decode_attention, *args[:5], *args[5],
                                           batch, prefix_bound, suffix_bound, scale) for args in sets]
                t = time_us(calls)
                lines.append(f"  bound {bound or 'exact':>5}  {name:<28} {t:6.1f} us  {plain / t:5.2f}x")
            finally:
                cascade_kernels.choose_num_splits, decode_kernels.choose_config = real_splits, real_config
    for lone_groups in [False, True] if 0 < lone < MAX_GROUPS else [False]:
        plan = graph_plan(shape, graph_bound, lone_groups)
        t = time_us([functools.partial(cascade_kernels.cascade_decode_attention, *args[:5], *plan, scale)
                     for args in sets])
        name = "lone ones as groups of one" if lone_groups else "chosen"
        lines.append(f"  graph plan ({graph_bound})  {name:<28} {t:6.1f} us  {plain / t:5.2f}x")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SHAPES, help="requests x prefix x own[+lone], comma-separated")
    parser.add_argument("--bound", type=int, default=8192, help="the graphs' host bound (max_model_len)")
    args = parser.parse_args()
    import triton

    print(f"{torch.cuda.get_device_name(0)} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{kbench.num_sms()} SMs", flush=True)
    for text in args.shapes.split(","):
        print("\n".join(run_shape(Shape.parse(text), [args.bound, None], args.bound)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
