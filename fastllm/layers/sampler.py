"""Sampler: logits [B, V] -> one token per row, with the per-request SamplingParams.

Order (vLLM's): allowed_token_ids, bad_words, min_tokens masking and logit_bias, then penalties,
then (rows that are not greedy) temperature, min-p, top-k, top-p, and a draw. The draw is argmax(probs / q) with q ~ Exp(1), which samples from probs
without a host sync; a row with a seed draws q from its own generator, so its samples do not
depend on what else is in the batch. Logprobs are those of the model (before penalties and
temperature), as in vLLM.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from fastllm.kernels import dispatch as kernels
from fastllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class SamplingRow:
    """What the sampler needs about one request this step."""

    params: SamplingParams
    generator: torch.Generator | None  # set when params.seed is given
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    num_pending: int = 0  # output tokens sampled but not yet in output_token_ids (async scheduling)


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [B] float32, 1.0 on greedy rows; None when all rows are greedy
    greedy: torch.Tensor | None  # [B] bool; None when all rows are greedy
    top_k: torch.Tensor | None  # [B] int64, vocab size where off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    all_greedy: bool
    generators: dict[int, torch.Generator]  # row -> its seeded generator
    penalty_rows: list[tuple[int, SamplingParams, list[int], list[int]]]  # (row, params, prompt, output)
    banned: list[tuple[int, list[int]]]  # (row, token ids masked because min_tokens is not reached)
    max_num_logprobs: int | None  # None: no row wants logprobs
    logprob_rows: list[int] = field(default_factory=list)
    # Rows with SamplingParams.has_logits_filters: (row, params, output token ids)
    filter_rows: list[tuple[int, SamplingParams, list[int]]] = field(default_factory=list)
    # Every row is a beam search's step (SamplingParams._beam_step): greedy, nothing masked, and only its top
    # max_num_logprobs logprobs are read (no sampled token's logprob or rank)
    beam_steps: bool = False

    @property
    def argmax_only(self) -> bool:
        """Sampling is the argmax of the logits (greedy rows, no logprobs, nothing masked, biased or penalized)."""
        return self.all_greedy and self.max_num_logprobs is None and not (self.penalty_rows or self.banned
                                                                            or self.filter_rows)

    @classmethod
    def argmax_rows(cls) -> "SamplingMetadata":
        """For a batch whose every row's params are argmax_only (the common benchmark case)."""
        return cls(temperature=None, greedy=None, top_k=None, top_p=None, min_p=None, all_greedy=True,
                   generators={}, penalty_rows=[], banned=[], max_num_logprobs=None)

    @classmethod
    def beam_rows(cls, num_rows: int, num_logprobs: int) -> "SamplingMetadata":
        """For a batch of beam search steps only (no per-row records to build)."""
        return cls(temperature=None, greedy=None, top_k=None, top_p=None, min_p=None, all_greedy=True,
                   generators={}, penalty_rows=[], banned=[], max_num_logprobs=num_logprobs,
                   logprob_rows=list(range(num_rows)), beam_steps=True)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingMetadata":
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        banned = []
        for i, r in enumerate(rows):
            if r.params.min_tokens and len(r.output_token_ids) + r.num_pending < r.params.min_tokens:
                ids = list(r.params.stop_token_ids)
                if r.eos_token_id is not None and not r.params.ignore_eos:
                    ids.append(r.eos_token_id)
                if ids:
                    banned.append((i, ids))
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        metadata = cls(
            temperature=None, greedy=None, top_k=None, top_p=None, min_p=None,
            all_greedy=all_greedy,
            generators={},
            penalty_rows=[(i, r.params, r.prompt_token_ids, r.output_token_ids)
                          for i, r in enumerate(rows) if r.params.has_penalties],
            banned=banned,
            max_num_logprobs=max((params[i].logprobs for i in logprob_rows), default=None),
            logprob_rows=logprob_rows,
            filter_rows=[(i, r.params, r.output_token_ids) for i, r in enumerate(rows) if r.params.has_logits_filters],
        )
        if all_greedy:  # the common benchmark case: no per-row tensors to build or copy
            return metadata

        def column(values, default, dtype):
            if all(v == default for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        metadata.temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                            dtype=torch.float32, device=device)
        metadata.greedy = torch.tensor(greedy, dtype=torch.bool, device=device)
        metadata.top_k = column([p.top_k if p.top_k and not g else vocab_size for p, g in zip(params, greedy)],
                                vocab_size, torch.int64)
        metadata.top_p = column([1.0 if g else p.top_p for p, g in zip(params, greedy)], 1.0, torch.float32)
        metadata.min_p = column([0.0 if g else p.min_p for p, g in zip(params, greedy)], 0.0, torch.float32)
        metadata.generators = {i: r.generator for i, r in enumerate(rows) if r.generator is not None and not greedy[i]}
        return metadata


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    # For rows that asked: sampled token logprob [B], its rank [B], top-N ids [B, N], top-N logprobs [B, N];
    # for beam steps (SamplingMetadata.beam_steps) only the last two
    logprobs: tuple[torch.Tensor, ...] | None = None


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.argmax_only:
            return SamplerOutput(kernels.argmax(logits))  # in the model's dtype: the same argmax as in fp32
        if metadata.beam_steps:
            return beam_step_candidates(logits, metadata.max_num_logprobs)
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if metadata.max_num_logprobs is not None else None
        logits = process_logits(logits, metadata)
        sampled = kernels.argmax(logits)
        if not metadata.all_greedy:
            probs = filtered_probs(logits, metadata)
            drawn = (probs / exponential_noise(probs, metadata.generators)).argmax(dim=-1)
            sampled = torch.where(metadata.greedy, sampled, drawn)
        out = SamplerOutput(sampled)
        if raw_logprobs is not None:
            out.logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return out


