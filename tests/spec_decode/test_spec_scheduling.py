"""The scheduler's side of speculative decoding: draft tokens scheduled after a request's last
token, lookahead slots for the draft model, rejected drafts' KV given back, drafts trimmed to the
budget and to the tokens a request can still use."""

from __future__ import annotations

from fastllm.core.scheduler_output import ModelRunnerOutput
from fastllm.engine.request import RequestStatus
from tests.core.utils import add, make_scheduler, scheduled


def prefill(sched, req_id, prompt_len, max_tokens, first_token=7, drafts=()):
    request = add(sched, req_id, prompt_len, max_tokens=max_tokens)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput([req_id], [[first_token]], spec_token_ids={req_id: list(drafts)}))
    return request


def test_drafts_are_verified_and_rejected_ones_recomputed():
    sched = make_scheduler(block_size=4, num_speculative_tokens=3)
    a = prefill(sched, "a", 6, max_tokens=20, drafts=[11, 12, 13])
    assert a.spec_token_ids == [11, 12, 13] and a.num_computed_tokens == 6
    out = sched.schedule()
    assert scheduled(out) == {"a": 4} and out.scheduled_spec_tokens == {"a": [11, 12, 13]}
    # Slots for the 4 tokens at positions 6-9 and the draft's 3 lookahead slots: 13 tokens, 4 blocks.
    assert len(sched.kv.req_blocks["a"]) == 4
    # The target keeps 11, rejects 12 and samples 21 instead: 13's and 12's KV is computed again.
    updated = sched.update_from_output(out, ModelRunnerOutput(["a"], [[11, 21]], spec_token_ids={"a": [31, 32, 33]}))
    assert updated == [(a, [11, 21])]
    assert a.output_token_ids == [7, 11, 21] and a.num_computed_tokens == 8 and a.num_tokens == 9
    assert (sched.spec_stats.num_draft_tokens, sched.spec_stats.num_accepted_tokens) == (3, 1)
    out = sched.schedule()
    assert scheduled(out) == {"a": 4} and out.scheduled_spec_tokens == {"a": [31, 32, 33]}
    sched.finish_requests(["a"], a.status.FINISHED_ABORTED)
    sched.kv.assert_empty()


def test_drafts_trimmed_to_the_budget_and_to_the_tokens_left():
    sched = make_scheduler(block_size=4, budget=3, num_speculative_tokens=4)
    a = prefill(sched, "a", 2, max_tokens=10, drafts=[11, 12, 13, 14])
    out = sched.schedule()
    assert scheduled(out) == {"a": 3} and out.scheduled_spec_tokens == {"a": [11, 12]}
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[11, 12, 5]], spec_token_ids={"a": [21, 22, 23, 24]}))
    assert a.num_tokens == 6 and a.num_computed_tokens == 5
    # 12 tokens in all (2 + 10): 6 are left, the target's own next token is one of them.
    assert a.spec_token_ids == [21, 22, 23, 24]
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[21, 22, 9]], spec_token_ids={"a": [21, 22, 23, 24]}))
    assert a.num_tokens == 9 and a.spec_token_ids == [21, 22]  # 3 left: 2 drafts and the target's token
    out = sched.schedule()
    # The lookahead stops at the request's last token: blocks for 12 tokens, not 9 + 2 + 4.
    assert len(sched.kv.req_blocks["a"]) == 3
    updated = sched.update_from_output(out, ModelRunnerOutput(["a"], [[21, 22, 23]], spec_token_ids={"a": [9]}))
    assert updated == [(a, [21, 22, 23])] and a.is_finished and a.num_output_tokens == 10
    sched.kv.assert_empty()


def test_a_stop_among_accepted_drafts_drops_the_tokens_after_it():
    sched = make_scheduler(num_speculative_tokens=4)
    a = prefill(sched, "a", 5, max_tokens=30, drafts=[11, 2, 13])  # 2 is the test requests' EOS
    out = sched.schedule()
    updated = sched.update_from_output(out, ModelRunnerOutput(["a"], [[11, 2, 13, 14]]))
    assert updated == [(a, [11, 2])] and a.status.finish_reason == "stop" and a.output_token_ids == [7, 11, 2]
    sched.kv.assert_empty()


def test_lookahead_only_for_a_step_after_which_the_request_drafts():
    sched = make_scheduler(block_size=4, budget=5, num_speculative_tokens=4)
    add(sched, "chunked", 12, max_tokens=20)
    sched.schedule()
    assert len(sched.kv.req_blocks["chunked"]) == 2  # 5 of its 12 prompt tokens: no draft after this step
    sched.finish_requests(["chunked"], RequestStatus.FINISHED_ABORTED)
    sched = make_scheduler(block_size=4, num_speculative_tokens=4)
    add(sched, "logprobs", 4, max_tokens=20, logprobs=1)  # (logprobs speculate too)
    add(sched, "plain", 4, max_tokens=20)
    sched.schedule()
    # Both prompts end this step: each holds slots for the draft's 4 writes after it.
    assert len(sched.kv.req_blocks["logprobs"]) == 2 and len(sched.kv.req_blocks["plain"]) == 2
    sched.finish_requests(["logprobs", "plain"], RequestStatus.FINISHED_ABORTED)
    sched.kv.assert_empty()


def test_bad_speculative_config_is_a_clear_error():
    import pytest

    from fastllm.config import EngineConfig

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig.from_kwargs(None, num_speculative_tokens=3)  # no draft model
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig.from_kwargs(None, speculative_model="llama2xs-279K", num_speculative_tokens=17)
    with pytest.raises(ValueError, match="not a directory"):
        EngineConfig.from_kwargs(None, speculative_model="no-such-draft")
    assert EngineConfig.from_kwargs(None, speculative_model="llama2xs-279K").speculative.num_speculative_tokens == 4
