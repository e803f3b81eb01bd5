"""The prefill kernel launched over a tile map (prefill_tiles.py: a grid fixed by the map's size, as the
CUDA graph of a mixed step replays it) against the plain launch (bit for bit) and the reference: spare
entries, padding requests (q_len 0) and padding tokens (rows of no request), GQA, head dims 64 and 128,
chunks over cached prefixes, decode rows beside prefill chunks, sliding windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastllm.kernels import reference_impl, triton_impl
from fastllm.kernels.prefill_tiles import build_tile_map, max_tiles, query_tile_size
from tests.kernels.kernel_testing import BF16, PagedKV, assert_close, gpu

TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 5e-2)}


class Step:
    """A flat batch of q_lens over seq_lens, then pad_reqs requests of no token and pad_tokens NaN rows of no
    request (a graph bucket's padding); its tile map has max_tiles(T, S) entries."""

    def __init__(self, device, gen, dtype, q_lens, seq_lens, hq, hkv, d, page, pad_reqs=0, pad_tokens=0):
        self.q_lens, self.seq_lens = list(q_lens) + [0] * pad_reqs, list(seq_lens) + [0] * pad_reqs
        num_blocks = sum(-(-n // page) for n in self.seq_lens) + 8
        self.kv = kv = PagedKV(self.seq_lens, num_blocks, page, hkv, d, dtype, device, gen)
        self.total = total = sum(q_lens)
        self.query = torch.randn(total + pad_tokens, hq, d, device=device).to(dtype)
        self.query[total:] = float("nan")
        self.key, self.value = kv.chunk_rows(self.q_lens, pad_tokens)
        self.qsl = torch.tensor(np.concatenate([[0], np.cumsum(self.q_lens)]), dtype=torch.int32,
                                device=device)
        self.block_q = query_tile_size(hq // hkv)
        size = max_tiles(total + pad_tokens, len(self.q_lens), self.block_q)
        self.tile_map = torch.from_numpy(build_tile_map(np.array(self.q_lens), np.array(self.seq_lens),
                                                        self.block_q, size)).to(device)
        self.scale = d ** -0.5

    def args(self):
        kv = self.kv
        return (self.query, self.key, self.value, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                self.qsl)

    def reference(self, window):
        k, v, table = self.kv.compact_float()
        n = self.total
        q, key, value = (x[:n].float() for x in (self.query, self.key, self.value))
        return reference_impl("prefill_attention")(q, key, value, k, v, table, self.kv.seq_lens, self.qsl,
                                                   max(self.q_lens), self.scale, window)


def _check(step: Step, dtype, window=None):
    launch = triton_impl("prefill_attention")
    plain = launch(*step.args(), max(step.q_lens), step.scale, window)
    # max_query_len is not read with a map: pass a bound no step has, as a graph does (its bucket)
    mapped = launch(*step.args(), step.query.shape[0], step.scale, window, None, False, step.tile_map)
    n = step.total
    assert torch.equal(mapped[:n], plain[:n]), "the tile-mapped launch differs from the plain one"
    assert_close(mapped[:n], step.reference(window), *TOL[dtype], what=f"q={step.q_lens} window={window}")


# (q_lens, seq_lens, Hq, Hkv, head_dim, block_size, padding requests, padding tokens)
CASES = [
    ([37], [37], 4, 4, 64, 16, 2, 5),  # plain prefill, MHA
    ([16, 17, 1], [16, 17, 1], 8, 2, 64, 16, 1, 0),  # block boundaries, GQA 4, a 1-token prompt
    ([20, 33], [100, 97], 8, 2, 128, 16, 3, 11),  # chunks over cached prefixes, head dim 128
    ([1, 0, 25, 1, 3], [50, 9, 25, 1, 40], 16, 2, 128, 32, 0, 2),  # decode rows, empty, prefill, GQA 8
    ([1, 1, 1, 40, 1], [64, 3, 90, 40, 17], 8, 2, 64, 16, 4, 20),  # decodes around a prompt (a mixed step)
    ([150, 1, 5], [220, 80, 5], 8, 2, 64, 16, 1, 9),  # several query tiles and unmasked key tiles
]


@pytest.mark.parametrize("q_lens,seq_lens,hq,hkv,d,page,pad_reqs,pad_tokens", CASES)
def test_tile_map_equals_plain_launch(device, gen, q_lens, seq_lens, hq, hkv, d, page, pad_reqs, pad_tokens):
    step = Step(device, gen, torch.float32, q_lens, seq_lens, hq, hkv, d, page, pad_reqs, pad_tokens)
    _check(step, torch.float32)


@pytest.mark.parametrize("window", [1, 17, 40])
def test_tile_map_with_a_window(device, gen, window):
    step = Step(device, gen, torch.float32, [20, 33, 1, 70], [100, 97, 60, 90], 8, 2, 64, 16, 2, 6)
    _check(step, torch.float32, window)


def test_spare_entries_return_at_once(device, gen):
    # a map far longer than the step's tiles (a large bucket, a small step): the rest are (-1, -1)
    step = Step(device, gen, torch.float32, [3, 1], [3, 12], 4, 2, 64, 16, pad_tokens=200)
    assert (step.tile_map[:, 0] >= 0).sum() == 2 and step.tile_map.shape[0] > 5
    _check(step, torch.float32)


def test_build_tile_map_covers_each_tile_once():
    rng = np.random.default_rng(0)
    for _ in range(50):
        q_lens = rng.integers(0, 100, rng.integers(1, 12))
        seq_lens = q_lens + rng.integers(0, 300, len(q_lens))
        block_q = int(rng.choice([1, 8, 16, 64]))
        size = max_tiles(int(q_lens.sum()), len(q_lens), block_q)
        tile_map = build_tile_map(q_lens, seq_lens, block_q, size)
        assert tile_map.shape == (size, 2) and tile_map.dtype == np.int32
        used = tile_map[tile_map[:, 0] >= 0]
        want = {(b, t) for b, q in enumerate(q_lens) for t in range(-(-q // block_q))}
        assert len(used) == len(want) and set(map(tuple, used.tolist())) == want
        assert (tile_map[len(used):] == -1).all()
        # the tiles whose rows see the most keys come first
        keys = [seq_lens[b] - q_lens[b] + min((t + 1) * block_q, q_lens[b]) for b, t in used.tolist()]
        assert keys == sorted(keys, reverse=True)


def test_max_tiles_bounds_every_split():
    # cdiv(T, BQ) + S holds however T tokens fall over S requests (each request's last tile is partial)
    rng = np.random.default_rng(1)
    for block_q in (1, 4, 16, 64):
        for _ in range(200):
            q_lens = rng.integers(1, 3 * block_q + 2, rng.integers(1, 20))
            assert (-(-q_lens // block_q)).sum() <= max_tiles(int(q_lens.sum()), len(q_lens), block_q)


def test_query_tile_size_is_the_kernels():
    from fastllm.kernels.prefill_attention import choose_config

    for group in (1, 2, 3, 4, 7, 8, 16, 64, 128):
        for d, dtype in ((64, torch.float32), (128, torch.bfloat16), (256, torch.float16)):
            assert query_tile_size(group) == choose_config(d, group, dtype).block_m // group


def test_tile_map_skips_the_hopper_kernel(monkeypatch, caplog):
    # with a tile map the Gluon kernel (whose grid follows the step) is never chosen, and the log says so once
    from types import SimpleNamespace

    import fastllm.kernels.prefill_attention as pa

    rows = SimpleNamespace(is_cuda=True, shape=(pa.TMA_MIN_TOKENS, 2, 64))  # a large step on an H100
    monkeypatch.setattr(pa, "_hopper_unsupported", lambda *args: None)
    monkeypatch.setattr(pa, "_logged", set())
    with caplog.at_level("INFO", logger="fastllm.kernels"):
        assert pa._use_hopper_kernel(rows, rows, rows, rows, rows, False, tile_map=False)
        assert not pa._use_hopper_kernel(rows, rows, rows, rows, rows, False, tile_map=True)
        assert not pa._use_hopper_kernel(rows, rows, rows, rows, rows, False, tile_map=True)
    assert sum("tile map" in r.message for r in caplog.records) == 1


# ---- on a real GPU ----

def _mixed_step(num_decodes, prompt_len, seed):
    g = torch.Generator().manual_seed(seed)
    contexts = torch.randint(1, 2048, (num_decodes,), generator=g).tolist()
    return [1] * num_decodes + [prompt_len], contexts + [prompt_len + 300]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("num_decodes,prompt_len", [(48, 128), (5, 500), (0, 256)])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 8, 64)])
def test_tile_map_gpu(device, gen, dtype, num_decodes, prompt_len, hq, hkv, d):
    q_lens, seq_lens = _mixed_step(num_decodes, prompt_len, num_decodes)
    step = Step(device, gen, dtype, q_lens, seq_lens, hq, hkv, d, 16, pad_reqs=7,
                pad_tokens=512 - sum(q_lens))
    _check(step, dtype)
    _check(step, dtype, window=100)


@gpu
def test_tile_map_replays_in_a_cuda_graph(device, gen):
    # one graph captured over static buffers replays for other mixes of requests written into them
    hq, hkv, d, page, tokens, reqs = 32, 8, 128, 16, 512, 64
    launch = triton_impl("prefill_attention")
    steps = [Step(device, gen, torch.bfloat16, *_mixed_step(n, p, n), hq, hkv, d, page)
             for n, p in ((48, 128), (10, 300), (63, 1), (0, 512))]
    kv_blocks = max(s.kv.key_cache.shape[0] for s in steps)
    width = max(s.kv.block_tables.shape[1] for s in steps)
    static = dict(query=torch.zeros(tokens, hq, d, device=device, dtype=torch.bfloat16),
                  key=torch.zeros(tokens, hkv, d, device=device, dtype=torch.bfloat16),
                  key_cache=torch.zeros(kv_blocks, page, hkv, d, device=device, dtype=torch.bfloat16),
                  table=torch.zeros(reqs, width, device=device, dtype=torch.int32),
                  seq_lens=torch.zeros(reqs, device=device, dtype=torch.int32),
                  qsl=torch.zeros(reqs + 1, device=device, dtype=torch.int32),
                  tile_map=torch.full((max_tiles(tokens, reqs, steps[0].block_q), 2), -1, device=device,
                                      dtype=torch.int32))
    static["value"] = torch.zeros_like(static["key"])
    static["value_cache"] = torch.zeros_like(static["key_cache"])

    def load(step):
        n, b = step.total, len(step.q_lens)
        for name, src in (("query", step.query), ("key", step.key), ("value", step.value)):
            static[name][:n] = src[:n]
        kv = step.kv
        blocks = kv.key_cache.shape[0]
        static["key_cache"][:blocks], static["value_cache"][:blocks] = kv.key_cache, kv.value_cache
        static["table"].zero_()[:b, :kv.block_tables.shape[1]] = kv.block_tables
        static["seq_lens"].zero_()[:b] = kv.seq_lens
        static["qsl"].fill_(n)[:b + 1] = step.qsl
        static["tile_map"].fill_(-1)[:step.tile_map.shape[0]] = step.tile_map

    def run():
        s = static
        return launch(s["query"], s["key"], s["value"], s["key_cache"], s["value_cache"], s["table"],
                      s["seq_lens"], s["qsl"], tokens, d ** -0.5, None, None, False, s["tile_map"])

    load(steps[0])
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step in steps:
        load(step)
        graph.replay()
        plain = launch(*step.args(), max(step.q_lens), step.scale)
        assert torch.equal(out[:step.total], plain[:step.total]), f"replay differs for q={step.q_lens[-3:]}"
