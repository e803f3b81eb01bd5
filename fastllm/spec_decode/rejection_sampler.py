"""Verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023), on the device.

A verify step gives each request K + 1 rows of target logits: row j is the target's distribution p_j
for the token after the request's j-th verify input (its newest token, then draft d_1..d_K). Only
the first num_drafts of a request's K drafts are real (fewer near its max_tokens or the token
budget); the rows past them are padding and never accepted.

- Greedy rows keep d_j while it is the target's argmax; the first mismatch is replaced by the argmax.
- Sampled rows keep d_j with probability min(1, p_j(d_j) / q_j(d_j)), q_j being the draft's
  distribution it was drawn from; the first rejected one is replaced by a draw from the residual
  max(0, p_j - q_j), so every emitted token is distributed as the target's own sample.
- With a synthetic acceptance rate (benchmarks only), d_j is kept with that probability whatever its
  value; a rejected position takes the target's own token.
When every real draft is kept, the request's row after them adds the target's own token. So a request
emits num_accepted + 1 tokens: tokens[:num_accepted + 1].
"""

from __future__ import annotations

import torch

from fastllm.layers.sampler import exponential_noise


def accept_drafts(
    target_tokens: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    *,
    sampled_rows: torch.Tensor | None = None,
    target_probs: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    synthetic_acceptance_rate: float | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_tokens [B, K + 1]: the target's own token at every verify row (the argmax on greedy rows,
    a draw from p elsewhere); drafts [B, K] int64; num_drafts [B] int64 (<= K).
    sampled_rows [B] bool: requests that sample (None: all greedy), with target_probs [B, K + 1, V] (p,
    after temperature / top-k / top-p / min-p) and draft_probs [B, K, V] (q), both float32.
    generators: request row -> its seeded generator, for the acceptance draws and the residual's.
    Returns (tokens [B, K + 1], num_tokens [B]): request b emits tokens[b, :num_tokens[b]]."""
    num_reqs, k = drafts.shape
    column = torch.arange(k, device=drafts.device)
    real = column < num_drafts.unsqueeze(1)
    draft_rows = target_tokens[:, :k]
    if synthetic_acceptance_rate is not None:
        accept = real & (torch.rand(num_reqs, k, device=drafts.device) < synthetic_acceptance_rate)
    else:
        accept = real & (drafts == draft_rows)
        if sampled_rows is not None:
            p_draft = target_probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
            q_draft = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
            uniform = _uniform(num_reqs, k, drafts.device, generators)
            accept = torch.where(sampled_rows.unsqueeze(1), real & (uniform * q_draft <= p_draft), accept)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    kept = column < num_accepted.unsqueeze(1)
    tokens = target_tokens.clone()
    tokens[:, :k] = torch.where(kept, drafts, draft_rows)
    if sampled_rows is not None and synthetic_acceptance_rate is None:
        residual = (target_probs[:, :k] - draft_probs).clamp_min_(0.0)
        noise = exponential_noise(residual.view(num_reqs * k, -1), _row_generators(generators, k)).view_as(residual)
        recovered = (residual / noise).argmax(dim=-1)
        first_rejected = (column == num_accepted.unsqueeze(1)) & real & sampled_rows.unsqueeze(1)
        tokens[:, :k] = torch.where(first_rejected, recovered, tokens[:, :k])
    return tokens, num_accepted + 1


def _uniform(rows: int, k: int, device: torch.device, generators: dict[int, torch.Generator] | None) -> torch.Tensor:
    uniform = torch.rand(rows, k, device=device)
    for row, generator in (generators or {}).items():
        uniform[row] = torch.rand(k, device=device, generator=generator)
    return uniform


def _row_generators(generators: dict[int, torch.Generator] | None, k: int) -> dict[int, torch.Generator]:
    """The generators of requests, as the generators of their K flattened residual rows."""
    return {row * k + j: g for row, g in (generators or {}).items() for j in range(k)}
