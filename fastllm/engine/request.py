"""Request: one sequence being generated, as the scheduler sees it (pure Python)."""

from __future__ import annotations

import enum
import time

from fastllm.core.block_hash import BlockHash, HashFn, extend_block_hashes
from fastllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # blocks freed; recomputed from scratch when resumed
    SWAPPED = 3  # blocks moved to the CPU pool
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # its step raised (the engine went on without it)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {4: "stop", 5: "length", 6: "abort", 7: "error"}.get(int(self))


class Request:
    """Tokens, progress and status of one sample. `n > 1` makes n of these (see fork_of).

    There is no prefill or decode phase: num_computed_tokens catches up with num_tokens, and a
    step computes some of the difference (a prompt chunk, or the one newest token).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_tokens: int,
        block_size: int,
        hash_fn: HashFn | None = None,
        fork_of: "Request | None" = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        # The length at which it stops: max_tokens, or max_model_len (the scheduler lowers it to that).
        self.max_total_tokens = self.num_prompt_tokens + max_tokens
        self.arrival_time = time.monotonic()
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled on the device whose ids have not come back yet (async scheduling keeps
        # one step in flight, so a request can be scheduled again before its last token is known).
        self.num_pending_tokens = 0
        # Draft tokens proposed after the newest token (speculative decoding): the next step verifies them.
        self.spec_token_ids: list[int] = []
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.num_preemptions = 0
        # A sibling of an n > 1 request: it shares the prompt's KV with this request once computed.
        self.fork_of = fork_of
        self._block_size = block_size
        self._hash_fn = hash_fn
        self.block_hashes: list[BlockHash] = []
        self._update_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self._hash_fn is not None and len(self.all_token_ids) % self._block_size == 0:
            self._update_hashes()  # a block just became full

    def copy_as(self, request_id: str) -> "Request":
        """This request's tokens, block hashes and progress under another id (beam search forks beams)."""
        child = object.__new__(Request)  # (copy.copy's generic protocol costs more than the rest of a fork)
        child.__dict__.update(self.__dict__)
        child.request_id = request_id
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.spec_token_ids = []
        child.num_pending_tokens = 0
        child.status = RequestStatus.WAITING
        return child

    def _update_hashes(self) -> None:
        if self._hash_fn is not None:
            extend_block_hashes(self.block_hashes, self.all_token_ids, self._block_size, self._hash_fn)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}"
                f"/{self.num_tokens})")
