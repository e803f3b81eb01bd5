"""Startup runs of the compiled forward on steps too large for the mixed-step CUDA graphs.

Such steps (a burst of prompts, a long prompt's chunk) run the compiled forward, whose kernels are Triton
JIT kernels specialized per variant: the Triton prefill kernel under prefill_attention.TMA_MIN_TOKENS
tokens and Hopper's from there, and integer arguments that are or are not multiples of 16 (token counts;
block tables' widths are always, input_batch.aligned_tables). Each variant
first met inside a request's step compiles there (seconds, README's serving section), and every request
in flight waits. Hopper's kernel also takes 64- or 128-key tiles by the step's longest
query (prefill_attention_hopper.LONG_QUERY). These runs meet them at startup instead: for each size, a
step of two long prompts and one of short ones (SHORT_PROMPT tokens, as a burst of requests brings), no KV
written (slot -1).
"""

from __future__ import annotations

import logging
import time

import torch

from fastllm.kernels import dispatch as ops
from fastllm.kernels.paged_decode_attention import (compiled_variant, launch_config, table_bounds,
                                                     windowed_bound)
from fastllm.worker.attn_metadata import AttentionMetadata, forward_context
from fastllm.worker.input_batch import aligned_width

logger = logging.getLogger(__name__)

SHORT_PROMPT = 128  # tokens per request of the short-query warm-up steps (under LONG_QUERY)


def warm_up_sizes(graph_max_tokens: int, max_tokens: int) -> list[int]:
    """Token counts past the graphs' largest bucket, up to the step budget: the first counts past the
    graphs (odd and a multiple of 16) and, where the budget reaches it, the same around TMA_MIN_TOKENS and
    at the budget itself."""
    from fastllm.kernels.prefill_attention import TMA_MIN_TOKENS  # (imports Triton and Gluon: GPU engines only)

    sizes = set()
    for low in (graph_max_tokens + 1, TMA_MIN_TOKENS + 1, max_tokens - 1):
        sizes |= {low, -(-low // 16) * 16}
    sizes.add(max_tokens)
    return sorted(t for t in sizes if graph_max_tokens < t <= max_tokens)


def synthetic_prefill(num_tokens: int, num_seqs: int, max_model_len: int, max_blocks: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids, positions and metadata of num_seqs whole prompts of num_tokens tokens together that write
    nothing to the KV cache."""
    base, extra = divmod(num_tokens, num_seqs)
    lens = [base + (i < extra) for i in range(num_seqs)]
    assert max(lens) <= max_model_len, (lens, max_model_len)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    starts = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(num_seqs, aligned_width(max_blocks), dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), query_start_loc=starts,
        max_query_len=max(lens), max_seq_len=max(lens))
    return torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, metadata


@torch.inference_mode()
def warm_up_compiled_steps(forward, attention_layers, sizes: list[int], max_model_len: int, max_num_seqs: int,
                           max_blocks: int, device: torch.device) -> float:
    """Run forward once per size (see the module's docstring); returns the seconds it took."""
    start = time.perf_counter()
    for tokens in sizes:
        layouts = set()
        for prompt_len in (max_model_len, min(SHORT_PROMPT, max_model_len)):
            num_seqs = min(max_num_seqs, tokens, max(2, -(-tokens // prompt_len)))
            if -(-tokens // num_seqs) <= max_model_len:  # (else no schedule holds a step of `tokens`)
                layouts.add(num_seqs)
        for num_seqs in sorted(layouts):
            input_ids, positions, metadata = synthetic_prefill(tokens, num_seqs, max_model_len, max_blocks,
                                                               device)
            with forward_context(metadata, attention_layers):
                forward(input_ids, positions)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if sizes:
        logger.info("warmed up compiled steps of %s tokens in %.1f s", ", ".join(map(str, sizes)), seconds)
    return seconds


def decode_row_bounds(max_model_len: int, window: int | None) -> list[tuple[int, int | None]]:
    """(bound, window) launches of a layer's decode rows that meet every config the decode kernel's table
    gives a step whose longest request has up to max_model_len keys: a layer attends with its window only
    where the bound passes it (Attention.run), and the window then caps the bound (windowed_bound)."""
    if window is None or max_model_len <= window:
        return [(bound, None) for bound in table_bounds(max_model_len)]
    return [(bound, None) for bound in table_bounds(window)] + \
        [(max(window + 1, bound), window) for bound in table_bounds(windowed_bound(max_model_len, window))]


@torch.inference_mode()
def warm_up_decode_rows(attention_layers, max_rows: int, max_model_len: int, max_blocks: int,
                        dtype: torch.dtype, device: torch.device) -> float:
    """Launch the decode kernel over each kind of layer's cache once for every variant its table picks for
    up to max_rows decode rows under any bound (see the module's docstring), a key a row, nothing written;
    returns the seconds it took."""
    start, launches, seen = time.perf_counter(), 0, set()
    for layer in attention_layers:
        key_cache, value_cache = layer.kv_cache
        kind = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.sliding_window, key_cache.dtype)
        if kind in seen:
            continue
        seen.add(kind)
        variants = set()
        for bound, window in decode_row_bounds(max_model_len, layer.sliding_window):
            for rows in range(1, max_rows + 1):
                cfg = launch_config(windowed_bound(bound, window), rows, key_cache, dtype.itemsize)
                variant = (window is None, compiled_variant(cfg))
                if variant in variants:
                    continue
                variants.add(variant)
                query = torch.zeros(rows, layer.num_heads, layer.head_dim, dtype=dtype, device=device)
                tables = torch.zeros(rows, aligned_width(max_blocks), dtype=torch.int32, device=device)
                seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
                ops.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, bound,
                                           layer.scale, window, **layer.kv_scales)
                launches += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    logger.info("warmed up the decode kernel's variants for decode rows beside prompts: %d launches in "
                "%.1f s", launches, seconds)
    return seconds
