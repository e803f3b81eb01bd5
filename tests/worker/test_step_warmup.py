"""step_warmup: the sizes past the mixed-step graphs, and synthetic prefills that run and write no KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastllm import LLM
from fastllm.kernels.paged_decode_attention import (compiled_variant, launch_config, table_bounds,
                                                     windowed_bound)
from fastllm.kernels.prefill_attention import TMA_MIN_TOKENS
from fastllm.kernels.prefill_attention_hopper import LONG_QUERY
from fastllm.kernels.reference import FP8
from fastllm.worker.input_batch import TABLE_WIDTH_ALIGN, aligned_tables
from fastllm.worker.step_warmup import (SHORT_PROMPT, decode_row_bounds, synthetic_prefill,
                                       warm_up_compiled_steps, warm_up_decode_rows, warm_up_sizes)
from tests.conftest import STORIES


def test_sizes_cover_both_prefill_kernels_and_both_alignments():
    sizes = warm_up_sizes(512, 8192)
    assert sizes == [513, 528, TMA_MIN_TOKENS + 1, TMA_MIN_TOKENS + 16, 8191, 8192]
    assert warm_up_sizes(512, 512) == []  # every step fits a graph
    assert warm_up_sizes(0, 100) == [1, 16, 99, 100]  # no mixed graphs (mixed_cuda_graph_max_tokens=0)
    assert warm_up_sizes(512, 1000) == [513, 528, 999, 1000]


def test_synthetic_prefill_layout():
    ids, positions, md = synthetic_prefill(11, 3, 8, 4, torch.device("cpu"))
    assert ids.shape == positions.shape == md.slot_mapping.shape == (11,)
    assert md.seq_lens.tolist() == [4, 4, 3] and md.query_start_loc.tolist() == [0, 4, 8, 11]
    assert positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert (md.slot_mapping == -1).all() and md.block_tables.shape == (3, 16)  # aligned, as a step's
    assert (md.max_query_len, md.max_seq_len) == (4, 4)


def test_warm_up_runs_the_forward_and_writes_no_kv():
    llm = LLM(STORIES, device="cpu", enforce_eager=True, cpu_kv_cache_gib=0.01)
    runner = llm.engine.worker.runner
    before = runner.cache.gpu.clone()
    calls = []

    def forward(input_ids, positions):
        calls.append(len(input_ids))
        return runner.forward(input_ids, positions)

    max_blocks = -(-llm.engine.config.model.max_model_len // runner.block_size)
    warm_up_compiled_steps(forward, runner.attention_layers, [33, 300], llm.engine.config.model.max_model_len,
                           4, max_blocks, torch.device("cpu"))
    assert calls == [33, 300, 300]  # 300 tokens: two long prompts and three short ones
    calls.clear()
    warm_up_compiled_steps(forward, runner.attention_layers, [1, 33, 300], 64, 4, max_blocks, torch.device("cpu"))
    # one prompt of 1 token; two of 16-17 (both layouts alike when prompts are short); no step of 300 tokens
    # holds in four prompts of at most 64
    assert calls == [1, 33]
    assert LONG_QUERY > SHORT_PROMPT
    assert torch.equal(runner.cache.gpu, before)


def test_step_tables_are_padded_to_aligned_widths():
    tables = np.arange(6, dtype=np.int32).reshape(2, 3)
    padded = aligned_tables(tables)
    assert padded.shape == (2, TABLE_WIDTH_ALIGN) and (padded[:, :3] == tables).all() and not padded[:, 3:].any()
    wide = np.ones((1, 32), dtype=np.int32)
    assert aligned_tables(wide) is wide
    assert aligned_tables(np.ones((3, 17), dtype=np.int32)).shape == (3, 32)


def test_compiled_steps_send_aligned_tables(monkeypatch):
    """A prefill step outside the graphs (here: eager) gets a block table of an aligned width, and the
    tokens are those of an engine whose tables are not padded."""
    import fastllm.worker.input_batch as input_batch
    from fastllm import SamplingParams

    seen = []
    forward_metadata = input_batch.AttentionMetadata

    def record(*args, **kwargs):
        seen.append(kwargs["block_tables"].shape[1])
        return forward_metadata(*args, **kwargs)

    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["Once upon a time", "The little dog ran to the park and saw a big red ball"]
    llm = LLM(STORIES, device="cpu", enforce_eager=True, cpu_kv_cache_gib=0.01)
    monkeypatch.setattr(input_batch, "AttentionMetadata", record)
    padded = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert seen and all(w % TABLE_WIDTH_ALIGN == 0 for w in seen)
    monkeypatch.setattr(input_batch, "aligned_tables", lambda tables: tables)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert padded == plain
    llm.engine.check_kv_pool_whole()


def _variants(key_cache, launches, max_rows):
    """The kernel variants (a window or not, compiled_variant) that launches of 1..max_rows rows give."""
    variants = set()
    for bound, window in launches:
        for rows in range(1, max_rows + 1):
            cfg = launch_config(windowed_bound(bound, window), rows, key_cache, 2)
            variants.add((window is None, compiled_variant(cfg)))
    return variants


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("window", [None, 300, 2100])
def test_decode_row_bounds_meet_every_variant_of_the_table(cache_dtype, window):
    """Every bound up to max_model_len, with the layer's rule for its window (Attention.run: the window
    applies only past it), gives no kernel variant that decode_row_bounds' few launches miss; on the
    interpreter's 4 SMs 16 rows of 4 KV heads reach each of the table's regimes (16 programs a SM)."""
    key_cache = torch.empty(1, 16, 4, 128, dtype=cache_dtype)
    max_model_len = 2400
    every = [(bound, window if window is not None and bound > window else None)
             for bound in range(1, max_model_len + 1)]
    few = decode_row_bounds(max_model_len, window)
    assert len(few) < 45
    assert _variants(key_cache, few, 16) == _variants(key_cache, every, 16)


def test_table_bounds_stop_where_the_table_does():
    bounds = table_bounds(131072)
    assert bounds[:3] == [1, 128, 256] and bounds[-1] == 131072 and len(bounds) < 135
    key_cache = torch.empty(1, 16, 4, 128, dtype=FP8)
    far = [(bound, None) for bound in range(bounds[-2], 131073, 997)]
    assert _variants(key_cache, far, 16) <= _variants(key_cache, [(b, None) for b in bounds], 16)


def test_decode_row_warm_up_writes_no_kv():
    llm = LLM(STORIES, device="cpu", enforce_eager=True, cpu_kv_cache_gib=0.01)
    runner = llm.engine.worker.runner
    before = runner.cache.gpu.clone()
    max_blocks = -(-llm.engine.config.model.max_model_len // runner.block_size)
    warm_up_decode_rows(runner.attention_layers, 8, llm.engine.config.model.max_model_len, max_blocks,
                        torch.float32, torch.device("cpu"))
    assert torch.equal(runner.cache.gpu, before)
