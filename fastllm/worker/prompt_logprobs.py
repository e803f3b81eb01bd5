"""Logprobs of the prompt's own tokens (SamplingParams.prompt_logprobs): for each prompt position a
step computes, the model's log-probability of the prompt token that follows it, its rank and the
top-N alternatives. Computed from the step's hidden states, so the steps that carry such a request
run without a CUDA graph and wait for these numbers on the host.
"""

from __future__ import annotations

import itertools

import torch

# req id -> (position of the first entry's predicted token, [(logprob, rank, [(token id, logprob)] top-N)])
PromptLogprobs = dict[str, tuple[int, list[tuple[float, int, list[tuple[int, float]]]]]]


def wants_prompt_logprobs(state, start: int) -> bool:
    """Whether a step from position `start` still has prompt tokens to score for this request."""
    return state.sampling_params.prompt_logprobs is not None and start + 1 < len(state.prompt_token_ids)


def compute_prompt_logprobs(model, hidden: torch.Tensor, states, starts: list[int],
                            num_scheduled: list[int]) -> PromptLogprobs:
    """hidden: the step's flat hidden states, request i's num_scheduled[i] rows from position
    starts[i] (drafted tokens, which only follow the prompt, excluded by the bound below)."""
    rows, targets, spans = [], [], []
    for state, start, count, first_row in zip(states, starts, num_scheduled,
                                              itertools.accumulate([0, *num_scheduled])):
        if not wants_prompt_logprobs(state, start):
            continue
        prompt = state.prompt_token_ids
        end = min(start + count, len(prompt) - 1)  # position p scores prompt token p + 1
        if end <= start:
            continue
        spans.append((state, start, len(rows), end - start))
        rows.extend(range(first_row, first_row + end - start))
        targets.extend(prompt[start + 1:end + 1])
    if not rows:
        return {}
    device = hidden.device
    logprobs = torch.log_softmax(model.compute_logits(hidden[torch.as_tensor(rows, device=device)]).float(), dim=-1)
    target = torch.as_tensor(targets, device=device).unsqueeze(1)
    token_logprob = logprobs.gather(1, target)
    rank = (logprobs > token_logprob).sum(dim=1) + 1
    num_top = max(s.sampling_params.prompt_logprobs for s, *_ in spans)
    top = logprobs.topk(num_top, dim=1) if num_top else None
    token_logprob, rank = token_logprob.squeeze(1).tolist(), rank.tolist()
    top_ids, top_vals = (top.indices.tolist(), top.values.tolist()) if top is not None else ([[]] * len(rows),) * 2
    out: PromptLogprobs = {}
    for state, start, offset, n in spans:
        num = state.sampling_params.prompt_logprobs
        out[state.req_id] = (start + 1, [
            (token_logprob[r], rank[r], list(zip(top_ids[r][:num], top_vals[r][:num])))
            for r in range(offset, offset + n)])
    return out
