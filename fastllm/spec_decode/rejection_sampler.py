"""Rejection sampling of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

Each speculating request has n draft tokens and n + 1 rows of target logits: row j is the target's
distribution p_j for the token after the j-th input of the verified run, where draft token s_j was
drawn from the draft's q_j. s_j is kept with probability min(1, p_j(s_j) / q_j(s_j)); at the first
rejection the token is drawn from the residual max(0, p_j - q_j) instead and the rest are dropped;
when all n are kept, row n's draw from p_n is added. The tokens are then distributed exactly as the
target's own samples. Greedy requests are the one-hot case: s_j is kept while it is the target's
argmax, and the first mismatch is replaced by the argmax.

Everything stays on the device until one copy of two [R] tensors at the end.
"""

from __future__ import annotations

import torch

from fastllm.layers.sampler import SamplingMetadata, exponential_noise, filtered_probs


def rejection_sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    target_sampled: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the verified run.

    logits [R, V]: the target's, one row per verified position; metadata: each request's params on
    each of its rows; target_sampled [R]: the sampler's token for each row (argmax on greedy rows, a
    draw from p elsewhere); draft_token_ids [R] int64: the draft token that follows each row, -1 where
    none does (each request's last row); draft_probs [R, V] float32: q on the rows of sampled (not
    greedy) draft tokens, or None when every request is greedy.

    Returns (accepted [R] bool, token [R] int64): whether the row's draft token is kept, and the
    token to emit at the row when it is the first one not kept (the residual draw, or on a last row
    the target's own sample).
    """
    has_draft = draft_token_ids >= 0
    draft = draft_token_ids.clamp_min(0)
    accepted = has_draft & (draft == target_sampled)  # greedy rows; sampled rows are replaced below
    token = target_sampled
    if metadata.all_greedy:
        return accepted, token
    p = filtered_probs(logits.float(), metadata)
    rows = torch.arange(len(draft), device=draft.device)
    p_draft = p[rows, draft]
    q_draft = draft_probs[rows, draft]
    uniform = torch.rand(len(draft), device=draft.device)
    sampled_rows = has_draft & ~metadata.greedy
    accepted = torch.where(sampled_rows, p_draft >= uniform * q_draft, accepted)
    residual = (p - draft_probs).clamp_min_(0.0)
    recovered = (residual / exponential_noise(residual, {})).argmax(dim=-1)
    token = torch.where(sampled_rows, recovered, target_sampled)
    return accepted, token


def accepted_tokens(accepted: list[bool], token: list[int], draft_tokens: list[list[int]]) -> list[list[int]]:
    """Host side: each request's output tokens from the per-row results, its rows taken in order
    (len(draft_tokens[i]) + 1 rows for request i)."""
    out, row = [], 0
    for drafts in draft_tokens:
        n = 0
        while n < len(drafts) and accepted[row + n]:
            n += 1
        out.append(drafts[:n] + [token[row + n]])
        row += len(drafts) + 1
    return out
