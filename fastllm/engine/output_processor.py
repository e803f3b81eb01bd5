"""Turns each step's EngineCoreOutputs into RequestOutputs: text, stop strings, logprobs, finish reasons.

Samples of one request (n > 1) are grouped back into one RequestOutput; a beam search's one result becomes
one RequestOutput with a CompletionOutput per beam. Runs where the tokenizer is: in
the LLMEngine's process offline, in the API process when serving (the engine core sends token ids only).
Streamed text (DELTA and CUMULATIVE outputs) leaves out the tail that could still become a stop string
until it no longer can or the sample ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from fastllm.engine.detokenizer import IncrementalDetokenizer, render_token
from fastllm.engine.messages import BeamSearchResult, EngineCoreOutput, sample_ids
from fastllm.outputs import CompletionOutput, Logprob, RequestOutput
from fastllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampleState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    output: CompletionOutput
    sent_tokens: int = 0  # for DELTA outputs: what the last output already carried
    sent_text: int = 0


@dataclass(slots=True)
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    samples: dict[str, SampleState] = field(default_factory=dict)  # sample id -> state
    prompt_logprobs: list | None = None  # [None, then one dict per scored prompt token]
    error: str | None = None
    arrival_time: float = 0.0  # time.perf_counter() when it was added
    first_token_time: float | None = None  # when the first sample got its first token

    @property
    def finished(self) -> bool:
        for sample in self.samples.values():
            if sample.output.finish_reason is None:
                return False
        return True

    def to_output(self, finished: bool) -> RequestOutput:
        samples = self.samples.values()  # in index order: add_group inserts them so
        if self.output_kind == RequestOutputKind.DELTA:
            outputs = [_delta(s) for s in samples]
        elif self.output_kind == RequestOutputKind.FINAL_ONLY and finished:
            outputs = [s.output for s in samples]  # the group is dropped: nothing mutates them again
        else:
            outputs = [_copy(s) for s in samples]
        metrics = {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time}
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished, metrics,
                             prompt_logprobs=self.prompt_logprobs, error=self.error)


def _shown(s: SampleState) -> int:
    """How much of the text may be shown: all of it once the sample ends, else all but the held tail."""
    text = s.output.text
    if s.detokenizer is None or s.output.finish_reason is not None:
        return len(text)
    return len(text) - s.detokenizer.held


def _copy(s: SampleState) -> CompletionOutput:
    o = s.output
    return CompletionOutput(o.index, o.text[:_shown(s)], list(o.token_ids), o.cumulative_logprob,
                            list(o.logprobs) if o.logprobs is not None else None, o.finish_reason, o.stop_reason)


def _delta(s: SampleState) -> CompletionOutput:
    o = s.output
    shown = _shown(s)
    delta = CompletionOutput(o.index, o.text[s.sent_text:shown], o.token_ids[s.sent_tokens:],
                             o.cumulative_logprob,
                             o.logprobs[s.sent_tokens:] if o.logprobs is not None else None,
                             o.finish_reason, o.stop_reason)
    s.sent_tokens, s.sent_text = len(o.token_ids), shown
    return delta


@dataclass(slots=True)
class BeamSearchPrompt:
    """What a beam search's output needs besides its beams."""

    prompt: str | None
    prompt_token_ids: list[int]
    num_beams: int | None  # how many of the best beams to output (None: all)
    skip_special_tokens: bool


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self.group_of: dict[str, RequestGroup] = {}  # sample id -> its group
        self.beam_searches: dict[str, BeamSearchPrompt] = {}  # by request id, until their result comes

    def add_group(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                  params: SamplingParams) -> None:
        group = RequestGroup(request_id, prompt, prompt_token_ids, params.output_kind,
                             arrival_time=time.perf_counter())
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for index, sample_id in enumerate(sample_ids(request_id, params.n)):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                               params.stop_strings, params.include_stop_str_in_output,
                                               params.min_tokens)
            output = CompletionOutput(index, "", [], 0.0 if params.logprobs is not None else None,
                                      [] if params.logprobs is not None else None)
            group.samples[sample_id] = SampleState(index, detok, output)
            self.group_of[sample_id] = group
        self.groups[request_id] = group

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """A step's outputs -> the RequestOutputs of the groups that changed, and the sample ids the
        engine core must stop: a stop string ended them (the tokens after it are not output), or a
        sibling failed."""
        stopped: list[str] = []
        touched: dict[str, RequestGroup] = {}
        for core_out in core_outputs:
            group = self.group_of.get(core_out.request_id)
            if group is None:
                group = self.groups.get(core_out.request_id)  # a whole request the core refused
                if group is None or core_out.error is None:
                    continue
                stopped += self._fail_group(group, core_out.error)
                touched[group.request_id] = group
                continue
            try:
                self._add_sample_output(group, core_out, stopped)
            except Exception as e:  # this request's text or logprobs: it fails, the step's others go on
                logger.exception("request %s: its output failed; failing the request", group.request_id)
                stopped += self._fail_group(group, f"output processing failed: {type(e).__name__}: {e}")
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            finished = group.finished
            if group.output_kind != RequestOutputKind.FINAL_ONLY or finished:
                outputs.append(group.to_output(finished))
            if finished:
                self._drop(group)
        return outputs, stopped

    def _add_sample_output(self, group: RequestGroup, core_out: EngineCoreOutput, stopped: list[str]) -> None:
        sample = group.samples[core_out.request_id]
        out = sample.output
        if core_out.prompt_logprobs is not None:
            self._add_prompt_logprobs(group, core_out.request_id, *core_out.prompt_logprobs)
        if out.finish_reason is not None:  # ended already (a stop string, a failure): the rest is dropped
            return
        if group.first_token_time is None and core_out.new_token_ids:
            group.first_token_time = time.perf_counter()
        if sample.detokenizer is None and out.logprobs is None:  # token ids only (no tokenizer)
            out.token_ids += core_out.new_token_ids
            if core_out.finish_reason is not None:
                out.finish_reason, out.stop_reason = core_out.finish_reason, core_out.stop_reason
        else:
            self._add_tokens(sample, core_out, stopped)
        if core_out.error is not None:  # its siblings end with it
            stopped += self._fail_group(group, core_out.error)

    def _add_tokens(self, sample: SampleState, core_out: EngineCoreOutput, stopped: list[str]) -> None:
        out, detok = sample.output, sample.detokenizer
        tokens, logprobs = core_out.new_token_ids, core_out.logprobs
        for i, token in enumerate(tokens):
            out.token_ids.append(token)
            entry = logprobs[i] if logprobs is not None and out.logprobs is not None else None
            if entry is not None:  # its alternatives are rendered after the tokens before it
                out.logprobs.append(self._logprob_dict(token, entry, detok))
                out.cumulative_logprob += entry[0]
            if detok is not None:
                hit = detok.add_token(token)
                out.text = detok.text
                if entry is not None and token in out.logprobs[-1]:
                    out.logprobs[-1][token].decoded_token = detok.last_piece
                if hit is not None:  # it wins over the core's length or stop token on the same token
                    out.finish_reason, out.stop_reason = "stop", hit
                    if core_out.finish_reason is None:
                        stopped.append(core_out.request_id)
                    return
        if core_out.finish_reason is not None:
            out.finish_reason, out.stop_reason = core_out.finish_reason, core_out.stop_reason

    def _fail_group(self, group: RequestGroup, error: str) -> list[str]:
        """End every sample of the group with the error; returns those the core still runs."""
        group.error = error
        running = []
        for sample_id, sample in group.samples.items():
            if sample.output.finish_reason is None:
                sample.output.finish_reason = "error"
                running.append(sample_id)
        return running

    def add_beam_search(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                        num_beams: int | None = None, skip_special_tokens: bool = True) -> None:
        self.beam_searches[request_id] = BeamSearchPrompt(prompt, prompt_token_ids, num_beams,
                                                          skip_special_tokens)

    def process_beam_searches(self, results: list[BeamSearchResult]) -> list[RequestOutput]:
        """The finished RequestOutputs of beam searches that ended: a CompletionOutput per beam, best first
        (each beam's text as a sample with its tokens would read), or the error that ended the search."""
        outputs = []
        for result in results:
            search = self.beam_searches.pop(result.request_id, None)
            if search is None:  # aborted
                continue
            beams = []
            for index, (token_ids, cum_logprob, finish_reason) in enumerate(result.beams[:search.num_beams]):
                text = ""
                if self.tokenizer is not None:
                    detok = IncrementalDetokenizer(self.tokenizer, search.prompt_token_ids,
                                                   search.skip_special_tokens, [])
                    for token in token_ids:
                        detok.add_token(token)
                    text = detok.text
                beams.append(CompletionOutput(index, text, token_ids, cum_logprob, None, finish_reason))
            outputs.append(RequestOutput(result.request_id, search.prompt, search.prompt_token_ids, beams,
                                         True, error=result.error))
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        self.beam_searches.pop(request_id, None)
        group = self.groups.get(request_id)
        if group is None:
            return None
        for sample in group.samples.values():
            if sample.output.finish_reason is None:
                sample.output.finish_reason = "abort"
        self._drop(group)
        return group.to_output(True)

    def _drop(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for sample_id in group.samples:
            self.group_of.pop(sample_id, None)

    def _add_prompt_logprobs(self, group: RequestGroup, sample_id: str, position: int, entries: list) -> None:
        """Entries for the prompt tokens from `position` on, from the group's first sample; a prompt
        computed again (preemption) does not add them twice."""
        if group.prompt_logprobs is None or next(iter(group.samples)) != sample_id:
            return
        scored, prompt = group.prompt_logprobs, group.prompt_token_ids
        for offset, entry in enumerate(entries):
            p = position + offset
            if p == len(scored):
                context = prompt[max(0, p - 6):p]
                scored.append(self._logprob_dict(prompt[p], entry, None, context))

    def _logprob_dict(self, token: int, entry, detok: IncrementalDetokenizer | None,
                      context: list[int] | None = None) -> dict[int, Logprob]:
        """token id -> Logprob for the top-N and the chosen token, each token's string as it renders
        after the tokens before it (the chosen one's is set again from the detokenizer once added)."""
        token_logprob, rank, top = entry
        tok = self.tokenizer
        if tok is None:
            render = lambda t: None  # noqa: E731
        elif detok is not None:
            render = detok.render
        else:
            render = lambda t: render_token(tok, context, t)  # noqa: E731
        step = {tid: Logprob(lp, r + 1, render(tid)) for r, (tid, lp) in enumerate(top)}
        if token not in step:
            step[token] = Logprob(token_logprob, rank, render(token))
        return step
