"""Cascade attention in pieces and whole: the suffix kernels' kv_start and LSE, the shared-prefix kernel, the
merge, and the three together against plain attention over each request's whole sequence.

Groups of requests share their leading blocks (the same ids in their tables, as prefix caching gives them);
prefix lengths need not be whole blocks. The whole (prefix kernel -> suffix with kv_start -> merge) must
equal attention over the whole sequence, on the Triton kernels and on the references (the CPU path does the
same split and merge). Tolerances: the decode table (test_paged_decode_attention.TOL).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fastllm.kernels import reference_impl, triton_impl
from tests.kernels.kernel_testing import PagedKV, assert_close, assert_lse_close, cdiv, gpu
from tests.kernels.test_paged_decode_attention import TOL


class SharedPrefixKV:
    """A PagedKV whose requests come in groups; the members of group g share its first prefix_lens[g]
    tokens: their tables hold the leader's block ids for those positions (the partial block included)."""

    def __init__(self, groups: list[int], prefix_lens: list[int], own_lens: list[int], hkv, d, page, dtype, device,
                 gen, q_lens: list[int] | None = None):
        assert len(groups) == len(prefix_lens) and sum(groups) <= len(own_lens)
        # requests: the members of each group, then requests that share nothing (own_lens beyond the groups)
        self.members = []
        seq_lens, first = [], 0
        for size, prefix in zip(groups, prefix_lens):
            self.members.append(list(range(first, first + size)))
            seq_lens += [prefix + n for n in own_lens[first:first + size]]
            first += size
        seq_lens += own_lens[first:]
        self.q_lens = q_lens or [1] * len(seq_lens)
        self.kv = PagedKV(seq_lens, sum(cdiv(n, page) for n in seq_lens) + 8, page, hkv, d, dtype, device, gen)
        for members, prefix in zip(self.members, prefix_lens):
            n = cdiv(prefix, page)
            shared = self.kv.block_tables[members[0], :n]
            self.kv.block_tables[members[1:], :n] = shared
            for cache in (self.kv.key_cache, self.kv.value_cache):  # the partial block's slots past the
                blocks = cache[shared.long()]  # leader's tokens hold the members' tokens there
                cache[shared.long()] = torch.where(blocks.isnan(), torch.randn_like(blocks, dtype=torch.float32)
                                                   .to(dtype), blocks)
        self.prefix_lens = prefix_lens
        self.device = device

    def plan(self, reverse: bool = False):
        """The metadata a cascade step carries: each request's kv_start, a member of each group (any one:
        its table row holds the shared blocks) and the prefix lengths, the groups' query rows (group by
        group) and where each group's rows start. reverse: the groups, and each group's requests, listed
        last to first (a plan's row i is then not query row i)."""
        kv_start = torch.zeros(len(self.q_lens), dtype=torch.int32)
        qsl = [0, *itertools.accumulate(self.q_lens)]
        rows, row_start = [], [0]
        order = (lambda x: list(x)[::-1]) if reverse else list
        groups = order(zip(self.members, self.prefix_lens))
        prefix_rows = [members[len(members) // 2] for members, _ in groups]
        for members, prefix in groups:
            for i in order(members):
                kv_start[i] = prefix
                rows += range(qsl[i], qsl[i + 1])
            row_start.append(len(rows))
        as_dev = dict(dtype=torch.int32, device=self.device)
        max_rows = max(b - a for a, b in zip(row_start, row_start[1:]))
        return (kv_start.to(self.device), torch.tensor(prefix_rows, **as_dev),
                torch.tensor([prefix for _, prefix in groups], **as_dev), torch.tensor(rows, **as_dev),
                torch.tensor(row_start, **as_dev), max_rows, max(self.prefix_lens))


def cascade(impl, query, skv: SharedPrefixKV, scale, key=None, value=None, plan=None):
    """Cascade attention with one implementation's kernels ("triton" or "reference"): prefix, suffix, merge."""
    kv = skv.kv
    kv_start, prefix_rows, prefix_lens, rows, row_start, max_rows, max_prefix = (plan or skv.plan())[:7]
    get = triton_impl if impl == "triton" else reference_impl
    if key is None:  # decode rows (the bound on the host before a capture: plan[-1] if given)
        max_suffix = int((kv.seq_lens - kv_start).max()) if plan is None or len(plan) == 7 else plan[7]
        out, lse = get("paged_decode_attention")(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                                 max_suffix, scale, None, kv_start, True)
    else:
        qsl = torch.tensor([0, *itertools.accumulate(skv.q_lens)], dtype=torch.int32, device=query.device)
        out, lse = get("prefill_attention")(query, key, value, kv.key_cache, kv.value_cache, kv.block_tables,
                                            kv.seq_lens, qsl, max(skv.q_lens), scale, None, kv_start, True)
    prefix_o, prefix_lse = get("cascade_prefix_attention")(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                                           prefix_rows, prefix_lens, rows, row_start, max_rows,
                                                           max_prefix, scale)
    get("merge_attn_states")(out, lse, prefix_o, prefix_lse, rows)
    return out


def _decode(device, gen, dtype, groups, prefix_lens, own_lens, hq, hkv, d, page):
    skv = SharedPrefixKV(groups, prefix_lens, own_lens, hkv, d, page, dtype, device, gen)
    kv = skv.kv
    query = torch.randn(len(own_lens), hq, d, device=device).to(dtype)
    k, v, table = kv.compact_float()
    whole = reference_impl("paged_decode_attention")(query.float(), k, v, table, kv.seq_lens, 1, d**-0.5)
    for impl in ("triton", "reference"):
        out = cascade(impl, query if impl == "triton" else query.float(), skv, d**-0.5)
        assert_close(out, whole, *TOL[dtype if impl == "triton" else torch.float32],
                     what=f"{impl} cascade groups={groups} prefix={prefix_lens}")


# (group sizes, shared prefix lengths, each request's own tokens after its prefix (then the lone requests'
# whole lengths), Hq, Hkv, head_dim, block size)
CASES = [
    ([4], [32], [1, 5, 17, 40], 8, 2, 64, 16),  # one group, whole blocks, GQA 4
    ([3, 2], [45, 7], [3, 1, 20, 9, 64], 16, 2, 128, 16),  # partial prefix blocks, GQA 8, head dim 128
    ([2], [100], [1, 1, 30, 1], 4, 4, 64, 8),  # MHA, a group beside requests that share nothing
    ([5], [129], [2, 3, 4, 5, 6], 8, 1, 64, 32),  # GQA 8 over one KV head, prefix just past 4 blocks
    ([2, 2, 3], [16, 300, 31], [1, 2, 3, 4, 5, 6, 7, 50], 6, 2, 128, 16),  # group of 3 heads, long prefix
    ([3, 1, 1], [40, 64, 96], [2, 5, 1, 3, 9, 20], 8, 2, 64, 16),  # groups of one, one lone request
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("groups,prefix_lens,own_lens,hq,hkv,d,page", CASES)
def test_cascade_decode_equals_whole_attention(device, gen, dtype, groups, prefix_lens, own_lens, hq, hkv, d, page):
    _decode(device, gen, dtype, groups, prefix_lens, own_lens, hq, hkv, d, page)


def cascade_decode(impl, query, skv: SharedPrefixKV, scale, pad_rows: int = 0, reverse: bool = False):
    """A decode step's cascade as the engine runs it (cascade_decode_attention: the prefix kernel, then the
    suffix kernel, which merges), pad_rows -1 rows after the plan's (a CUDA graph's padding)."""
    kv = skv.kv
    kv_start, prefix_rows, prefix_lens, rows, row_start, max_rows, max_prefix = skv.plan(reverse)
    rows = torch.cat([rows, rows.new_full((pad_rows,), -1)])
    get = triton_impl if impl == "triton" else reference_impl
    return get("cascade_decode_attention")(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                           kv_start, prefix_rows, prefix_lens, rows, row_start, max_rows,
                                           max_prefix, int((kv.seq_lens - kv_start).max()), scale)


# a suffix long enough to split (the decode kernel merges its splits, then the prefix's states)
SPLIT_SUFFIX = ([3], [40], [700, 5, 600, 9], 8, 2, 64, 16)
# 70 grouped requests, two lone ones last
MANY_ROWS = ([40, 30], [8, 21], [1, 2, 3] * 24, 2, 1, 16, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("groups,prefix_lens,own_lens,hq,hkv,d,page", [*CASES, SPLIT_SUFFIX, MANY_ROWS])
def test_decode_cascade_merges_in_the_suffix_kernel(device, gen, dtype, groups, prefix_lens, own_lens, hq,
                                                    hkv, d, page):
    # the engine's decode cascade (no merge launch) and its reference equal attention over the whole sequences
    skv = SharedPrefixKV(groups, prefix_lens, own_lens, hkv, d, page, dtype, device, gen)
    kv = skv.kv
    query = torch.randn(len(own_lens), hq, d, device=device).to(dtype)
    k, v, table = kv.compact_float()
    whole = reference_impl("paged_decode_attention")(query.float(), k, v, table, kv.seq_lens, 1, d**-0.5)
    for reverse in (False, True):  # (reversed: the plan's rows are not in query order)
        out = cascade_decode("triton", query, skv, d**-0.5, pad_rows=3, reverse=reverse)
        assert_close(out, whole, *TOL[dtype], what=f"cascade decode groups={groups} prefix={prefix_lens}")
        reference = cascade_decode("reference", query.float(), skv, d**-0.5, pad_rows=2, reverse=reverse)
        assert_close(reference, whole, *TOL[torch.float32], what="reference cascade decode")


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_decode_cascade_without_groups_is_the_suffix_attention(device, gen, impl):
    # no group (no prefix launch): each request attends from its kv_start alone, as the reference says
    skv = SharedPrefixKV([], [], [9, 30, 17], 2, 32, 8, torch.float32, device, gen)
    kv = skv.kv
    query = torch.randn(3, 8, 32, device=device)
    kv_start = torch.tensor([0, 16, 5], dtype=torch.int32, device=device)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    get = triton_impl if impl == "triton" else reference_impl
    row_start = torch.zeros(1, dtype=torch.int32, device=device)
    out = get("cascade_decode_attention")(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                          kv_start, none, none, none, row_start, 0, 0, 30, 0.2)
    suffix = reference_impl("paged_decode_attention")(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                                      kv.seq_lens, 30, 0.2, None, kv_start)
    assert_close(out, suffix, *TOL[torch.float32], what=f"{impl} cascade decode without groups")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cascade_prefill_rows_equal_whole_attention(device, gen, dtype):
    # a mixed step: chunks of several rows (whose own keys are partly this step's) and decode rows
    hq, hkv, d, page = 8, 2, 64, 16
    q_lens = [7, 1, 20, 1, 3]
    skv = SharedPrefixKV([3, 2], [40, 17], [30, 1, 25, 5, 3], hkv, d, page, dtype, device, gen, q_lens=q_lens)
    kv = skv.kv
    query = torch.randn(sum(q_lens), hq, d, device=device).to(dtype)
    key, value = kv.chunk_rows(q_lens)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    k, v, table = kv.compact_float()
    whole = reference_impl("prefill_attention")(query.float(), key.float(), value.float(), k, v, table, kv.seq_lens,
                                                qsl, max(q_lens), d**-0.5)
    out = cascade("triton", query, skv, d**-0.5, key, value)
    assert_close(out, whole, *TOL[dtype], what="triton cascade, prefill rows")
    out = cascade("reference", query.float(), skv, d**-0.5, key.float(), value.float())
    assert_close(out, whole, *TOL[torch.float32], what="reference cascade, prefill rows")


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_prefix_kernel_splits(device, gen, num_splits):
    # every split count merges to the reference's one state, empty splits (lse -inf, o unwritten) included
    from fastllm.kernels.cascade_attention import cascade_prefix_attention_splits

    skv = SharedPrefixKV([3, 2], [200, 9], [1, 1, 1, 1, 1], 2, 32, 8, torch.float32, device, gen)
    _, prefix_rows, prefix_lens, rows, row_start, max_rows, max_prefix = skv.plan()
    kv = skv.kv
    query = torch.randn(5, 8, 32, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, prefix_rows, prefix_lens, rows, row_start,
            max_rows, max_prefix, 0.2)
    o, lse = cascade_prefix_attention_splits(*args, num_splits=num_splits)
    assert o.shape == (5, 8, num_splits, 32) and lse.shape == (5, 8, num_splits)
    _assert_splits_fold_to_reference(o, lse, args)


def test_prefix_splits_sized_for_a_bound_keep_their_minimum_length(device, gen):
    # a graph sizes the split count for its bound (8,192 keys): a 300-token prefix then fills two 256-key
    # splits (whole tiles) and the other programs return at once, rather than cutting it into slivers
    from fastllm.kernels import sm_count
    from fastllm.kernels.cascade_attention import cascade_prefix_attention_splits, choose_num_splits
    from fastllm.kernels.prefill_tiles import query_tile_size

    skv = SharedPrefixKV([2], [300], [1, 1], 1, 32, 16, torch.float32, device, gen)
    _, prefix_rows, prefix_lens, rows, row_start, max_rows, _ = skv.plan()
    kv = skv.kv
    query = torch.randn(2, 2, 32, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, prefix_rows, prefix_lens, rows, row_start,
            max_rows, 8192, 0.2)
    o, lse = cascade_prefix_attention_splits(*args)
    splits = choose_num_splits(max_rows, 1, query_tile_size(2), 8192, sm_count.num_sms(query.device))
    assert splits > 2 and lse.shape == (2, 2, splits)
    assert torch.isfinite(lse[:, :, :2]).all() and (lse[:, :, 2:] == float("-inf")).all(), lse
    _assert_splits_fold_to_reference(o, lse, args)


def _assert_splits_fold_to_reference(o, lse, args):
    # folding the splits into one state: what the merge computes with a suffix that weighs nothing
    query, rows = args[0], args[6]
    ref_o, ref_lse = reference_impl("cascade_prefix_attention")(*args)
    merged = torch.zeros(2 * query.shape[0], *query.shape[1:], device=query.device)
    none = torch.full(merged.shape[:2], float("-inf"), device=query.device)
    triton_impl("merge_attn_states")(merged, none, o, lse, rows)
    assert_close(merged[rows.long()], ref_o[:, :, 0], *TOL[torch.float32], what="prefix splits")
    assert_lse_close(torch.logsumexp(lse * 0.6931471805599453, -1) * 1.4426950408889634, ref_lse[:, :, 0])


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_merge_skips_padding_rows(device, impl):
    # a CUDA graph's plan pads rows with -1: nothing is read or written for them
    out = torch.randn(3, 2, 16, device=device)
    before = out.clone()
    prefix_o = torch.full((2, 2, 1, 16), float("nan"), device=device)
    prefix_lse = torch.zeros(2, 2, 1, device=device)
    rows = torch.tensor([-1, -1], dtype=torch.int32, device=device)
    (triton_impl if impl == "triton" else reference_impl)("merge_attn_states")(
        out, torch.zeros(3, 2, device=device), prefix_o, prefix_lse, rows)
    assert torch.equal(out, before)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_merge_ignores_empty_states(device, impl):
    # a state of lse -inf weighs nothing, whatever its o holds (NaN: an empty split writes no o)
    out = torch.randn(3, 2, 16, device=device)
    before = out.clone()
    lse = torch.tensor([[0.5, 1.0], [2.0, 0.0], [1.0, 1.0]], device=device)
    prefix_o = torch.randn(2, 2, 3, 16, device=device)
    prefix_o[:, :, 1] = float("nan")
    prefix_lse = torch.randn(2, 2, 3, device=device)
    prefix_lse[:, :, 1] = float("-inf")
    rows = torch.tensor([2, 0], dtype=torch.int32, device=device)
    get = triton_impl if impl == "triton" else reference_impl
    get("merge_attn_states")(out, lse, prefix_o, prefix_lse, rows)
    assert torch.equal(out[1], before[1]), "a row not listed was changed"
    for r, t in enumerate(rows.tolist()):
        states = torch.cat([lse[t].unsqueeze(-1), prefix_lse[r]], -1)  # [Hq, S + 1]
        os_ = torch.cat([before[t].unsqueeze(1), prefix_o[r]], 1).nan_to_num(0.0)
        w = torch.softmax(states * 0.6931471805599453, -1)  # base-2 lse -> natural weights
        assert_close(out[t], (w.unsqueeze(-1) * os_).sum(1), 1e-5, 1e-5, what=f"{impl} row {t}")


def test_prefix_split_count_is_host_only():
    from fastllm.kernels.cascade_attention import choose_num_splits

    # one program an SM: the suffix (or prefill) kernel's programs run beside them
    assert choose_num_splits(64, 8, 16, 2048, num_sms=132) == 4  # 32 programs a split: 128 of 132 SMs
    assert choose_num_splits(64, 8, 16, 200, num_sms=132) == 1  # too short to split
    assert choose_num_splits(0, 8, 16, 2048, num_sms=132) == 8  # no rows (an empty launch): no division by 0
    assert choose_num_splits(512, 8, 16, 4096, num_sms=132) == 1  # 256 programs: past the SMs already
    assert choose_num_splits(8, 8, 16, 8192, num_sms=132) == 16  # 8 programs; the bound allows 32
    # a graph's bounds (64 rows, 4096 keys; its padded groups do not count): 4 splits, as for the real length
    assert choose_num_splits(64, 8, 16, 4096, num_sms=132) == 4


# ---- on a real GPU ----


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 2, 64), (28, 4, 128), (32, 32, 64)])
def test_cascade_decode_gpu(device, gen, dtype, hq, hkv, d):
    # the benchmark's shape (64 requests on 2,048 shared tokens, 128 own each), two more groups with prefixes
    # that are not whole blocks, and requests that share nothing
    own = torch.randint(1, 300, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    own[:64] = [128] * 64
    _decode(device, gen, dtype, [64, 5, 3], [2048, 1000, 77], own, hq, hkv, d, 16)


@gpu
def test_cascade_decode_gpu_graph_replay(device, gen):
    # replayed launches with fresh queries: the three kernels in one graph give the same as run eagerly
    skv = SharedPrefixKV([16], [512], [64] * 16, 8, 128, 16, torch.bfloat16, device, gen)
    plan = skv.plan()  # (its device tensors, and the host bound on the suffixes, are made outside the capture)
    plan = (*plan, int((skv.kv.seq_lens - plan[0]).max()))
    query = torch.randn(16, 32, 128, device=device, dtype=torch.bfloat16)
    cascade("triton", query, skv, 128**-0.5, plan=plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cascade("triton", query, skv, 128**-0.5, plan=plan)
    for _ in range(5):
        query.copy_(torch.randn_like(query))
        graph.replay()
        assert_close(out, cascade("triton", query, skv, 128**-0.5, plan=plan), 0, 0, what="replay")
