"""accept_drafts: greedy rows keep the drafts the argmax agrees with; sampled rows emit tokens
distributed as the target's own samples, whatever the draft proposed (checked by counting); padding
drafts are never accepted; a synthetic acceptance rate accepts at that rate whatever the values."""

from __future__ import annotations

import torch

from fastllm.layers.sampler import SamplingMetadata, SamplingRow, filtered_probs
from fastllm.sampling_params import SamplingParams
from fastllm.spec_decode.rejection_sampler import accept_drafts

V = 6


def metadata(params: list[SamplingParams]) -> SamplingMetadata:
    return SamplingMetadata.build([SamplingRow(p, None, [], [], None) for p in params], V, torch.device("cpu"))


def test_greedy_keeps_the_drafts_up_to_the_first_mismatch():
    target = torch.randint(0, V, (3, 4))
    drafts = target[:, :3].clone()
    drafts[0, 1] = (drafts[0, 1] + 1) % V  # request 0: the second draft is wrong
    drafts[2, 2] = (drafts[2, 2] + 1) % V  # request 2: the third is wrong, but only two are real
    num_drafts = torch.tensor([3, 3, 2])
    tokens, num = accept_drafts(target, drafts, num_drafts)
    assert num.tolist() == [2, 4, 3]
    assert tokens[0, :2].tolist() == target[0, :2].tolist()  # the right draft, then the argmax
    assert tokens[1].tolist() == target[1].tolist()  # all three drafts and the bonus token
    assert tokens[2, :3].tolist() == target[2, :3].tolist()  # two real drafts, then the argmax at row 2


def test_no_drafts_emit_the_targets_token():
    target = torch.randint(0, V, (2, 3))
    tokens, num = accept_drafts(target, target[:, :2], torch.tensor([0, 0]))
    assert num.tolist() == [1, 1] and tokens[:, 0].tolist() == target[:, 0].tolist()


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_sampled_tokens_follow_the_target_not_the_draft():
    torch.manual_seed(0)
    n = 40000  # requests of 2 drafts each: rows (p0, q0), (p1, q1), bonus p2
    target = torch.randn(3, V) * 1.5
    draft = torch.randn(2, V) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    p = filtered_probs(target, metadata([params] * 3))
    q = filtered_probs(draft, metadata([params] * 2))
    assert tv(q[0] * 1.0, p[0]) > 0.15  # the draft is far from the target: a sampler that kept drafts would fail
    proposals = torch.stack([torch.multinomial(q[0], n, replacement=True),
                             torch.multinomial(q[1], n, replacement=True)], dim=1)  # [n, 2]
    target_sampled = torch.multinomial(p.repeat(n, 1), 1).view(n, 3)  # the sampler's own draws
    tokens, num = accept_drafts(target_sampled, proposals, torch.full((n,), 2), sampled_rows=torch.ones(n, dtype=torch.bool),
                                target_probs=p.expand(n, 3, V), draft_probs=q.expand(n, 2, V))
    out = [row[:k] for row, k in zip(tokens.tolist(), num.tolist())]
    assert all(1 <= len(o) <= 3 for o in out)
    for position in range(3):
        emitted = torch.tensor([o[position] for o in out if len(o) > position])
        counts = torch.bincount(emitted, minlength=V).float()
        # Sampling noise of ~10k-40k draws over 5 tokens: TV ~0.005; the draft's own distribution is > 0.15 away.
        assert tv(counts, p[position]) < 0.02, (position, counts / counts.sum(), p[position])
        assert counts[p[position] == 0].sum() == 0  # nothing top-k removed
    # Acceptance is min(1, p/q) in expectation: sum_x min(p, q).
    expected = float(torch.minimum(p[0], q[0]).sum())
    assert abs(float((num >= 2).float().mean()) - expected) < 0.02


def test_one_hot_drafts_follow_the_target():
    """n-gram proposals come from no distribution: q is one-hot on the proposal, and the emitted
    tokens are still the target's samples."""
    torch.manual_seed(1)
    n = 40000
    p = torch.softmax(torch.randn(2, V), dim=-1)
    proposals = torch.full((n, 1), 3)
    sampled = torch.multinomial(p.repeat(n, 1), 1).view(n, 2)
    tokens, num = accept_drafts(sampled, proposals, torch.ones(n, dtype=torch.int64),
                                sampled_rows=torch.ones(n, dtype=torch.bool), target_probs=p.expand(n, 2, V),
                                draft_probs=torch.nn.functional.one_hot(proposals, V).float())
    first = torch.bincount(tokens[:, 0], minlength=V).float()
    assert tv(first, p[0]) < 0.02
    assert abs(float((num == 2).float().mean()) - float(p[0, 3])) < 0.02


def test_synthetic_acceptance_keeps_drafts_at_its_rate():
    torch.manual_seed(2)
    n, k = 20000, 4
    target = torch.randint(0, V, (n, k + 1))
    drafts = (target[:, :k] + 1) % V  # never the target's: without the synthetic rate none would be kept
    tokens, num = accept_drafts(target, drafts, torch.full((n,), k), synthetic_acceptance_rate=0.8)
    mean_tokens = float(num.float().mean())
    assert abs(mean_tokens - sum(0.8 ** i for i in range(k + 1))) < 0.03
    row = int((num == 3).nonzero()[0])  # two drafts kept, then the target's own token
    assert tokens[row, :3].tolist() == [*drafts[row, :2].tolist(), int(target[row, 2])]
