"""Attention over the paged KV cache: the single call site of the attention kernels.

The layer owns the rotary embedding. A decode step is one kernel: rotary, the cache write of the new
k and v, and attention over the cache plus the new token. A prefill or mixed step rotates q and k and
writes the cache in one kernel, then attends over the cached prefix and the rotated chunk (a speculative
step's few tokens per request: after their writes, each token as a decode row, metadata.token_rows; a mixed
step's leading decodes through the decode kernel beside it, metadata.decode_rows). A model with
per-head q/k RMSNorms (Qwen3) passes them in: the rotary kernels apply them first, with no launch of their
own. A layer with a sliding window passes it to the kernels. A step whose metadata carries cascade groups
attends in three parts instead (see _cascade), on layers whose window does not bite in that step."""

from __future__ import annotations

import torch
from torch import nn

from fastllm.compile import custom_ops  # noqa: F401  (registers torch.ops.fastllm)
from fastllm.kernels import dispatch as ops
from fastllm.kernels import reference
from fastllm.kernels.side_stream import fork_join
from fastllm.layers.norm import RMSNorm
from fastllm.layers.rotary import RotaryEmbedding
from fastllm.worker.attn_metadata import get_attn_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_index: int,
                 rotary: RotaryEmbedding, sliding_window: int | None = None):
        super().__init__()
        self.rotary = rotary
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window = sliding_window  # the row at position p sees keys p - window < k <= p (None: all)
        # (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]; bound by the runner.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # An FP8 cache's per-tensor scales (the cache holds K / k_scale, V / v_scale in e4m3): the checkpoint's
        # (k_scale, v_scale) where it has them (set by the model's load_weights), else 1.0, as in vLLM.
        self.checkpoint_kv_scales: tuple[float, float] | None = None
        self.calculated_kv_scales: tuple[float, float] | None = None  # calculate_kv_scales: wins over those
        self.kv_scales = {}  # k_scale, v_scale for the kernels; empty with a 16/32-bit cache
        self.kv_amax: torch.Tensor | None = None  # [2]: K's and V's amax, recorded in a calibration forward
        self.layer_index = layer_index  # its place in the model's attention_layers() (the forward context)

    def bind_kv_cache(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Attend over this cache from now on (its dtype decides whether the scales apply)."""
        self.kv_cache = kv_cache
        if kv_cache[0].dtype == torch.float8_e4m3fn:
            k_scale, v_scale = self.calculated_kv_scales or self.checkpoint_kv_scales or (1.0, 1.0)
            self.kv_scales = dict(k_scale=k_scale, v_scale=v_scale)
        else:
            self.kv_scales = {}

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        """positions [T]; query [T, Hq, D], key/value [T, Hkv, D] before rotary -> [T, Hq, D].
        q_norm, k_norm (both or neither, one eps): RMSNorms over head_dim applied to each head first."""
        if q_norm is None and k_norm is None:
            return torch.ops.fastllm.attention(positions, query, key, value, self.layer_index)
        if q_norm is None or k_norm is None or q_norm.eps != k_norm.eps:
            raise ValueError("q_norm and k_norm go together, with one eps")
        return torch.ops.fastllm.attention(positions, query, key, value, self.layer_index, q_norm.weight,
                                           k_norm.weight, q_norm.eps)

    def run(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
            norm_eps: float = 1e-6) -> torch.Tensor:
        """The body of the attention op: (norm and) rotate q and k, write the new K/V into the cache and
        attend (the inputs stay as they are)."""
        metadata = get_attn_metadata()
        if metadata is None or self.kv_cache is None:
            if self.kv_amax is not None:  # calculate_kv_scales's forward: one sequence, no cache
                return self._calibration_attention(positions, query, key, value, q_norm_weight, k_norm_weight,
                                                   norm_eps)
            return query.clone()  # profiling run (no cache yet): the output only needs the right shape
        key_cache, value_cache = self.kv_cache
        cos_sin, is_neox = self.rotary.cos_sin_cache, self.rotary.is_neox
        window = self.sliding_window
        if window is not None and metadata.max_seq_len <= window:
            window = None  # no row of this step reaches past its window: full attention is the same
        norm = dict(q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps)
        scales = self.kv_scales
        if metadata.cascade is not None and window is None:
            return self._cascade(positions, query, key, value, metadata, norm)
        if metadata.is_decode_only:  # one kernel: rotary, the cache write and attention
            return ops.rotary_decode_attention(positions, query, key, value, cos_sin, is_neox, key_cache,
                                               value_cache, metadata.slot_mapping, metadata.block_tables,
                                               metadata.seq_lens, metadata.max_seq_len, self.scale, window,
                                               **norm, **scales)
        if metadata.token_rows is not None:  # every new token's K/V in the cache first, then a row per token
            query, _, _ = ops.rotary_kv_cache_write(positions, query, key, value, cos_sin, is_neox, key_cache,
                                                    value_cache, metadata.slot_mapping, return_kv=False,
                                                    **norm, **scales)
            rows = metadata.token_rows
            return ops.paged_decode_attention(query, key_cache, value_cache, rows.block_tables, rows.seq_lens,
                                              metadata.max_seq_len, self.scale, window, **scales)
        # key and value become the chunk's rows as the cache holds them (what prefill attends to)
        query, key, value = ops.rotary_kv_cache_write(positions, query, key, value, cos_sin, is_neox,
                                                      key_cache, value_cache, metadata.slot_mapping,
                                                      return_kv=True, **norm, **scales)
        rows = metadata.decode_rows
        if rows is None:
            return ops.prefill_attention(query, key, value, key_cache, value_cache, metadata.block_tables,
                                         metadata.seq_lens, metadata.query_start_loc, metadata.max_query_len,
                                         self.scale, window, tile_map=metadata.tile_map, **scales)
        requests = (metadata.block_tables, metadata.seq_lens, metadata.query_start_loc) if rows.in_graph \
            else (rows.rest_block_tables, rows.rest_seq_lens, rows.rest_query_start_loc)
        out = ops.prefill_attention(query, key, value, key_cache, value_cache, *requests,
                                    metadata.max_query_len, self.scale, window, tile_map=metadata.tile_map,
                                    **scales)
        decoded = ops.paged_decode_attention(query[:rows.count], key_cache, value_cache,
                                             metadata.block_tables[:rows.count], rows.seq_lens,
                                             metadata.max_seq_len, self.scale, window, **scales)
        if rows.in_graph:  # rows past the step's decodes are the prefill kernel's
            decoded = torch.where(rows.seq_lens[:, None, None] > 0, decoded, out[:rows.count])
        out[:rows.count] = decoded
        return out

    def _calibration_attention(self, positions, query, key, value, q_norm_weight, k_norm_weight, norm_eps):
        """Causal attention of one sequence with no cache, in plain PyTorch (a startup forward: no kernel to
        keep in step), recording the amax of K as the cache would store it (normed, rotated) and of V into
        kv_amax (worker/kv_scales.py). The output feeds the next layer, so its K/V are text-like too."""
        query, key = query.clone(), key.clone()
        reference.rotary_embedding(positions, query, key, self.rotary.cos_sin_cache, self.rotary.is_neox,
                                   q_norm_weight, k_norm_weight, norm_eps)
        amax = torch.stack([key.abs().amax(), value.abs().amax()]).float()
        torch.maximum(self.kv_amax, amax, out=self.kv_amax)
        mask = None
        if self.sliding_window is not None:
            pos = torch.arange(len(positions), device=query.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < self.sliding_window)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=mask,
            is_causal=mask is None, scale=self.scale, enable_gqa=True)
        return out.transpose(0, 1).contiguous()

    def _cascade(self, positions, query, key, value, metadata, norm: dict) -> torch.Tensor:
        """Cascade attention: each request's suffix (keys from kv_start) through the paged kernels, with their
        log-sum-exp; each group's rows against its shared prefix in one pass, beside it; the two merged by LSE
        (in a decode step by the suffix kernel itself)."""
        key_cache, value_cache = self.kv_cache
        cascade, scales = metadata.cascade, self.kv_scales
        decode = metadata.is_decode_only  # (its kernels read the new keys from the cache)
        query, key, value = ops.rotary_kv_cache_write(positions, query, key, value, self.rotary.cos_sin_cache,
                                                      self.rotary.is_neox, key_cache, value_cache,
                                                      metadata.slot_mapping, return_kv=not decode, **norm,
                                                      **scales)

        if decode:  # two launches: the suffix kernel merges (cascade_decode_attention)
            return ops.cascade_decode_attention(
                query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, cascade.kv_start,
                cascade.prefix_rows, cascade.prefix_lens, cascade.rows, cascade.row_start,
                cascade.max_group_rows, cascade.max_prefix_len, cascade.max_suffix_len, self.scale, **scales)

        def suffix():
            return ops.prefill_attention(query, key, value, key_cache, value_cache, metadata.block_tables,
                                         metadata.seq_lens, metadata.query_start_loc, metadata.max_query_len,
                                         self.scale, None, cascade.kv_start, True, **scales)

        def prefix():
            return ops.cascade_prefix_attention(
                query, key_cache, value_cache, metadata.block_tables, cascade.prefix_rows, cascade.prefix_lens,
                cascade.rows, cascade.row_start, cascade.max_group_rows, cascade.max_prefix_len, self.scale,
                **scales)

        # The two parts are independent: the prefix kernel runs beside the suffix kernel (side_stream.py).
        (prefix_o, prefix_lse), (out, lse) = fork_join(prefix, suffix, query.device)
        ops.merge_attn_states(out, lse, prefix_o, prefix_lse, cascade.rows)
        return out
