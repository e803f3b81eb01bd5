"""A step's output while its sampled tokens are still on their way to the host.

The runner returns one of these as soon as the step's GPU work is queued. Their device-to-host copy
is queued with it (into pinned memory), so the engine can schedule and launch the next step
before it calls result(), which waits for the copy and only then touches the host lists.
"""

from __future__ import annotations

import time

import torch

from fastllm.core.scheduler_output import ModelRunnerOutput
from fastllm.worker.streams import current_stream


class AsyncRunnerOutput:
    def __init__(self, req_ids: list[str], sample_states: list, sampled: torch.Tensor | None = None,
                 logprobs: tuple[torch.Tensor, ...] | None = None, prompt_logprobs: dict | None = None):
        self.req_ids = req_ids
        self.prompt_logprobs = prompt_logprobs or {}  # already on the host (prompt_logprobs.py)
        # The runner's request states that sampled this step (objects, not ids: an id may be
        # reused by a new request before this step's tokens are read).
        self.sample_states = sample_states
        self.sampled = sampled  # [S] on the device: the next step's inputs read it from here
        self.rows = {s.req_id: i for i, s in enumerate(sample_states)}
        self._ready: torch.cuda.Event | None = None
        self._sampled_host = self._logprobs_host = None
        self._result: ModelRunnerOutput | None = None
        self.wait_s = 0.0  # how long result() blocked on the device (the rest of a step is host work)
        if sampled is not None:
            # On the CPU a copy too, not the tensor itself: a graph runner's no-replay mode samples into a
            # buffer that the next step, launched before this one's result() is read, overwrites.
            if logprobs is not None:
                self._logprobs_host = tuple(t.to("cpu", non_blocking=True) for t in logprobs)
            if logprobs is not None and len(logprobs) == 2:  # beam steps: each sampled token is its top id
                self._sampled_host = self._logprobs_host[0][:, 0]
            else:
                self._sampled_host = sampled.to("cpu", non_blocking=True) if sampled.is_cuda else sampled.clone()
            if sampled.is_cuda:
                self._ready = torch.cuda.Event()
                self._ready.record(current_stream(sampled.device))

    @classmethod
    def ready(cls, result: ModelRunnerOutput) -> "AsyncRunnerOutput":
        """An output already on the host (a speculative step, which syncs to draft after its tokens)."""
        out = cls(result.req_ids, [])
        out._result = result
        return out

    @property
    def done(self) -> bool:
        return self._result is not None

    def result(self) -> ModelRunnerOutput:
        """Wait for the tokens (once), append them to the runner's request states, return them."""
        if self._result is not None:
            return self._result
        sampled: dict[str, int] = {}
        logprobs = {}
        if self._sampled_host is not None:
            if self._ready is not None:
                start = time.perf_counter()
                self._ready.synchronize()
                self.wait_s = time.perf_counter() - start
            tokens = self._sampled_host.tolist()
            for state, token in zip(self.sample_states, tokens):
                state.output_token_ids.append(token)
                state.num_pending -= 1
                sampled[state.req_id] = token
            if self._logprobs_host is not None:
                logprobs = {r: [entry] for r, entry in collect_logprobs(self.sample_states,
                                                                        self._logprobs_host).items()}
        self._result = ModelRunnerOutput(self.req_ids, [[sampled[r]] if r in sampled else [] for r in self.req_ids],
                                         logprobs, prompt_logprobs=self.prompt_logprobs)
        return self._result


def collect_logprobs(sample_states: list, logprobs: tuple[torch.Tensor, ...]) -> dict:
    """req id -> (token logprob, rank, top-N pairs) for the sample states that asked, from the
    sampler's [S] / [S, N] tensors (on the host), row i being sample_states[i]'s. Beam search steps
    (SamplerOutput's two tensors) have no token logprob or rank: (None, None, top-N pairs)."""
    if len(logprobs) == 2:
        top_ids, top_vals = (t.tolist() for t in logprobs)
        return {state.req_id: (None, None, list(zip(ids[:state.sampling_params.logprobs],
                                                    vals[:state.sampling_params.logprobs])))
                for state, ids, vals in zip(sample_states, top_ids, top_vals)}
    token_logprob, rank, top_ids, top_vals = (t.tolist() for t in logprobs)
    out = {}
    for i, state in enumerate(sample_states):
        num = state.sampling_params.logprobs
        if num is not None:
            out[state.req_id] = (token_logprob[i], rank[i], list(zip(top_ids[i][:num], top_vals[i][:num])))
    return out
