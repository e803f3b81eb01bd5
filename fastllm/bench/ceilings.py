"""What a run ran on (device, versions, commit) and the GPU's measured ceilings: device-to-device
copy bandwidth (read + write bytes) and the bf16 matmul rate, each the median of timed repeats."""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """HEAD of the checkout fastllm runs from (+"-dirty" with local changes); FASTLLM_COMMIT when set
    (a copy of the tree without .git); else "unknown"."""
    if os.environ.get("FASTLLM_COMMIT"):
        return os.environ["FASTLLM_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0:
            return "unknown"
        # --no-optional-locks: a read-only look, no index refresh.
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "-uno"], cwd=REPO,
                               capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def environment(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # not installed, or broken
        triton_version = None
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "commit": git_commit(),
        "host": platform.node(),
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def cuda_time_ms(fn, warmup: int = 3, repeats: int = 20) -> float:
    """Median time of fn() in ms, each call between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings(device: torch.device, copy_gib: float = 1.0, matmul_n: int = 8192) -> dict:
    """Copy bandwidth and bf16 matmul rate on a CUDA device (a few seconds), stamped with the device."""
    if device.type != "cuda":
        raise ValueError("ceilings are measured on a CUDA GPU only")
    with torch.cuda.device(device):
        numel = int(copy_gib * (1 << 30))
        src = torch.empty(numel, dtype=torch.uint8, device=device).random_(0, 255)
        dst = torch.empty_like(src)
        copy_ms = cuda_time_ms(lambda: dst.copy_(src))
        copy_bytes = 2 * numel  # read + write
        del src, dst
        a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=device)
        b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=device)
        c = torch.empty_like(a)
        mm_ms = cuda_time_ms(lambda: torch.mm(a, b, out=c))
        del a, b, c
        torch.cuda.empty_cache()
    ceilings = {
        **environment(device),
        "copy_bytes": copy_bytes,
        "copy_ms": copy_ms,
        "copy_bytes_per_s": copy_bytes / (copy_ms / 1e3),
        "matmul_shape": [matmul_n, matmul_n, matmul_n],
        "matmul_dtype": "bfloat16",
        "matmul_ms": mm_ms,
        "matmul_flops_per_s": 2 * matmul_n ** 3 / (mm_ms / 1e3),
    }
    logger.info("ceilings on %s: copy %.0f GB/s, bf16 matmul %.0f TFLOP/s", ceilings["device"],
                ceilings["copy_bytes_per_s"] / 1e9, ceilings["matmul_flops_per_s"] / 1e12)
    return ceilings


def load_ceilings(path: str, device: torch.device) -> dict:
    try:
        ceilings = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read ceilings from {path}: {e}") from None
    missing = [k for k in ("copy_bytes_per_s", "matmul_flops_per_s") if not ceilings.get(k)]
    if missing:
        raise ValueError(f"ceilings file {path} lacks {', '.join(missing)}")
    here = device_name(device)
    if ceilings.get("device") != here:
        logger.warning("ceilings in %s were measured on %s, this run is on %s", path, ceilings.get("device"), here)
    return ceilings


def save_ceilings(ceilings: dict, path: str) -> None:
    Path(path).write_text(json.dumps(ceilings, indent=2) + "\n")
