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

An FP8 cache (kv_cache_dtype="fp8") holds e4m3 values of K / k_scale and V / v_scale (per-tensor float
scales, one pair per layer): writers divide and saturate (kv_to_cache), readers multiply back
(kv_from_cache). With a 16/32-bit cache the scales must be 1.0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_LOG2E = 1.4426950408889634


def kv_cache_write(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, slot = block * block_size + offset; < 0 means skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    check_kv_scales(key_cache, k_scale, v_scale)
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = kv_to_cache(key[valid], key_cache.dtype, k_scale)
    value_cache[blocks, offsets] = kv_to_cache(value[valid], value_cache.dtype, v_scale)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int,
               scale: float = 1.0) -> torch.Tensor:
    """The K (or V) rows of positions [start, end) through one request's block table: [end - start, Hkv, D]
    (an FP8 cache's dequantized, in float32). Blocks before start's are never touched (a sliding window may
    have freed them)."""
    block_size = cache.shape[1]
    first, last = start // block_size, (end + block_size - 1) // block_size
    blocks = cache[block_table[first:last].long()]  # [n, block_size, Hkv, D]
    rows = blocks.reshape(-1, *cache.shape[2:])[start - first * block_size:end - first * block_size]
    return kv_from_cache(rows, scale)


def _first_key(seq_len: int, q_len: int, window: int | None, kv_start: int) -> int:
    """The lowest key position any of a request's q_len query rows attends to."""
    return max(kv_start, seq_len - q_len - window + 1 if window else 0, 0)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    kv_start: torch.Tensor | None = None,
    return_lse: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each request's query tokens over its paged KV.

    Request i owns query rows query_start_loc[i]:query_start_loc[i+1]; they are the last q_len
    positions of its seq_lens[i] tokens, whose K/V are already in the cache. This one function
    covers decode (q_len = 1), prefill (q_len = seq_len) and chunked prefill.
    window: the row at position p sees keys p - window < k <= p (Hugging Face's sliding window);
    kv_start [B]: request i sees no key before kv_start[i] (cascade attention's suffix).
    return_lse: also return lse [T, Hq] float32, log2 of each row's softmax denominator
    sum_k exp(scale q.k) (base 2, as the kernels keep it; -inf where a row sees no key).
    k_scale, v_scale: an FP8 cache's scales (its entries are dequantized first).
    """
    check_kv_scales(key_cache, k_scale, v_scale)
    out = torch.empty_like(query)
    lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float32, device=query.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    starts = kv_start.tolist() if kv_start is not None else [0] * len(lens)
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        first = _first_key(seq_len, q_len, window, starts[i])
        k = _gather_kv(key_cache, block_tables[i], first, seq_len, k_scale)
        v = _gather_kv(value_cache, block_tables[i], first, seq_len, v_scale)
        out[start:end], lse[start:end] = _attend(query[start:end], k, v, scale, first, window)
    return (out, lse) if return_lse else out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first: int = 0,
            window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [q_len, Hq, D], the last q_len positions of keys first .. first + s - 1 (k/v [s, Hkv, D]): causal
    attention (within the window) in float32. Returns the output in q's dtype and lse [q_len, Hq]."""
    q_len, num_keys, group, dtype = q.shape[0], k.shape[0], q.shape[1] // k.shape[1], q.dtype
    seq_len = first + num_keys
    q = q.float().transpose(0, 1)  # [Hq, q, D]
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, s, D]
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [Hq, q, s]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=scores.device).unsqueeze(1)
    k_pos = torch.arange(first, seq_len, device=scores.device).unsqueeze(0)
    hidden = k_pos > q_pos
    if window:
        hidden |= k_pos <= q_pos - window
    scores.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) * _LOG2E  # [Hq, q]
    probs = torch.softmax(scores, dim=-1).masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)  # no key: out = 0
    return torch.matmul(probs, v).transpose(0, 1).to(dtype), lse.transpose(0, 1)


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D], one token per request
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,  # an upper bound on seq_lens (kernels size their KV split from it)
    scale: float,
    window: int | None = None,
    kv_start: torch.Tensor | None = None,  # [B] int32: keys before it are not attended (a cascade's suffix)
    return_lse: bool = False,
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window,
                           kv_start, return_lse, k_scale, v_scale)


def prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]: the chunks' own K/V rows as the cache holds them (FP8: the e4m3 values
    value: torch.Tensor,  # in q's dtype; the Triton kernel reads them from here, this reads the cache alone)
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,  # an upper bound on the per-request query lengths (sizes the grid)
    scale: float,
    window: int | None = None,
    kv_start: torch.Tensor | None = None,  # [B] int32, <= each request's cached prefix (seq_len - q_len)
    return_lse: bool = False,
    tile_map: torch.Tensor | None = None,  # the kernel's grid (prefill_tiles.py): no bearing on the math
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    assert key.shape == value.shape == (query.shape[0], *key_cache.shape[2:]), (key.shape, query.shape)
    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window,
                           kv_start, return_lse, k_scale, v_scale)


def cascade_prefix_attention(
    query: torch.Tensor,  # [T, Hq, D], rotated
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32: the step's tables
    prefix_rows: torch.Tensor,  # [G] int32: a member of each group, whose table row holds the shared blocks
    prefix_lens: torch.Tensor,  # [G] int32: tokens of the shared prefix, >= 1
    rows: torch.Tensor,  # [R] int32: the query rows of group 0, then of group 1, ...
    row_start: torch.Tensor,  # [G + 1] int32: group g owns rows[row_start[g]:row_start[g + 1]]
    max_group_rows: int,  # host-side bound on a group's rows (sizes the grid)
    max_prefix_len: int,  # host-side bound on prefix_lens (sizes the KV split)
    scale: float,
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cascade attention's shared part: every query row of a group attends to all of its group's prefix
    keys (no causal mask: the prefix lies before every row). Returns S partial states per row,
    o [R, Hq, S, D] float32 (normalized) and lse [R, Hq, S] float32 (base 2; -inf: an empty part), which
    merge_attn_states folds into the rows' suffix attention. Here S = 1; a kernel may split the prefix."""
    check_kv_scales(key_cache, k_scale, v_scale)
    num_rows, num_heads, head_dim = rows.shape[0], query.shape[1], query.shape[2]
    o = torch.zeros(num_rows, num_heads, 1, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((num_rows, num_heads, 1), float("-inf"), dtype=torch.float32, device=query.device)
    bounds, lens = row_start.tolist(), prefix_lens.tolist()
    for g, prefix_len in enumerate(lens):
        r0, r1 = bounds[g], bounds[g + 1]
        table = block_tables[int(prefix_rows[g])]
        k = _gather_kv(key_cache, table, 0, prefix_len, k_scale)
        v = _gather_kv(value_cache, table, 0, prefix_len, v_scale)
        for r in range(r0, r1):  # each row alone: as the last query of a request whose keys end at the prefix
            out, row_lse = _attend(query[rows[r].long()].unsqueeze(0).float(), k, v, scale)
            o[r, :, 0], lse[r, :, 0] = out[0], row_lse[0]
    return o, lse


def merge_attn_states(
    out: torch.Tensor,  # [T, Hq, D]: each row's suffix attention; rows listed in `rows` are overwritten
    lse: torch.Tensor,  # [T, Hq] float32: its log-sum-exp (base 2)
    prefix_o: torch.Tensor,  # [R, Hq, S, D] float32
    prefix_lse: torch.Tensor,  # [R, Hq, S] float32
    rows: torch.Tensor,  # [R] int: row r of the prefix states belongs to query row rows[r] (< 0: padding)
) -> None:
    """out[rows[r]] <- the softmax-weighted merge of its suffix state and its S prefix states:
    sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s (states with lse -inf weigh 0)."""
    used = rows >= 0  # (a CUDA graph's plan pads rows with -1)
    idx, prefix_o, prefix_lse = rows[used].long(), prefix_o[used], prefix_lse[used]
    all_lse = torch.cat([lse[idx].unsqueeze(-1), prefix_lse], dim=-1)  # [R, Hq, S + 1]
    all_o = torch.cat([out[idx].float().unsqueeze(2), prefix_o], dim=2)  # [R, Hq, S + 1, D]
    weights = torch.exp2(all_lse - all_lse.amax(dim=-1, keepdim=True))  # [R, Hq, S + 1]
    all_o = torch.where(weights.unsqueeze(-1) > 0, all_o, 0.0)  # an empty state's o is never read
    merged = (weights.unsqueeze(-1) * all_o).sum(2) / weights.sum(-1, keepdim=True)
    out[idx] = merged.to(out.dtype)


def cascade_decode_attention(
    query: torch.Tensor,  # [B, Hq, D], rotated: one decode row per request
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,  # [B] int32
    kv_start: torch.Tensor,  # [B] int32: each request's suffix start (its group's prefix length; 0 alone)
    prefix_rows: torch.Tensor,  # as cascade_prefix_attention
    prefix_lens: torch.Tensor,
    rows: torch.Tensor,  # [R] int32: the requests of group 0, then of group 1, ... (-1: padding)
    row_start: torch.Tensor,
    max_group_rows: int,
    max_prefix_len: int,
    max_suffix_len: int,  # host-side bound on seq_len - kv_start
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """A decode step's cascade attention, whole: each request's suffix (keys from kv_start), its group's
    shared prefix, the two merged by log-sum-exp. Equals paged_decode_attention over the whole sequences."""
    out, lse = paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, max_suffix_len,
                                      scale, None, kv_start, True, k_scale, v_scale)
    prefix_o, prefix_lse = cascade_prefix_attention(query, key_cache, value_cache, block_tables, prefix_rows,
                                                    prefix_lens, rows, row_start, max_group_rows,
                                                    max_prefix_len, scale, k_scale, v_scale)
    merge_attn_states(out, lse, prefix_o, prefix_lse, rows)
    return out


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
    q_norm_weight: torch.Tensor | None = None,  # [D]
    k_norm_weight: torch.Tensor | None = None,  # [D]
    norm_eps: float = 1e-6,
) -> None:
    """Rotary embedding over the full head dim.

    is_neox=True is the half-split layout (HF Llama's rotate_half: pairs (i, i + D/2));
    False is the interleaved GPT-J layout (pairs (2i, 2i + 1)).
    With q/k norm weights (Qwen3; both or neither) each head of q and k is first rms_norm'ed over D and
    rounded to its dtype, as transformers' Qwen3RMSNorm before its rotary.
    """
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together: got only one of them")
    if q_norm_weight is not None:
        query.copy_(rms_norm(query, q_norm_weight, norm_eps))
        key.copy_(rms_norm(key, k_norm_weight, norm_eps))
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
    return_kv: bool,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """rotary_embedding (with the q/k norms if given) on copies of query and key, then kv_cache_write of
    the rotated key and value. Returns (rotated query, key_out, value_out): with return_kv the rotated key
    and value as the cache holds them, in their own dtype (an FP8 cache: the e4m3 values of x / scale; else
    the rotated key and `value` itself), else None and None."""
    query, key = query.clone(), key.clone()
    rotary_embedding(positions, query, key, cos_sin_cache, is_neox, q_norm_weight, k_norm_weight, norm_eps)
    kv_cache_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if not return_kv:
        return query, None, None
    if key_cache.dtype != FP8:
        return query, key, value
    return (query, kv_to_cache(key, FP8, k_scale).to(key.dtype),
            kv_to_cache(value, FP8, v_scale).to(value.dtype))


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
    window: int | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    k_scale: float = 1.0,  # an FP8 cache's scales
    v_scale: float = 1.0,
) -> torch.Tensor:
    """A decode step's attention: rotary_kv_cache_write (with the q/k norms if given), then each request
    attends over its cached tokens (the last window - 1 of them with a window) and its new token (rotated
    key and value, as the cache holds them). Where slot >= 0 this is exactly paged_decode_attention after
    the write; a padding row (slot < 0) writes nothing and still attends to its own new token."""
    query, key, value = rotary_kv_cache_write(positions, query, key, value, cos_sin_cache, is_neox, key_cache,
                                              value_cache, slot_mapping, True, q_norm_weight, k_norm_weight,
                                              norm_eps, k_scale, v_scale)
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        first = _first_key(seq_len, 1, window, 0)
        k = torch.cat([_gather_kv(key_cache, block_tables[i], first, seq_len - 1, k_scale),
                       kv_from_cache(key[i:i + 1].to(key_cache.dtype), k_scale)])  # (exact: what it holds)
        v = torch.cat([_gather_kv(value_cache, block_tables[i], first, seq_len - 1, v_scale),
                       kv_from_cache(value[i:i + 1].to(value_cache.dtype), v_scale)])
        out[i:i + 1] = _attend(query[i:i + 1], k, v, scale, first, window)[0]
    return out


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> int64 [B]: the first index of each row's maximum (NaN counts as the maximum)."""
    return torch.argmax(logits, dim=-1, out=out) if out is not None else torch.argmax(logits, dim=-1)


