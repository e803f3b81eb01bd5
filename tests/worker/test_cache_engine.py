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


def test_copy_indexed_moves_every_layers_bytes_fp8_included():
    """Run-ahead beam steps copy partial blocks by device index tensors: every layer's K and V of each source
    block land in its destination, byte for byte (e4m3 too, through the uint8 view), and nothing else moves."""
    for dtype in (torch.float32, torch.float8_e4m3fn):
        cache = CacheEngine(2, 2, 4, 4, dtype, torch.device("cpu"), num_blocks=6)
        cache.gpu.view(torch.uint8).copy_(torch.randint(0, 120, cache.gpu.view(torch.uint8).shape, dtype=torch.uint8))
        before = cache.gpu.view(torch.uint8).clone()
        cache.copy_indexed(torch.tensor([1, 1, 4]), torch.tensor([2, 3, 5]))
        after = cache.gpu.view(torch.uint8)
        for src, dst in ((1, 2), (1, 3), (4, 5)):
            assert torch.equal(after[:, :, dst], before[:, :, src])
        assert torch.equal(after[:, :, [0, 1, 4]], before[:, :, [0, 1, 4]])
