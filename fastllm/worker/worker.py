"""Worker: one per device (rank, local_rank). Owns the model runner (this rank's shard of the model),
sizes and allocates the KV cache, and runs steps. On one device the engine drives it directly; with
several ranks executor.py drives one per rank."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import time

import torch

from fastllm.config import DEFAULT_SWAP_SPACE_GIB, EngineConfig
from fastllm.core.kv_cache_manager import MIN_SWAP_BLOCKS
from fastllm.core.scheduler_output import SchedulerOutput
from fastllm.distributed.parallel_state import ParallelRank
from fastllm.worker.async_output import AsyncRunnerOutput
from fastllm.worker.model_runner import ModelRunner
from fastllm.worker.streams import on_engine_stream

logger = logging.getLogger(__name__)

GiB = 1 << 30
# A profiled pool holds at most this many blocks, or what max_num_seqs requests hold at once if that is
# more: each block is a Python object of the block pool, and only a tiny model fits millions (stories260K:
# 13 million on an H200). A real model's block is >= ~200 KiB, so this many are >= ~48 GiB of KV.
PROFILED_POOL_BLOCKS = 1 << 18


def available_host_bytes() -> int:
    """Host memory a new allocation can take (Linux's MemAvailable; else the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(num_blocks: int, per_block: int, available: int, where: str, argument: str) -> None:
    """A KV pool that cannot be allocated is the argument's error, named before the allocation fails."""
    if num_blocks * per_block > available:
        raise ValueError(f"{argument}: {num_blocks} KV blocks of {per_block} bytes ({num_blocks * per_block / GiB:.2f} "
                         f"GiB) do not fit in the {available / GiB:.2f} GiB {where} has free")


def device_type(config: EngineConfig) -> str:
    """"cpu" or "cuda": the kind of device select_device picks (without making it current)."""
    return "cpu" if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()) \
        else "cuda"


