"""Helpers for the CPU tests of fastllm/core: requests, schedulers and a fake model runner.

FakeRunner plays the model runner's part with no model: it keeps the runner's view of each
request (block table built only from the SchedulerOutput diffs), applies swaps and copies to a
simulated paged KV store, "writes" each computed position's KV and "reads" every position the
request attends to. The value stored for position p of a request is a signature of its tokens
0..p, so a wrong block table, a missed copy-on-write, a lost swap or a wrong prefix-cache hit
shows up as a mismatch at the first read, not as a plausible-looking output.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from fastllm.config import CacheConfig, SchedulerConfig
from fastllm.core.block_hash import HashFn, hash_block_tokens
from fastllm.core.block_pool import NULL_BLOCK_ID
from fastllm.core.scheduler import Scheduler
from fastllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from fastllm.engine.request import Request, RequestStatus
from fastllm.sampling_params import SamplingParams
from fastllm.spec_decode.policy import SpecPolicy

EOS = 2
TOKEN = 7  # what FakeRunner samples unless told otherwise


def prompt_tokens(tag: str, n: int) -> list[int]:
    """n deterministic token ids, distinct per tag (no accidental prefix-cache hits between tags)."""
    return [100 + zlib.crc32(f"{tag}:{i}".encode()) % 30000 for i in range(n)]


def make_request(
    request_id: str,
    prompt: int | Sequence[int],
    max_tokens: int = 16,
    *,
    block_size: int = 4,
    hash_fn: HashFn | None = hash_block_tokens,
    eos_token_id: int | None = EOS,
    fork_of: Request | None = None,
    **sampling,
) -> Request:
    """A request with `prompt` tokens (an int: that many tokens unique to request_id)."""
    tokens = prompt_tokens(request_id, prompt) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    return Request(request_id, tokens, params, eos_token_id, max_tokens, block_size, hash_fn, fork_of=fork_of)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 16,
    preemption_mode: str = "recompute",
    enable_prefix_caching: bool = True,
    num_cpu_blocks: int = 0,
    enable_chunked_prefill: bool = True,
    max_model_len: int = 1024,
    hash_fn: HashFn = hash_block_tokens,
    num_speculative_tokens: int = 0,
    sliding_window: int | None = None,
) -> Scheduler:
    """num_blocks counts the null block: num_blocks - 1 blocks are usable. num_speculative_tokens: a
    draft model proposes that many tokens every step (the policy never turns it off)."""
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                        enable_chunked_prefill=enable_chunked_prefill, preemption_mode=preemption_mode),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        max_model_len, num_blocks, num_cpu_blocks, hash_fn,
        SpecPolicy(num_speculative_tokens, adaptive=False) if num_speculative_tokens else None, True, sliding_window,
    )


def add(sched: Scheduler, request_id: str, prompt: int | Sequence[int], max_tokens: int = 16,
        **kw) -> Request:
    """make_request with the scheduler's block size and hash function, then add it."""
    request = make_request(request_id, prompt, max_tokens, block_size=sched.block_size, hash_fn=sched.hash_fn,
                           **kw)
    sched.add_request(request)
    return request


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return dict(out.num_scheduled_tokens)


