"""Plain-PyTorch versions of every kernel: the CPU path and the test oracle.

Each function has the same signature as its Triton twin in this package. They favour clarity
over speed; the math is done in float32 and the result cast back to the input dtype, the way
Hugging Face transformers does it (so fp32 outputs match it to the last bit where possible).

Shapes used throughout:
    T   number of tokens in the flat batch        B   number of requests
    Hq  query heads     Hkv  key/value heads      D   head dim
    key_cache, value_cache: [num_blocks, block_size, Hkv, D]
    block_tables: [B, max_blocks_per_seq] int32   seq_lens: [B] int32 (tokens in the cache,
    including the ones written this step)         query_start_loc: [B + 1] int32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kv_cache_write(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, slot = block * block_size + offset; < 0 means skip
) -> None:
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[valid].to(value_cache.dtype)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [n, block_size, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]  # [seq_len, Hkv, D]


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its paged KV.

    Request i owns query rows query_start_loc[i]:query_start_loc[i+1]; they are the last q_len
    positions of its seq_lens[i] tokens, whose K/V are already in the cache. This one function
    covers decode (q_len = 1), prefill (q_len = seq_len) and chunked prefill.
    """
    out = torch.empty_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = _gather_kv(key_cache, block_tables[i], seq_len)
        v = _gather_kv(value_cache, block_tables[i], seq_len)
        out[start:end] = _attend(query[start:end], k, v, scale)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [q_len, Hq, D], the last q_len positions of k/v [s, Hkv, D]: causal attention in float32,
    returned in q's dtype."""
    q_len, seq_len, group, dtype = q.shape[0], k.shape[0], q.shape[1] // k.shape[1], q.dtype
    q = q.float().transpose(0, 1)  # [Hq, q, D]
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, s, D]
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [Hq, q, s]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=scores.device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=scores.device).unsqueeze(0)
    scores.masked_fill_(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1).to(dtype)


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D], one token per request
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,  # an upper bound on seq_lens (kernels size their KV split from it)
    scale: float,
) -> torch.Tensor:
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)


def prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]: the chunks' own K/V, already in the cache (the Triton kernel reads
    value: torch.Tensor,  # them from here instead of through the block table; this reads the cache alone)
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,  # an upper bound on the per-request query lengths (sizes the grid)
    scale: float,
) -> torch.Tensor:
    assert key.shape == value.shape == (query.shape[0], *key_cache.shape[2:]), (key.shape, query.shape)
    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (in the model dtype); returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, Hq, D], rotated in place
    key: torch.Tensor,  # [T, Hkv, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32: cos in [:, :D/2], sin in [:, D/2:]
    is_neox: bool = True,
) -> None:
    """Rotary embedding over the full head dim.

    is_neox=True is the half-split layout (HF Llama's rotate_half: pairs (i, i + D/2));
    False is the interleaved GPT-J layout (pairs (2i, 2i + 1)).
    """
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (query, key):
        xf = x.float()
        if is_neox:
            x1, x2 = xf.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        x.copy_(rotated.to(x.dtype))


def rotary_kv_cache_write(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, Hq, D] (not modified)
    key: torch.Tensor,  # [T, Hkv, D] (not modified)
    value: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]; < 0 means skip
    return_key: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rotary_embedding on copies of query and key, then kv_cache_write of the rotated key and value.
    Returns (rotated query, rotated key if return_key else None)."""
    query, key = query.clone(), key.clone()
    rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    kv_cache_write(key, value, key_cache, value_cache, slot_mapping)
    return query, (key if return_key else None)


def rotary_decode_attention(
    positions: torch.Tensor,  # [B]
    query: torch.Tensor,  # [B, Hq, D] before rotary (not modified)
    key: torch.Tensor,  # [B, Hkv, D] before rotary (not modified)
    value: torch.Tensor,  # [B, Hkv, D]
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [B]; < 0 means skip (a padding row)
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,  # [B], >= 1: the new token is at position seq_len - 1
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """A decode step's attention: rotary_kv_cache_write, then each request attends over its first
    seq_len - 1 cached tokens and its new token (rotated key and value, in the cache's dtype). Where
    slot >= 0 this is exactly paged_decode_attention after the write; a padding row (slot < 0) writes
    nothing and still attends to its own new token."""
    query, key = rotary_kv_cache_write(positions, query, key, value, cos_sin_cache, is_neox, key_cache,
                                       value_cache, slot_mapping, return_key=True)
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        cached = seq_len - 1
        k = torch.cat([_gather_kv(key_cache, block_tables[i], cached), key[i:i + 1].to(key_cache.dtype)])
        v = torch.cat([_gather_kv(value_cache, block_tables[i], cached),
                       value[i:i + 1].to(value_cache.dtype)])
        out[i:i + 1] = _attend(query[i:i + 1], k, v, scale)
    return out


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> int64 [B]: the first index of each row's maximum (NaN counts as the maximum)."""
    return torch.argmax(logits, dim=-1, out=out) if out is not None else torch.argmax(logits, dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] laid out as [gate | up]; returns silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] @ weight [N, K]^T (+ bias) -> [rows, N] (into `out` when given): F.linear."""
    if out is None:
        return F.linear(x, weight, bias)
    return out.copy_(F.linear(x, weight, bias))
