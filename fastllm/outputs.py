"""What users get back: RequestOutput with one CompletionOutput per sample (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt token, as SampleLogprobs; None for the first, which nothing predicts.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs
    error: str | None = None  # why it failed (its samples' finish_reason is then "error")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam of LLM.beam_search, as vLLM's: tokens and text of the whole sequence, prompt included."""

    tokens: list[int]
    text: str | None
    cum_logprob: float  # the sum of the generated tokens' logprobs
    score: float  # what the beams are ranked by: cum_logprob / num_generated ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best score first
    error: str | None = None  # why the search failed (a step it was in failed): then it has no sequences