def all_reduce_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """The one-shot all-reduce's result (one_shot_all_reduce.py), given every rank's x: summed in rank
    order in float32, then cast back, as the kernel does on every rank."""
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)


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


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual): a pre-norm projection and the new residual."""
    normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), residual


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(linear(x)) of weight [gate; up]: the gated MLP's activation."""
    return silu_and_mul(linear(x, weight, None))


def add_rms_norm_gated_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gated_linear(rms_norm(x + residual)), x + residual): the gated MLP's first half and the new
    residual."""
    normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return gated_linear(normed, weight), residual


def rms_norm_folded_linear(x: torch.Tensor, unit_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """linear(rms_norm(x)) for a weight that carries the norm's weight, the norm left with unit_weight (ones):
    the norm, then the projection (the kernel scales its sums by 1 / rms instead, skinny_linear's
    RMS_NORM_FOLDED)."""
    return linear(rms_norm(x, unit_weight, eps), weight, bias)


def rms_norm_folded_gated_linear(x: torch.Tensor, unit_weight: torch.Tensor, eps: float, weight: torch.Tensor
                                 ) -> torch.Tensor:
    """gated_linear(rms_norm(x)) of a [gate; up] weight that carries the norm's weight."""
    return gated_linear(rms_norm(x, unit_weight, eps), weight)


