"""The rejection sampler: greedy rows keep the drafts the argmax agrees with; sampled rows emit
tokens distributed as the target's own samples, whatever the draft proposed (checked by counting)."""

from __future__ import annotations

import torch

from fastllm.layers.sampler import SamplingMetadata, SamplingRow
from fastllm.sampling_params import SamplingParams
from fastllm.spec_decode.rejection_sampler import accepted_tokens, rejection_sample

V = 6


def metadata(params: list[SamplingParams]) -> SamplingMetadata:
    return SamplingMetadata.build([SamplingRow(p, None, [], [], None) for p in params], V, torch.device("cpu"))


def test_greedy_keeps_the_drafts_up_to_the_first_mismatch():
    logits = torch.randn(7, V)
    argmax = logits.argmax(-1)
    # Request 0: 3 drafts (rows 0-3), the second wrong; request 1: 2 drafts (rows 4-6), both right.
    drafts = [[int(argmax[0]), (int(argmax[1]) + 1) % V, int(argmax[2])], [int(argmax[4]), int(argmax[5])]]
    draft_ids = torch.tensor([*drafts[0], -1, *drafts[1], -1])
    meta = metadata([SamplingParams(temperature=0)] * 7)
    accepted, token = rejection_sample(logits, meta, argmax, draft_ids, None)
    assert accepted.tolist() == [True, False, True, False, True, True, False]
    out = accepted_tokens(accepted.tolist(), token.tolist(), drafts)
    assert out == [[int(argmax[0]), int(argmax[1])], [int(argmax[4]), int(argmax[5]), int(argmax[6])]]


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_sampled_tokens_follow_the_target_not_the_draft():
    torch.manual_seed(0)
    n = 40000  # requests of 2 drafts each: rows 3i (p0, q0), 3i+1 (p1, q1), 3i+2 (bonus p2)
    target = torch.randn(3, V) * 1.5
    draft = torch.randn(2, V) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    meta = metadata([params] * (3 * n))
    from fastllm.layers.sampler import filtered_probs
    p = filtered_probs(target, metadata([params] * 3))
    q = filtered_probs(draft, metadata([params] * 2))
    assert tv(q[0] * 1.0, p[0]) > 0.15  # the draft is far from the target: a sampler that kept drafts would fail
    logits = target.repeat(n, 1)
    draft_probs = torch.cat([q, torch.zeros(1, V)]).repeat(n, 1)
    proposals = torch.stack([torch.multinomial(q[0], n, replacement=True),
                             torch.multinomial(q[1], n, replacement=True)], dim=1)  # [n, 2]
    draft_ids = torch.cat([proposals, torch.full((n, 1), -1)], dim=1).flatten()
    target_sampled = torch.multinomial(p[torch.arange(3).repeat(n)], 1).squeeze(1)  # the sampler's own draws
    accepted, token = rejection_sample(logits, meta, target_sampled, draft_ids, draft_probs)
    out = accepted_tokens(accepted.tolist(), token.tolist(), proposals.tolist())
    assert all(1 <= len(o) <= 3 for o in out)
    for position in range(3):
        emitted = torch.tensor([o[position] for o in out if len(o) > position])
        counts = torch.bincount(emitted, minlength=V).float()
        # Sampling noise of ~10k-40k draws over 5 tokens: TV ~0.005; the draft's own distribution is > 0.15 away.
        assert tv(counts, p[position]) < 0.02, (position, counts / counts.sum(), p[position])
        assert counts[p[position] == 0].sum() == 0  # nothing top-k removed
    # Acceptance is min(1, p/q) in expectation: sum_x min(p, q).
    expected = float(torch.minimum(p[0], q[0]).sum())
    assert abs(float(accepted.view(n, 3)[:, 0].float().mean()) - expected) < 0.02