def select_device(config: EngineConfig, local_rank: int) -> torch.device:
    if device_type(config) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA GPU is visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _on_engine_stream(method):
    """The Worker method with its device's engine stream current (streams.py): all of a Worker's GPU work
    runs there."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with on_engine_stream(self.device):
            return method(self, *args, **kwargs)
    return run


class Worker:
    def __init__(self, config: EngineConfig, parallel: ParallelRank = ParallelRank(), local_rank: int = 0):
        self.parallel, self.rank, self.local_rank = parallel, parallel.rank, local_rank
        self.device = select_device(config, local_rank)
        self.config = config = config.for_device(self.device)  # the engine takes this one
        # The same seed on every rank: tensor-parallel ranks draw the same unseeded samples.
        torch.manual_seed(config.model.seed)
        # Our custom ops import torch._dynamo at their first call: at startup, not in a request's first step
        # (the engine's process imports it already; a worker process did not, where no forward compiles).
        importlib.import_module("torch._dynamo")
        start = time.perf_counter()
        with on_engine_stream(self.device):
            self.runner = ModelRunner(config, self.device, parallel)
        # Startup phases in seconds (fastllm bench reports them): load, profile, kv_alloc, compile, cuda_graphs.
        self.timings: dict[str, float] = {"load": self._elapsed(start)}
        self.num_gpu_blocks = self.num_cpu_blocks = 0

    def _elapsed(self, start: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    @_on_engine_stream
    def determine_num_blocks(self) -> tuple[int, int]:
        """Device blocks: what fits under gpu_memory_utilization after the profiling run's peak, up to
        PROFILED_POOL_BLOCKS or what max_num_seqs requests can hold at once (GPU), or cpu_kv_cache_gib
        (CPU); an explicit num_gpu_blocks wins. CPU swap blocks from swap_space_gib. A pool that does not
        fit is a ValueError naming the argument that sized it."""
        cache = self.config.cache
        per_block = self.runner.kv_bytes_per_block()
        start = time.perf_counter()
        if cache.num_gpu_blocks is not None:
            num_blocks = cache.num_gpu_blocks
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.runner.profile_run()
            peak = torch.cuda.max_memory_allocated(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            non_torch = (total - free) - torch.cuda.memory_reserved(self.device)  # CUDA context, cuBLAS, NCCL
            available = total * cache.gpu_memory_utilization - peak - non_torch
            num_blocks = int(available // per_block)
            logger.info("profiling run: peak %.2f GiB, other %.2f GiB of %.2f GiB; KV cache %d blocks (%.2f GiB)",
                        peak / GiB, non_torch / GiB, total / GiB, num_blocks, num_blocks * per_block / GiB)
            most = max(self.config.most_blocks_in_use(), PROFILED_POOL_BLOCKS)
            if num_blocks > most:  # (a tiny model on a large GPU: millions of blocks, each a Python object)
                logger.info("KV cache: %d blocks, not all %d that fit: the more of %d and what "
                            "max_num_seqs (%d) requests hold at once (num_gpu_blocks allocates more)", most,
                            num_blocks, PROFILED_POOL_BLOCKS, self.config.scheduler.max_num_seqs)
                num_blocks = most
        else:
            num_blocks = int(cache.cpu_kv_cache_gib * GiB // per_block)
        if num_blocks < 2:
            sizer = "gpu_memory_utilization" if self.device.type == "cuda" else "cpu_kv_cache_gib"
            raise ValueError(f"no room for the KV cache ({num_blocks} blocks of {per_block} bytes); "
                             f"raise {sizer} or use a smaller model")
        if self.device.type == "cuda" and cache.num_gpu_blocks is not None:  # (profiled: sized to fit)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            check_fits(num_blocks, per_block, torch.cuda.mem_get_info(self.device)[0] + cached, "the GPU",
                       "num_gpu_blocks")
        elif self.device.type != "cuda":
            check_fits(num_blocks, per_block, available_host_bytes(), "the host",
                       "num_gpu_blocks" if cache.num_gpu_blocks is not None else "cpu_kv_cache_gib")
        num_cpu_blocks = 0
        if self.config.scheduler.preemption_mode == "swap":
            num_cpu_blocks = cache.num_cpu_blocks if cache.num_cpu_blocks is not None else \
                int((cache.swap_space_gib if cache.swap_space_gib is not None else DEFAULT_SWAP_SPACE_GIB) * GiB
                    // per_block)
            sizer = "num_cpu_blocks" if cache.num_cpu_blocks is not None else "swap_space_gib"
            if num_cpu_blocks < MIN_SWAP_BLOCKS:  # (no pool below it: every preemption would recompute)
                raise ValueError(f"{sizer} gives a CPU swap pool of {num_cpu_blocks} blocks of {per_block} "
                                 f"bytes, where preemption_mode='swap' needs at least {MIN_SWAP_BLOCKS}: "
                                 "raise it, or preempt by recompute (preemption_mode='recompute')")
            host = available_host_bytes() - (0 if self.device.type == "cuda" else num_blocks * per_block)
            check_fits(num_cpu_blocks, per_block, host, "the host", sizer)
        self.num_gpu_blocks, self.num_cpu_blocks = num_blocks, num_cpu_blocks
        self.timings["profile"] = self._elapsed(start)
        return num_blocks, num_cpu_blocks

    @_on_engine_stream
    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        start = time.perf_counter()
        self.runner.init_kv_cache(num_blocks, num_cpu_blocks)  # also compiles and captures CUDA graphs
        total = self._elapsed(start)
        graphs = self.runner.graphs
        self.timings["compile"] = self.runner.compile_seconds
        mixed = self.runner.mixed_graphs
        self.timings["cuda_graphs"] = (graphs.capture_seconds if graphs is not None else 0.0) \
            + (mixed.capture_seconds if mixed is not None else 0.0)
        self.timings["warm_up"] = self.runner.warmup_seconds
        self.timings["kv_alloc"] = max(0.0, total - self.timings["compile"] - self.timings["cuda_graphs"]
                                       - self.timings["warm_up"])

    def kv_cache_gib(self) -> float:
        return self.num_gpu_blocks * self.runner.kv_bytes_per_block() / GiB

    @_on_engine_stream
    def execute_model(self, sched: SchedulerOutput) -> AsyncRunnerOutput:
        return self.runner.execute_model(sched)

    @_on_engine_stream
    def step_costs(self) -> tuple[dict[int, float], dict[int, float]]:
        return self.runner.step_costs()

    @_on_engine_stream
    def release_graphs(self) -> None:
        self.runner.release_graphs()

    # On one device the Worker is the engine's executor (with several ranks: executor.MultiprocExecutor).

    @property
    def driver_worker(self) -> "Worker":
        return self

    def shutdown(self) -> None:
        """Nothing to end: no worker processes."""