def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
               ) -> torch.Tensor:
    """linear(x) + residual: a projection onto the residual stream."""
    return linear(x, weight, bias) + residual


# FP8 e4m3: weights [N, K] with a float32 scale per output row, activations quantized per token.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_AMAX = 1e-12  # an all-zero row or token still gets a finite, non-zero scale


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scale that maps amax to e4m3's largest value, IEEE-divided on every device (CUDA turns
    a division by a Python number into a multiplication by its rounded reciprocal; the kernels divide)."""
    amax = amax.float().clamp_min(MIN_AMAX)
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float32, rounded to e4m3 (nearest even), saturating at +-448 (a plain cast gives NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_fp8_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): each token's amax / 448, or the static
    input_scale (a scalar) for every token; x * (1 / scale) rounded to e4m3, saturating at +-448."""
    if input_scale is None:
        scale = fp8_scale(x.abs().amax(dim=-1, keepdim=True))
    else:
        scale = input_scale.float().expand(*x.shape[:-1], 1).contiguous()
    # x times the scale's IEEE reciprocal, as the kernels do: a multiply an element, not a division (the
    # quantizing kernels' main cost; docs/fp8.md), as vLLM's dynamic quantization does
    inverse = torch.ones_like(scale) / scale
    return (x.float() * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * weight_scale [N, 1])^T (+ bias) -> [M, N] in x's dtype, x quantized
    to e4m3 per token first (quantize_fp8_per_token)."""
    x_q, x_scale = quantize_fp8_per_token(x, input_scale)
    return fp8_linear_quantized(x_q, x_scale, weight, weight_scale, bias, x.dtype)


def fp8_linear_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_linear of activations quantized already: x_q [M, K] e4m3 with float32 scales x_scale [M, 1]. What
    the FP8 GEMM computes (e4m3 products summed in float32, then scaled) up to the order of the sums: both
    operands dequantized, multiplied in float32."""
    out = (x_q.float() * x_scale) @ (weight.float() * weight_scale.float()[:, None]).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# The activations of a projection with FP8 weights, quantized by the kernel before it: (e4m3, float32 scale
# per token), exactly quantize_fp8_per_token of what that kernel would have written in the model's dtype.
def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_per_token(rms_norm(x, weight, eps))


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    normed, residual = fused_add_rms_norm(x, residual, weight, eps)
    return *quantize_fp8_per_token(normed), residual


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_per_token(silu_and_mul(x))


def check_kv_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """KV scales belong to FP8 caches: with another cache they would do nothing, so they must be 1.0."""
    if cache.dtype != FP8 and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(f"k_scale / v_scale ({k_scale}, {v_scale}) apply to an FP8 KV cache only, "
                         f"not to a {cache.dtype} one")


def kv_to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """K or V rows as a cache of cache_dtype stores them: FP8, x / scale rounded to e4m3 and saturated
    (IEEE division, as the kernels divide); else x in the cache's dtype."""
    if cache_dtype == FP8:
        return quantize_fp8(x, torch.tensor(scale, dtype=torch.float32, device=x.device))
    return x.to(cache_dtype)


def kv_from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache entries as values: e4m3 times the scale in float32; other dtypes as they are."""
    return x.float() * scale if x.dtype == FP8 else x