def beam_step_candidates(logits: torch.Tensor, num: int) -> SamplerOutput:
    """Beam search steps: each row's top `num` raw logprobs (the search's candidates) and, as its sampled
    token, the first of them (its argmax): the fewest kernels and copies to the host, as every beam step waits
    for them."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(num, dim=-1)
    return SamplerOutput(top.indices[:, 0], (top.indices, top.values))


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Everything before temperature: the logits filters, then the penalties (vLLM's order)."""
    return apply_penalties(apply_logits_filters(logits, metadata), metadata)


def apply_logits_filters(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, bad_words, the min_tokens mask and logit_bias, in vLLM's order (a copy of
    logits when any applies). A bad word's last token is masked when the output so far ends with the
    rest of it (a one-token word: always), except where the longer words would mask every allowed token
    left: a row with nothing to sample would draw token 0 (the engine refuses the other such requests,
    InputProcessor.check_something_to_sample)."""
    if not metadata.filter_rows and not metadata.banned:
        return logits
    logits = logits.clone()
    banned = dict(metadata.banned)
    for row, params, output in metadata.filter_rows:
        x = logits[row]
        if params.allowed_token_ids is not None:
            keep = torch.zeros_like(x, dtype=torch.bool)
            keep[torch.tensor(params.allowed_token_ids, device=x.device)] = True
            x.masked_fill_(~keep, float("-inf"))
        words = [word for word in params.bad_words_token_ids
                 if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1]]
        if params.allowed_token_ids is not None and any(len(word) > 1 for word in words) and \
                {word[-1] for word in words}.union(banned.get(row, ())).issuperset(params.allowed_token_ids):
            _skipped_bad_words()
            words = [word for word in words if len(word) == 1]
        for word in words:
            x[word[-1]] = float("-inf")
    for row, ids in banned.items():
        logits[row, ids] = float("-inf")
    for row, params, _ in metadata.filter_rows:
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=logits.device)
            logits[row, ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype,
                                             device=logits.device)
    return logits


@functools.cache
def _skipped_bad_words() -> None:
    logger.warning("a request's bad_words would mask every token its allowed_token_ids leave: its words of "
                   "more than one token are not applied at such steps (logged once)")


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties."""
    if not metadata.penalty_rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for row, params, prompt, output in metadata.penalty_rows:
        out_ids = torch.tensor(output, dtype=torch.int64, device=logits.device)
        counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(prompt, dtype=torch.int64, device=logits.device)] = True
            x = logits[row]
            penalized = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
            logits[row] = torch.where(seen, penalized, x)
        logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Softmax after temperature, min-p, top-k and top-p (masked tokens get probability 0)."""
    logits = logits / metadata.temperature.unsqueeze(1)
    if metadata.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = metadata.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if metadata.top_k is not None or metadata.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if metadata.top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            mask |= ranks.unsqueeze(0) >= metadata.top_k.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        if metadata.top_p is not None:
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token once the tokens before it already cover top_p (the first always stays).
            mask |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > metadata.top_p.unsqueeze(1)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(mask, float("-inf")))
    return torch.softmax(logits, dim=-1)


def exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    q = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # An Exp(1) draw of exactly 0 would turn 0/0 into NaN, which argmax prefers.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, num: int):
    token_logprob = logprobs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    rank = (logprobs > token_logprob.unsqueeze(-1)).sum(dim=-1) + 1
    top = logprobs.topk(num, dim=-1) if num > 0 else None
    top_ids = top.indices if top is not None else sampled.new_empty(sampled.shape[0], 0)
    top_vals = top.values if top is not None else logprobs.new_empty(sampled.shape[0], 0)
    return token_logprob, rank, top_ids, top_vals
