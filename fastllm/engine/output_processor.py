"""Turns each step's sampled tokens into RequestOutputs: text, logprobs, finish reasons.

Samples of one request (n > 1) are grouped back into one RequestOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastllm.engine.detokenizer import IncrementalDetokenizer
from fastllm.engine.request import Request
from fastllm.outputs import CompletionOutput, Logprob, RequestOutput
from fastllm.sampling_params import RequestOutputKind


@dataclass
class SampleState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    output: CompletionOutput
    sent_tokens: int = 0  # for DELTA outputs: what the last output already carried
    sent_text: int = 0


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    samples: dict[str, SampleState] = field(default_factory=dict)  # child request id -> state
    prompt_logprobs: list | None = None  # [None, then one dict per scored prompt token]

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
            outputs = [_copy(s.output) for s in samples]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished,
                             prompt_logprobs=self.prompt_logprobs)


def _copy(o: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(o.index, o.text, list(o.token_ids), o.cumulative_logprob,
                            list(o.logprobs) if o.logprobs is not None else None, o.finish_reason, o.stop_reason)


def _delta(s: SampleState) -> CompletionOutput:
    o = s.output
    delta = CompletionOutput(o.index, o.text[s.sent_text:], o.token_ids[s.sent_tokens:], o.cumulative_logprob,
                             o.logprobs[s.sent_tokens:] if o.logprobs is not None else None,
                             o.finish_reason, o.stop_reason)
    s.sent_tokens, s.sent_text = len(o.token_ids), len(o.text)
    return delta


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self.group_of: dict[str, RequestGroup] = {}  # child request id -> its group

    def add_group(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], children: list[Request]):
        group = RequestGroup(request_id, prompt, prompt_token_ids, children[0].sampling_params.output_kind)
        if children[0].sampling_params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for index, child in enumerate(children):
            params = child.sampling_params
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                               params.stop_strings, params.include_stop_str_in_output)
            output = CompletionOutput(index, "", [], 0.0 if params.logprobs is not None else None,
                                      [] if params.logprobs is not None else None)
            group.samples[child.request_id] = SampleState(index, detok, output)
            self.group_of[child.request_id] = group
        self.groups[request_id] = group

    def child_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return list(group.samples) if group else []

    def process(self, updated: list[tuple[Request, list[int]]], logprobs: dict,
                prompt_logprobs: dict | None = None) -> tuple[list[RequestOutput], list[str]]:
        """updated: each request that got tokens this step, with them (several under speculative
        decoding). prompt_logprobs: the step's scored prompt tokens by request. Returns the outputs
        of groups that changed, and the child ids a stop string finished (the scheduler must stop
        them; the tokens after the stop are not output)."""
        for req_id, (position, entries) in (prompt_logprobs or {}).items():
            self._add_prompt_logprobs(req_id, position, entries)
        stopped: list[str] = []
        touched: dict[str, RequestGroup] = {}
        for request, tokens in updated:
            group = self.group_of.get(request.request_id)
            if group is None:
                continue
            sample = group.samples[request.request_id]
            out = sample.output
            for i, token in enumerate(tokens):
                out.token_ids.append(token)
                if request.request_id in logprobs:  # only requests that sample one token a step ask for them
                    self._add_logprobs(out, token, logprobs[request.request_id])
                if request.is_finished and i == len(tokens) - 1:  # the scheduler's stop (EOS, length) comes first
                    out.finish_reason, out.stop_reason = request.status.finish_reason, request.stop_reason
                if sample.detokenizer is not None:
                    hit = sample.detokenizer.add_token(token)
                    out.text = sample.detokenizer.text
                    if hit is not None and out.finish_reason is None:
                        out.finish_reason, out.stop_reason = "stop", hit
                        stopped.append(request.request_id)
                        break
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            finished = group.finished
            if group.output_kind != RequestOutputKind.FINAL_ONLY or finished:
                outputs.append(group.to_output(finished))
            if finished:
                self._drop(group)
        return outputs, stopped

    def abort(self, request_id: str) -> RequestOutput | None:
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
        for child_id in group.samples:
            self.group_of.pop(child_id, None)

    def _add_logprobs(self, out: CompletionOutput, token: int, entry) -> None:
        out.logprobs.append(self._logprob_dict(token, entry))
        out.cumulative_logprob += entry[0]

    def _add_prompt_logprobs(self, req_id: str, position: int, entries: list) -> None:
        """Entries for the prompt tokens from `position` on, from the group's first sample; a prompt
        computed again (preemption) does not add them twice."""
        group = self.group_of.get(req_id)
        if group is None or group.prompt_logprobs is None or next(iter(group.samples)) != req_id:
            return
        scored = group.prompt_logprobs
        for offset, entry in enumerate(entries):
            if position + offset == len(scored):
                scored.append(self._logprob_dict(group.prompt_token_ids[position + offset], entry))

    def _logprob_dict(self, token: int, entry) -> dict[int, Logprob]:
        token_logprob, rank, top = entry
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        step = {tid: Logprob(lp, r + 1, decode(tid)) for r, (tid, lp) in enumerate(top)}
        if token not in step:
            step[token] = Logprob(token_logprob, rank, decode(token))
        return step
