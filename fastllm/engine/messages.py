"""What the API process and the engine-core process send each other: msgspec structs, msgpack over ZeroMQ.

    API process -> core   EngineCoreRequest, BeamSearchRequest, Abort, UtilityCall, Shutdown
    core -> API process   EngineReady (once), StepOutputs (one per step with news), UtilityResult

A step's outputs travel as one message: every request's new token ids, finish reason and logprobs, so the
cost per message is paid once a step, not once a token. Requests carry token ids only: tokenization and
detokenization stay in the API process, which also names each request's EOS token (the core loads no
tokenizer). A beam search gives one output, when it ends: its beams, in the StepOutputs of that step.
The in-process LLMEngine passes the same EngineCoreOutput and BeamSearchResult structs from its
EngineCore to its OutputProcessor, without encoding them.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgspec

from fastllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

# (token logprob, rank, top-N (token id, logprob) pairs) of one sampled or prompt token
LogprobEntry = tuple[float, int, list[tuple[int, float]]]


class EngineCoreRequest(msgspec.Struct, array_like=True, tag="add"):
    """A validated request: its prompt as token ids, and SamplingParams' fields (rebuilt, and so checked
    again, by the core). The core forks n > 1 into samples named by sample_ids()."""

    request_id: str
    prompt_token_ids: list[int]
    eos_token_id: int | None  # the API process's tokenizer's (the core loads none)
    params: dict[str, Any]


class BeamSearchRequest(msgspec.Struct, array_like=True, tag="beam"):
    """A validated beam search: its prompt as token ids, and BeamSearchParams' fields (rebuilt, and so
    checked again, by the core). Its one output is a BeamSearchResult, when it ends."""

    request_id: str
    prompt_token_ids: list[int]
    eos_token_id: int | None
    params: dict[str, Any]


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    request_ids: list[str]  # requests (all their samples), beam searches, or single samples (a stop string)


class UtilityCall(msgspec.Struct, array_like=True, tag="call"):
    """Call EngineCore.<method>(*args) between steps; the answer is a UtilityResult with the same call_id."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


ClientMessage = EngineCoreRequest | BeamSearchRequest | Abort | UtilityCall | Shutdown


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sample's news from one step."""

    request_id: str  # the sample's id (the request's own when n == 1)
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id that ended it
    logprobs: list[LogprobEntry] | None = None  # one entry per new token, when asked for
    prompt_logprobs: tuple[int, list[LogprobEntry]] | None = None  # (first position, entries) of this step
    error: str | None = None  # why the sample failed (finish_reason "error")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True):
    """Queue depths and KV use after a step, and running totals (the server's /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_usage: float = 0.0
    num_steps: int = 0  # steps that computed something
    num_scheduled_requests: int = 0  # summed over those steps (/ num_steps: the mean batch)
    step_seconds: float = 0.0  # wall time of step() calls that computed something
    num_preemptions: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Of step_seconds: the wait for the GPU's tokens, and the stepping thread's CPU time (a spinning wait
    # counts as CPU): step_seconds - step_cpu_seconds is time the thread was off the CPU (descheduled).
    step_wait_seconds: float = 0.0
    step_cpu_seconds: float = 0.0
    # Steps that took over core.SLOW_STEP_SECONDS (each also logged), and the Triton kernels and
    # torch.compile graphs compiled during steps: in a warmed-up server both stay 0.
    num_slow_steps: int = 0
    num_compiles: int = 0


class BeamSearchResult(msgspec.Struct, array_like=True, omit_defaults=True):
    """A beam search's one output, when it ends: its beams best first, or why it failed (no beams)."""

    request_id: str
    beams: list[tuple[list[int], float, str]]  # (generated token ids, cumulative logprob, finish reason)
    error: str | None = None


class StepOutputs(msgspec.Struct, array_like=True, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    beam_searches: list[BeamSearchResult] = []  # those that ended in this step


class UtilityResult(msgspec.Struct, array_like=True, tag="result"):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineReady(msgspec.Struct, array_like=True, tag="ready"):
    """What the API process needs to validate without the model."""

    vocab_size: int
    max_model_len: int
    config_eos_token_id: int | None  # the model config's: EOS where the tokenizer names none
    max_num_seqs: int
    num_gpu_blocks: int


CoreMessage = StepOutputs | UtilityResult | EngineReady


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's samples: its own for n == 1, else request_id#0 .. request_id#(n-1)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """Its fields, and bad_words as token ids (the core has no tokenizer to spell them)."""
    values = {f.name: getattr(params, f.name) for f in fields(params) if f.init}
    values["bad_words_token_ids"] = params.bad_words_token_ids if params.bad_words else None
    return values


def params_from_wire(values: dict[str, Any]) -> SamplingParams:
    """SamplingParams from its fields, checked again (ValueError naming the field)."""
    values = dict(values)
    bad_words_token_ids = values.pop("bad_words_token_ids", None)
    if "output_kind" in values:
        try:
            values["output_kind"] = RequestOutputKind(values["output_kind"])
        except ValueError:
            raise ValueError("SamplingParams.output_kind must be a RequestOutputKind, got "
                             f"{values['output_kind']!r}")
    if isinstance(values.get("logit_bias"), dict):  # msgpack keeps int keys; be sure of it
        values["logit_bias"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                                for k, v in values["logit_bias"].items()}
    try:
        params = SamplingParams(**values)
    except TypeError as e:  # an unknown field
        raise ValueError(f"SamplingParams: {e}") from None
    if params.bad_words:
        ids = bad_words_token_ids
        if not (isinstance(ids, list) and all(isinstance(w, list) for w in ids)):
            raise ValueError("SamplingParams.bad_words came without their token ids")
        params._bad_words_token_ids = bad_words_token_ids
    return params


def beam_params_to_wire(params: BeamSearchParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in fields(params)}


def beam_params_from_wire(values: dict[str, Any]) -> BeamSearchParams:
    """BeamSearchParams from its fields, checked again (ValueError naming the field)."""
    try:
        return BeamSearchParams(**values)
    except TypeError as e:  # an unknown field
        raise ValueError(f"BeamSearchParams: {e}") from None
