"""The KV cache tensors (device pool and CPU swap pool) and the block copies between them."""

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

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block) pairs."""
        if pairs:
            src, dst = zip(*pairs)
            self.cpu[:, :, list(dst)] = self.gpu[:, :, list(src)].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block) pairs."""
        if pairs:
            src, dst = zip(*pairs)
            self.gpu[:, :, list(dst)] = self.cpu[:, :, list(src)].to(self.gpu.device, non_blocking=True)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) device blocks, for copy-on-write. A few pairs (a beam search's step has up to its width)
        are copied one by one, a strided copy each; more, by one gather and one scatter on index tensors.
        (Indexing with Python lists sends each index from pageable memory, which waits for the device, and on
        the CPU walks the whole pool.)"""
        if len(pairs) <= MAX_SINGLE_COPIES:
            for src, dst in pairs:
                self.gpu[:, :, dst].copy_(self.gpu[:, :, src])
        else:
            src, dst = torch.tensor(pairs, dtype=torch.int64).T.to(self.gpu.device, non_blocking=True)
            self.gpu.index_copy_(2, dst, self.gpu.index_select(2, src))
