"""Stop strings in streamed output: the tail that could still become a stop string is held back, so the
deltas add up to the final text (nothing streamed is taken back); stops wait for min_tokens; a stop
string on the last token wins over the length finish."""

from __future__ import annotations

import pytest

from fastllm import SamplingParams
from fastllm.engine.detokenizer import _stop_prefix_len
from fastllm.sampling_params import RequestOutputKind
from tests.conftest import PROMPTS, cached_llm


@pytest.mark.parametrize("text,stops,held", [
    ("the cat", ["cats"], 3), ("abc", ["cd"], 1), ("abcd", ["cde", "bcdx"], 3), ("xyz", ["ab"], 0),
    ("aaa", ["aaaa"], 3), ("ba", ["aab"], 1), ("a", ["a"], 0), ("", ["a"], 0), ("ab", ["xab", "b!"], 1),
])
def test_held_tail_is_the_longest_proper_prefix_of_a_stop(text, stops, held):
    assert _stop_prefix_len(text, stops) == held


def stream(params: SamplingParams, prompt: str) -> list:
    engine = cached_llm().engine
    engine.add_request("s", prompt, params.clone(output_kind=RequestOutputKind.DELTA))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    engine.check_kv_pool_whole()
    return outs


def test_deltas_never_show_what_a_stop_string_takes_back():
    plain = cached_llm().generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40),
                                  use_tqdm=False)[0].outputs[0].text
    target = "girl named"  # several tokens: "girl" comes before " named" decides
    want = plain[:plain.index(target)]
    outs = stream(SamplingParams(temperature=0, max_tokens=40, stop=[target]), PROMPTS[0])
    texts = [o.outputs[0].text for o in outs]
    assert "".join(texts) == want and outs[-1].outputs[0].finish_reason == "stop"
    shown = ""
    for text in texts:  # "girl" was held back, never shown
        shown += text
        assert want.startswith(shown)
    # with the stop string kept in the output, it comes out whole at the end
    kept = stream(SamplingParams(temperature=0, max_tokens=40, stop=[target],
                                 include_stop_str_in_output=True), PROMPTS[0])
    assert "".join(o.outputs[0].text for o in kept) == want + target


def test_stop_string_waits_for_min_tokens_and_wins_on_the_last_token():
    llm = cached_llm()
    greedy = SamplingParams(temperature=0, max_tokens=60)
    plain = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0]
    first = plain.text.index("Lily")
    tokenizer = llm.get_tokenizer()
    upto = next(i for i in range(1, len(plain.token_ids) + 1)
                if "Lily" in tokenizer.decode(plain.token_ids[:i], skip_special_tokens=True))
    params = greedy.clone(stop=["Lily"], min_tokens=upto + 1)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith(plain.text[:first + 4])  # the first "Lily" came before min_tokens
    second = plain.text.find("Lily", first + 4)
    assert second != -1, "the test needs a second Lily within 60 tokens"
    assert out.text == plain.text[:second] and out.finish_reason == "stop" and out.stop_reason == "Lily"


def test_a_stop_met_before_min_tokens_is_not_found_later_in_a_longer_stops_window():
    """Stops of different lengths: each new token's search looked back as far as the longest stop needs, so a
    short stop that appeared (and was streamed) before min_tokens was found a few tokens later, and the
    text was cut behind what had been streamed (the deltas joined to more than the final text)."""
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=4, stop=["a", "xyz-never"])
    final = cached_llm().generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    outs = stream(params, PROMPTS[0])
    assert "".join(o.outputs[0].text for o in outs) == final.text and final.finish_reason == "stop"
