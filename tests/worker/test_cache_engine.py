"""CacheEngine.copy (copy-on-write): each destination block of every layer, K and V, becomes its source's,
whether the pairs are copied one by one (a beam step's few) or by index tensors (many); nothing else moves."""

from __future__ import annotations

import pytest
import torch

from fastllm.worker.cache_engine import MAX_SINGLE_COPIES, CacheEngine


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("num_pairs", [1, MAX_SINGLE_COPIES, MAX_SINGLE_COPIES + 3])
def test_copy_moves_each_destination_block_only(num_pairs, device):
    cache = CacheEngine(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32,
                        device=torch.device(device), num_blocks=2 * num_pairs + 5)
    cache.gpu.copy_(torch.randn_like(cache.gpu))
    before = cache.gpu.clone()
    pairs = [(2 * i + 1, 2 * i + 2) for i in range(num_pairs)]  # each source is no other pair's destination
    cache.copy(pairs)
    want = before.clone()
    for src, dst in pairs:
        want[:, :, dst] = before[:, :, src]
    assert torch.equal(cache.gpu, want)
