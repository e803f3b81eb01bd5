"""The persistent decoder's grid barrier alone: a cooperative launch of N barriers and nothing else, one
program a SM, against the same barrier spinning on plain volatile loads.

    python benchmarks/kernels/bench_grid_barrier.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastllm.kernels import sm_count  # noqa: E402
from fastllm.kernels.persistent_decoder import _arrive, _wait  # noqa: E402


@triton.jit
def _barriers(counter, n, VOLATILE_SPIN: tl.constexpr):
    nprog = tl.num_programs(0)
    for i in range(n):
        _arrive(counter)
        if VOLATILE_SPIN:
            seen = tl.load(counter, volatile=True)
            while seen < (i + 1) * nprog:
                seen = tl.load(counter, volatile=True)
            tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
        else:
            _wait(counter, (i + 1) * nprog)


def main() -> None:
    device = torch.device("cuda")
    programs = sm_count.num_sms(device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    print(f"# {torch.cuda.get_device_name(device)}, {programs} programs")
    print("| spin | warps | us a launch of 1 | us a barrier (1,400 a launch) |")
    print("|---|---:|---:|---:|")
    for volatile in (False, True):
        for warps in (4, 8):
            us = {}
            for n in (1, 1400):
                times = []
                for _ in range(6):
                    counter.zero_()
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    _barriers[(programs,)](counter, n, VOLATILE_SPIN=volatile, num_warps=warps,
                                           launch_cooperative_grid=True)
                    end.record()
                    end.synchronize()
                    times.append(begin.elapsed_time(end) * 1e3)
                us[n] = sorted(times)[len(times) // 2]
            print(f"| {'volatile loads' if volatile else 'atomics'} | {warps} | {us[1]:.1f} | "
                  f"{(us[1400] - us[1]) / 1399:.2f} |")


if __name__ == "__main__":
    main()
