"""BeamSearch: one prompt's beams, ranked, finished and pruned by Hugging Face transformers' rules
(BeamSearchParams spells them out). Pure Python: the policy only.

The scheduler owns the beams: each is a Request that computes one position a step and reports its
top 2 * beam_width next-token logprobs here. Once every running beam has reported, advance() picks
the (beam, token) pairs that run on; the scheduler continues a beam in place when its pair's token is the
one its step sampled (its argmax), forks a request for each other pair (sharing the parent's KV blocks, copy-on-write on the last partial one)
and frees the parents that do not go on, so a pruned beam's blocks go back at once and a beam width of
4 holds about one prompt's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastllm.engine.request import Request
from fastllm.sampling_params import BeamSearchParams


def beam_score(cum_logprob: float, num_generated: int, length_penalty: float) -> float:
    """transformers' score of a finished beam (num_generated counts the EOS that ended it)."""
    return cum_logprob / num_generated ** length_penalty


@dataclass
class FinishedBeam:
    token_ids: list[int]  # the generated tokens, the EOS that ended it included
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class Continuation:
    parent: Request
    token: int
    cum_logprob: float


class BeamSearch:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_id: int | None, max_tokens: int):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_id = None if params.ignore_eos else eos_token_id
        self.max_tokens = max_tokens  # params.max_tokens, or less where max_model_len is nearer
        self.beams: list[Request] = []  # running, best first
        self.cum_logprobs: list[float] = []
        self.finished: list[FinishedBeam] = []  # best first, at most beam_width
        self.num_generated = 0  # tokens each running beam has generated
        self.done = False
        self._reports: dict[str, list[tuple[int, float]]] = {}  # beam id -> its top (token, logprob) pairs
        self._may_improve = True  # transformers' early-stop heuristic: False once no beam can beat the kept ones
        self._num_forks = 0

    def set_beams(self, beams: list[Request], cum_logprobs: list[float]) -> None:
        self.beams, self.cum_logprobs = beams, cum_logprobs

    def next_beam_id(self) -> str:
        self._num_forks += 1
        return f"{self.request_id}#beam{self._num_forks}"

    def report(self, beam: Request, top: list[tuple[int, float]]) -> bool:
        """A beam's top 2 * beam_width next tokens (descending logprob); True once every beam reported."""
        self._reports[beam.request_id] = top
        return len(self._reports) == len(self.beams)

    def has_reported(self, beam: Request) -> bool:
        """Whether the beam's top tokens for this position are in (nothing to compute until advance)."""
        return beam.request_id in self._reports

    def advance(self) -> list[Continuation]:
        """One position of every beam: update the finished hypotheses and return the beams that run on
        (best first; none once the search is done)."""
        candidates = sorted(
            ((cum + logprob, i, token) for i, (beam, cum) in enumerate(zip(self.beams, self.cum_logprobs))
             for token, logprob in self._reports.pop(beam.request_id)),
            key=lambda c: -c[0])[:2 * self.params.beam_width]
        return self.advance_ranked(candidates)

    def advance_ranked(self, candidates: list[tuple[float, int, int]]) -> list[Continuation]:
        """advance() from the ranked candidates: the best 2 * beam_width (cum logprob, beam index, token), best
        first, ties in beam then rank order (a run-ahead step's device ranks them so, core/beam_run_ahead.py)."""
        width, penalty = self.params.beam_width, self.params.length_penalty
        length = self.num_generated + 1  # of every candidate
        ends = [token == self.eos_token_id or length >= self.max_tokens for _, _, token in candidates]
        if self._may_improve and not (self.params.early_stopping is True and len(self.finished) == width):
            new = [FinishedBeam(self.beams[i].output_token_ids + [token], cum, beam_score(cum, length, penalty),
                                "stop" if token == self.eos_token_id else "length")
                   for (cum, i, token), end in zip(candidates[:width], ends) if end]
            self.finished = sorted(self.finished + new, key=lambda f: -f.score)[:width]
        running = [Continuation(self.beams[i], token, cum) for (cum, i, token), end in zip(candidates, ends)
                   if not end][:width]
        self.num_generated = length
        if self._may_improve and len(self.finished) == width and running:
            best_length = self.max_tokens if self.params.early_stopping == "never" and penalty > 0 else length
            self._may_improve = beam_score(running[0].cum_logprob, best_length, penalty) > self.finished[-1].score
        full = self.params.early_stopping is True and len(self.finished) == width
        self.done = not self._may_improve or full or all(ends)
        return [] if self.done else running

