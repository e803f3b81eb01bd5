"""Incremental text equals a full decode: sentencepiece spaces, multi-byte characters, stop strings."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from fastllm import SamplingParams
from fastllm.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import PROMPTS, STORIES, cached_llm


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES)


@pytest.mark.parametrize("text", [
    " there was a café in 日本, naïve 😀 and   spaces\ttabs\nnew lines",
    "Lily said: \"Hello!\" 123 4567",
    "ß→λ ∑ x² — «quotes»",
])
def test_incremental_equals_full_decode(tokenizer, text):
    prompt = tokenizer("Once upon a time,")["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True, stop=[])
    pieces = []
    for token in ids:
        before = detok.text
        detok.add_token(token)
        pieces.append(detok.text[len(before):])
        assert "\ufffd" not in detok.text  # never a half character
    full = tokenizer.decode(prompt + ids, skip_special_tokens=True)
    assert full == tokenizer.decode(prompt, skip_special_tokens=True) + detok.text
    assert any(len(p) == 0 for p in pieces) or all(ord(c) < 128 for c in text)


def test_a_byte_that_makes_the_text_before_it_decode_otherwise_does_not_raise(tokenizer, caplog):
    """"\\n" then <0xCE> (a lead byte) then ".": the byte fallback turns the already streamed newline into a
    replacement character, and DecodeStream raises "Invalid prefix encountered". A model can sample this (a
    random-weight one did, in bench_spec_decode), so the stream starts again: the text goes on, and the
    engine with it."""
    newline, lead_byte, dot = tokenizer.convert_tokens_to_ids(["<0x0A>", "<0xCE>", "."])
    prompt = tokenizer("Once upon a time")["input_ids"]
    ids = [newline, lead_byte, dot] * 3 + tokenizer(" Lily", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True, stop=["Lily"])
    stops = [detok.add_token(t) for t in ids]
    assert stops[-1] == "Lily" and not any(stops[:-1])  # stop strings still found after the restarts
    assert detok.text.startswith("\n") and detok.text.count(".") == 3 and detok.restarted
    assert "Once" not in detok.text  # (the prompt is not given out again)
    assert sum("starts again" in r.message for r in caplog.records) == 1  # warned once a request


def test_special_tokens_skipped_or_kept(tokenizer):
    prompt = tokenizer("Once")["input_ids"]
    ids = tokenizer(" upon", add_special_tokens=False)["input_ids"] + [tokenizer.bos_token_id]
    skip = IncrementalDetokenizer(tokenizer, prompt, True, [])
    keep = IncrementalDetokenizer(tokenizer, prompt, False, [])
    for t in ids:
        skip.add_token(t)
        keep.add_token(t)
    assert skip.text == " upon" and keep.text.endswith("<s>")


def test_stop_strings_cut_the_text():
    llm = cached_llm()
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert "Lily" in plain.text
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop=["Lily", "zzz"]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == plain.text[:plain.text.index("Lily")]
    assert cut.finish_reason == "stop" and cut.stop_reason == "Lily"
    assert len(cut.token_ids) < len(plain.token_ids)
    kept = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop="Lily",
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == plain.text[:plain.text.index("Lily") + 4]


def test_stop_string_spanning_tokens():
    llm = cached_llm()
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    target = "girl named"  # several tokens
    assert target in plain.text
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop=[target]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == plain.text[:plain.text.index(target)]


def test_output_kinds_stream_the_same_text():
    """CUMULATIVE outputs grow; DELTA outputs concatenate to the same text; FINAL_ONLY comes once."""
    from fastllm.sampling_params import RequestOutputKind

    llm = cached_llm()
    engine = llm.engine
    results = {}
    for kind in RequestOutputKind:
        engine.add_request(kind.name, PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, output_kind=kind))
        results[kind] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[RequestOutputKind[out.request_id]].append(out)
    final = results[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final[0].finished
    cumulative = results[RequestOutputKind.CUMULATIVE]
    assert len(cumulative) == 20 and cumulative[-1].outputs[0].text == final[0].outputs[0].text
    assert all(a.outputs[0].text == b.outputs[0].text[:len(a.outputs[0].text)] for a, b in zip(cumulative, cumulative[1:]))
    delta = results[RequestOutputKind.DELTA]
    assert "".join(o.outputs[0].text for o in delta) == final[0].outputs[0].text
    assert sum((o.outputs[0].token_ids for o in delta), []) == final[0].outputs[0].token_ids
