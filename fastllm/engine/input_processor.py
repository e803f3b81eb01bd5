"""Prompts to token ids, and the checks a request must pass before anything of it reaches a step.

Both the in-process LLMEngine and the API process (AsyncLLMEngine) run these, so a bad request is a
ValueError naming the field, in the caller's process, and never a failed step. The engine core checks
again what it is sent (check_request), so a message that skipped this stage fails alone too.
"""

from __future__ import annotations

from fastllm.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | list[int] | dict


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        # A token spells at most this many characters, so a text longer than max_model_len times it
        # cannot fit the context: refused before the whole of it is tokenized.
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer else 1

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: a text, a list of token ids or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            return text, _token_list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, list):
            return None, _token_list(prompt)
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict, got "
                         f"{type(prompt).__name__}")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as token ids "
                             "({'prompt_token_ids': [...]})")
        self.check_text_length(text)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("prompt is not valid Unicode (it holds a lone surrogate)") from None
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def check_text_length(self, text: str) -> None:
        if not text:
            raise ValueError("prompt is empty")
        if len(text) > self.max_model_len * self.max_token_chars:
            raise ValueError(f"prompt ({len(text)} characters) is longer than max_model_len "
                             f"({self.max_model_len} tokens) can hold")

    def check_request(self, token_ids: list[int], params: SamplingParams, eos_token_id: int | None) -> int:
        """Raise ValueError (naming the field) unless the request can be served; returns its max_tokens."""
        params.validate()  # again: a field may have changed since construction
        if not token_ids:
            raise ValueError("prompt is empty")
        if params.n > self.max_num_seqs:  # its samples could never run together
            raise ValueError(f"SamplingParams.n must be <= max_num_seqs ({self.max_num_seqs}), "
                             f"got {params.n}")
        vocab = self.vocab_size
        if eos_token_id is not None and not (type(eos_token_id) is int and 0 <= eos_token_id < vocab):
            raise ValueError(f"eos_token_id must be an integer in [0, {vocab}), got {eos_token_id!r}")
        for t in token_ids:
            if not (type(t) is int and 0 <= t < vocab):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        params.check_token_ids(vocab)  # logit_bias, allowed_token_ids, bad_words
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"SamplingParams.stop_token_ids must be below the vocabulary size {vocab}, "
                                 f"got {t}")
        max_len = self.max_model_len
        if len(token_ids) >= max_len:  # the prompt's fault whatever max_tokens is
            raise ValueError(f"the prompt ({len(token_ids)} tokens) leaves no room to generate within "
                             f"max_model_len ({max_len})")
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(token_ids)
        if len(token_ids) + max_tokens > max_len:  # (max_tokens given: unset, it fills what the prompt leaves)
            raise ValueError(f"SamplingParams.max_tokens ({max_tokens}) + the prompt ({len(token_ids)} tokens) "
                             f"exceeds max_model_len ({max_len})")
        if params.min_tokens > max_tokens:  # (max_tokens None leaves min_tokens unchecked until here)
            raise ValueError(f"SamplingParams.min_tokens must be <= max_tokens ({max_tokens}, with the prompt "
                             f"within max_model_len {max_len}), got {params.min_tokens}")
        self.check_something_to_sample(params, eos_token_id)
        return max_tokens

    def check_something_to_sample(self, params: SamplingParams, eos_token_id: int | None) -> None:
        """Refuse a request whose masks leave no token at some step: allowed_token_ids all one-token bad
        words, or, while min_tokens is not reached, every token left a stop token or EOS. (A longer bad
        word masks its last token only after the rest of it; the sampler skips it where it would mask
        the last allowed token.)"""
        allowed = set(params.allowed_token_ids) if params.allowed_token_ids is not None else None
        if allowed is None and not params.min_tokens:
            return
        bad = {word[0] for word in params.bad_words_token_ids if len(word) == 1}
        if allowed is not None and allowed <= bad:
            raise ValueError("SamplingParams.allowed_token_ids are all bad_words: no token could be sampled")
        if params.min_tokens:
            ends = set(params.stop_token_ids)
            if eos_token_id is not None and not params.ignore_eos:
                ends.add(eos_token_id)
            masked = bad | ends
            if (allowed is not None and allowed <= masked) or len(masked) >= self.vocab_size:
                raise ValueError("SamplingParams.min_tokens can not be met: until it is, stop_token_ids and "
                                 "EOS are masked, and they are every token that allowed_token_ids and "
                                 "bad_words leave")

    def check_beam_search(self, token_ids: list[int], params: BeamSearchParams,
                          eos_token_id: int | None) -> int:
        """check_request for a beam search (ValueError naming the field); returns its max_tokens."""
        params.validate()  # again: a field may have changed since construction
        if 2 * params.beam_width > self.vocab_size:  # each beam proposes 2 * beam_width distinct tokens
            raise ValueError(f"BeamSearchParams.beam_width must be at most half the vocabulary "
                             f"({self.vocab_size}), got {params.beam_width}")
        if params.beam_width > self.max_num_seqs:  # its beams could never run together (as n > 1's samples)
            raise ValueError(f"BeamSearchParams.beam_width must be <= max_num_seqs ({self.max_num_seqs}), "
                             f"got {params.beam_width}")
        try:
            return self.check_request(token_ids, params.sampling_params(), eos_token_id)
        except ValueError as e:  # (in the search's terms: max_tokens is the search's)
            raise ValueError(str(e).replace("SamplingParams.", "BeamSearchParams.")) from None


def check_request_id(request_id) -> None:
    """A request id is a string of valid Unicode: it crosses to the engine core's process as UTF-8 (whose
    loop cannot decode another type, and would stop)."""
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
    try:
        request_id.encode()
    except UnicodeEncodeError:
        raise ValueError(f"request_id is not valid Unicode (it holds a lone surrogate): {request_id!r:.60}") \
            from None


def _token_list(ids) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt token ids must be a list of integers, got {type(ids).__name__}")
    return list(ids)