class FakeRunner:
    """The model runner's bookkeeping over a simulated KV store (see the module docstring).

    token_fn(request) -> the token to sample for a request whose known tokens are all computed.
    logprobs_fn(request) -> {token: logprob} of its next token, for requests that ask for logprobs
    (beams): the runner reports the top SamplingParams.logprobs of them, as the sampler does.
    """

    def __init__(self, sched: Scheduler, token_fn: Callable[[Request], int] | None = None,
                 logprobs_fn: Callable[[Request], dict[int, float]] | None = None):
        self.sched = sched
        self.bs = sched.block_size
        self.token_fn = token_fn or (lambda request: TOKEN)
        self.logprobs_fn = logprobs_fn
        self.tables: dict[str, list[int]] = {}  # the runner's block tables, from the diffs only
        self.computed: dict[str, int] = {}
        # The runner's own copy of each request's tokens: sent whole with a new request, then the token it
        # sampled appended (as the real runner's, which reads its inputs from it, never the scheduler's)
        self.tokens: dict[str, list[int]] = {}
        self.gpu: dict[int, list] = {}  # block id -> one signature per slot
        self.cpu: dict[int, list] = {}
        self._sigs: dict[str, list[int]] = {}

    def sig(self, request: Request, p: int) -> int:
        """Signature of the KV at position p: depends on tokens 0..p, as real KV does."""
        sigs = self._sigs.setdefault(request.request_id, [])
        while len(sigs) <= p:
            prev = sigs[-1] if sigs else 0
            sigs.append(hash((prev, request.all_token_ids[len(sigs)])))
        return sigs[p]

    def _slot(self, table: list[int], p: int) -> tuple[list, int]:
        assert p // self.bs < len(table), f"position {p} beyond the block table {table}"
        block_id = table[p // self.bs]
        assert block_id != NULL_BLOCK_ID, f"position {p} maps to the null block"
        return self.gpu.setdefault(block_id, [None] * self.bs), p % self.bs

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            assert req_id not in out.num_scheduled_tokens, f"{req_id} finished and scheduled"
            self.tables.pop(req_id, None)
            self.computed.pop(req_id, None)
            self.tokens.pop(req_id, None)
        seen = set()
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tables, f"{new.req_id} sent as new twice"
            request = self.sched.requests[new.req_id]
            assert new.prompt_token_ids == request.prompt_token_ids
            assert new.prompt_token_ids + new.output_token_ids == request.all_token_ids
            assert new.num_computed_tokens < request.num_tokens
            self.tables[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.tokens[new.req_id] = new.prompt_token_ids + new.output_token_ids
            seen.add(new.req_id)
        for cached in out.scheduled_cached_reqs:
            assert cached.req_id in self.tables, f"cached data for {cached.req_id}, unknown to the runner"
            if cached.block_ids is not None:
                assert cached.new_block_ids == []
                self.tables[cached.req_id] = list(cached.block_ids)
            else:
                self.tables[cached.req_id].extend(cached.new_block_ids)
            self.computed[cached.req_id] = cached.num_computed_tokens
            seen.add(cached.req_id)
        assert seen == set(out.num_scheduled_tokens), "new + cached records != scheduled requests"
        num_records = len(out.scheduled_new_reqs) + len(out.scheduled_cached_reqs)
        assert len(seen) == num_records, "a request sent twice"
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sched, bs = self.sched, self.bs
        self._update_states(out)
        # Physical work first, in the real runner's order: swap out, swap in, copy-on-write.
        for gpu_id, cpu_id in out.blocks_to_swap_out:
            assert gpu_id != NULL_BLOCK_ID
            self.cpu[cpu_id] = list(self.gpu.get(gpu_id, [None] * bs))
        for cpu_id, gpu_id in out.blocks_to_swap_in:
            assert gpu_id != NULL_BLOCK_ID
            self.gpu[gpu_id] = list(self.cpu[cpu_id])
        for src, dst in out.blocks_to_copy:
            assert NULL_BLOCK_ID not in (src, dst) and src != dst
            self.gpu[dst] = list(self.gpu.get(src, [None] * bs))
        req_ids = list(out.num_scheduled_tokens)
        for req_id in req_ids:
            request = sched.requests[req_id]
            n = out.num_scheduled_tokens[req_id]
            assert n >= 1, f"{req_id} scheduled with {n} tokens"
            assert request.status == RequestStatus.RUNNING
            assert self.tables[req_id] == sched.kv.block_ids(req_id), (
                f"{req_id}: runner table {self.tables[req_id]} != scheduler's {sched.kv.block_ids(req_id)}")
            assert self.computed[req_id] + n == request.num_computed_tokens <= request.num_tokens
            assert self.tokens[req_id] == request.all_token_ids, (
                f"{req_id}: the runner's tokens {self.tokens[req_id]} != {request.all_token_ids}")
        # Every scheduled token's KV is written before anyone attends (as each layer does).
        for req_id in req_ids:
            request = sched.requests[req_id]
            for p in range(self.computed[req_id], request.num_computed_tokens):
                slots, i = self._slot(self.tables[req_id], p)
                slots[i] = self.sig(request, p)
        for req_id in req_ids:
            self._check_kv(sched.requests[req_id], self.tables[req_id], self.computed[req_id])
        tokens: list[list[int]] = []
        logprobs = {}
        for req_id in req_ids:
            request = sched.requests[req_id]
            self.computed[req_id] = request.num_computed_tokens
            caught_up = request.num_computed_tokens == request.num_tokens
            tokens.append([self.token_fn(request)] if caught_up else [])
            self.tokens[req_id] += tokens[-1]
            num = request.sampling_params.logprobs
            if caught_up and num is not None and self.logprobs_fn is not None:
                top = sorted(self.logprobs_fn(request).items(), key=lambda kv: -kv[1])[:num]
                logprobs[req_id] = [(top[0][1], 1, top)]  # one entry per new token
        return ModelRunnerOutput(req_ids, tokens, logprobs)

    def _first_read(self, first_query: int) -> int:
        """The first position a query at first_query (or later) reads: all of them, or its sliding window's."""
        window = self.sched.kv.sliding_window
        return 0 if window is None else max(0, first_query - window + 1)

    def _check_kv(self, request: Request, table: list[int], first_query: int | None = None) -> None:
        """Every position the request's queries from first_query on read (default: its next one's) holds
        its own KV."""
        first_query = request.num_computed_tokens if first_query is None else first_query
        for p in range(self._first_read(first_query), request.num_computed_tokens):
            slots, i = self._slot(table, p)
            assert slots[i] == self.sig(request, p), (
                f"{request.request_id}: wrong KV at position {p} (block {table[p // self.bs]})")

    def check_all_kv(self) -> None:
        """Every running request's computed KV is intact on the GPU, every swapped one's on the CPU."""
        kv = self.sched.kv
        for request in self.sched.running:
            self._check_kv(request, kv.block_ids(request.request_id))
        for request in self.sched.swapped:
            cpu_ids = [b.block_id for b in kv.swapped_blocks[request.request_id]]
            freed = kv.num_freed.get(request.request_id, 0)  # (not swapped: behind the window)
            for p in range(self._first_read(request.num_computed_tokens), request.num_computed_tokens):
                assert self.cpu[cpu_ids[p // self.bs - freed]][p % self.bs] == self.sig(request, p), (
                    f"{request.request_id}: wrong swapped KV at position {p}")


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    """One schedule -> execute -> update, with the invariants checked on both sides."""
    out = sched.schedule()
    sched.kv.check_invariants()
    runner_output = runner.execute(out)
    updated = sched.update_from_output(out, runner_output)
    sched.kv.check_invariants()
    runner.check_all_kv()
    return out, [request for request, _ in updated]


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out, _ = step(sched, runner)
        outs.append(out)
    else:
        raise AssertionError(f"not done after {max_steps} steps: {list(sched.requests.values())}")
    sched.kv.assert_empty()
    return outs
