"""The KV cache tensors (device pool and CPU swap pool) and the block copies between them.

The cache's dtype is the model's, or float8 e4m3 (kv_cache_dtype="fp8": half the bytes a block, so twice
the blocks in the same memory). Swaps and copy-on-write move an FP8 cache's bytes through uint8 views
(index copies have no float8 kernels)."""

from __future__ import annotations

import torch

MAX_SINGLE_COPIES = 4  # copy-on-write pairs copied one by one (each a launch) rather than by index


class CacheEngine:
    """One tensor per pool, [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim],
    so a swap or copy moves a block of every layer in one indexed copy."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, num_cpu_blocks: int = 0):
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: masked lanes of a kernel may read unwritten slots, and 0 * NaN is NaN.
        self.gpu = torch.zeros(shape, dtype=dtype, device=device)
        self.cpu = None
        if num_cpu_blocks:
            cpu_shape = (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
            self.cpu = torch.zeros(cpu_shape, dtype=dtype, pin_memory=device.type == "cuda")

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0], layer[1]) for layer in self.gpu]

    @staticmethod
    def _bytes(pool: torch.Tensor) -> torch.Tensor:
        """The pool as its copies move it: an FP8 pool's raw bytes, others as they are."""
        return pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block) pairs."""
        if pairs:
            src, dst = zip(*pairs)
            self._bytes(self.cpu)[:, :, list(dst)] = self._bytes(self.gpu)[:, :, list(src)].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block) pairs."""
        if pairs:
            src, dst = zip(*pairs)
            self._bytes(self.gpu)[:, :, list(dst)] = self._bytes(self.cpu)[:, :, list(src)].to(self.gpu.device,
                                                                                            non_blocking=True)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) device blocks, for copy-on-write. A few pairs (a beam search's step has up to its width)
        are copied one by one, a strided copy each; more, by one gather and one scatter on index tensors.
        (Indexing with Python lists sends each index from pageable memory, which waits for the device, and on
        the CPU walks the whole pool.)"""
        pool = self._bytes(self.gpu)
        if len(pairs) <= MAX_SINGLE_COPIES:
            for src, dst in pairs:
                pool[:, :, dst].copy_(pool[:, :, src])
        else:
            self.copy_indexed(*torch.tensor(pairs, dtype=torch.int64).T.to(pool.device, non_blocking=True))

    def copy_indexed(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Device block dst[i] = block src[i] (int64 index tensors on the device, so nothing waits for the host:
        run-ahead beam steps pick the source on the device). Every layer's K and V, as the bytes they are
        (an FP8 cache's per-layer scales apply to both blocks alike)."""
        pool = self._bytes(self.gpu)
        pool.index_copy_(2, dst, pool.index_select(2, src))
