"""SamplingParams: vLLM's fields and defaults, validated at construction."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
_INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # top-N logprobs per token, at most (vLLM's default max_logprobs)
# The sampler's float32 logits stay finite (an inf or NaN logit would be sampled as token 0): a bias of at
# most MAX_LOGIT_BIAS, divided by a repetition penalty of at least MIN_REPETITION_PENALTY and by a temperature
# of at least _GREEDY_EPS (below it a request is greedy), is under 1e38.
MAX_LOGIT_BIAS = 1e30
MIN_REPETITION_PENALTY = 0.01


def _int_in(value, low: int, high: int | None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value \
        and (high is None or value <= high)


def _real_in(value, low: float, high: float | None) -> bool:
    """A finite int or float in [low, high] (NaN and infinities fail)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and low <= value and (high is None or value <= high)


def _valid_unicode(text: str) -> bool:
    """No lone surrogates (JSON can carry them; no tokenizer or UTF-8 encoder can)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every step: all the text and tokens so far
    DELTA = 1  # every step: only what is new
    FINAL_ONLY = 2  # once, when the request finishes (what LLM.generate uses)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (plus the prompt's own)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # only these tokens can be sampled
    bad_words: list[str] | None = None  # words never generated (their last token is masked after the rest)
    _stop_list: list[str] = field(init=False, repr=False)
    # bad_words as token ids, one list per spelling: filled at the engine boundary (tokenize_bad_words)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)
    # A beam search's step (BeamSearchParams.sampling_params): only the top `logprobs` are read, not the
    # sampled token's logprob or rank, so the sampler computes no more (Sampler.forward)
    _beam_step: bool = field(default=False, init=False, repr=False)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Normalize and check every field (ValueError naming it). Construction runs it, and the engine
        again (a caller may change a field after construction)."""
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif self.stop is None or isinstance(self.stop, (list, tuple)):
            self._stop_list = list(self.stop or [])
        else:
            raise ValueError(f"SamplingParams.stop must be a string or a list of strings, got {self.stop!r}")
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple))):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids, "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        self._validate_logits_filters()

    def _validate(self) -> None:
        """Every field within the range the engine can serve (a value outside it could fail a step):
        integers are ints (not bools), floats finite, strings valid Unicode."""
        checks = [
            ("n", _int_in(self.n, 1, None), "must be an integer >= 1"),
            ("temperature", _real_in(self.temperature, 0, None),
             "must be a finite number >= 0 (0 means greedy)"),
            ("top_p", _real_in(self.top_p, 0, 1) and self.top_p > 0, "must be a number in (0, 1]"),
            ("top_k", _int_in(self.top_k, 0, _INT64_MAX),
             "must be -1, 0 (off) or a positive integer < 2**63"),
            ("min_p", _real_in(self.min_p, 0, 1), "must be a number in [0, 1]"),
            # torch seeds are 64-bit; the samples of n > 1 take seed, seed + 1, ...
            ("seed", self.seed is None
             or (_int_in(self.n, 1, None) and _int_in(self.seed, -2**63, 2**64 - self.n)),
             "must be None or an integer in [-2**63, 2**64 - n]"),
            ("max_tokens", self.max_tokens is None or _int_in(self.max_tokens, 1, None),
             "must be an integer >= 1 or None"),
            ("min_tokens", _int_in(self.min_tokens, 0, None), "must be an integer >= 0"),
            ("logprobs", self.logprobs is None or _int_in(self.logprobs, 0, MAX_LOGPROBS),
             f"must be None or an integer in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs",
             self.prompt_logprobs is None or _int_in(self.prompt_logprobs, 0, MAX_LOGPROBS),
             f"must be None or an integer in [0, {MAX_LOGPROBS}]"),
            ("presence_penalty", _real_in(self.presence_penalty, -2, 2), "must be a number in [-2, 2]"),
            ("frequency_penalty", _real_in(self.frequency_penalty, -2, 2), "must be a number in [-2, 2]"),
            ("repetition_penalty", _real_in(self.repetition_penalty, MIN_REPETITION_PENALTY, 2),
             f"must be a number in [{MIN_REPETITION_PENALTY}, 2]"),
            ("stop", all(isinstance(s, str) and s and _valid_unicode(s) for s in self._stop_list),
             "must be non-empty strings of valid Unicode"),
            ("stop_token_ids", all(_int_in(t, 0, None) for t in self.stop_token_ids),
             "must be non-negative integers"),
            ("output_kind", isinstance(self.output_kind, RequestOutputKind), "must be a RequestOutputKind"),
        ]
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            checks.append((name, isinstance(getattr(self, name), bool), "must be a bool"))
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {message}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )

    def _validate_logits_filters(self) -> None:
        """logit_bias, allowed_token_ids and bad_words (vLLM's fields). Token ids are checked against
        the vocabulary at the engine boundary (check_token_ids), which knows its size."""
        bias, allowed, words = self.logit_bias, self.allowed_token_ids, self.bad_words
        checks = [
            ("logit_bias", bias is None or (isinstance(bias, dict) and all(
                _is_token_id(t) and _real_in(b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS) for t, b in bias.items())),
             f"must be a dict of token id -> number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            ("allowed_token_ids", allowed is None or (isinstance(allowed, (list, tuple)) and len(allowed) > 0
                                                      and all(_is_token_id(t) for t in allowed)),
             "must be None or a non-empty list of token ids"),
            ("bad_words", words is None or (isinstance(words, (list, tuple)) and all(
                isinstance(w, str) and w.strip() and _valid_unicode(w) for w in words)),
             "must be None or a list of non-blank strings of valid Unicode"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {message}, got {getattr(self, name)!r}")
        if allowed is not None:
            self.allowed_token_ids = list(allowed)
        if words is not None:
            self.bad_words = list(words)

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError naming the field unless every token id the fields name is in the vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words", [t for word in self._bad_words_token_ids or () for t in word])):
            bad = sorted({t for t in ids if t >= vocab_size})
            if bad:
                raise ValueError(f"SamplingParams.{name} has token ids outside the vocabulary of {vocab_size}: "
                                 f"{bad[:5]}")

    def tokenize_bad_words(self, tokenizer) -> None:
        """Token ids of bad_words, as vLLM spells them: each word as given (left-stripped) and, when the
        tokenizer spells it with as many tokens but another first one, after a space."""
        if not self.bad_words or self._bad_words_token_ids is not None:
            return
        if tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer: this model has none")
        spellings: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            spellings.append(plain)
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                spellings.append(spaced)
        self._bad_words_token_ids = [ids for ids in spellings if ids]

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids or []

    @property
    def has_logits_filters(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words: sampled outside CUDA graphs, not speculated."""
        return self.logit_bias is not None or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def reads_output_tokens(self) -> bool:
        """Its sampling depends on the tokens generated so far (penalties, bad words), so a step waits
        for the previous step's token instead of overlapping it."""
        return self.has_penalties or bool(self.bad_words)

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def argmax_only(self) -> bool:
        """Sampling is the argmax of the logits: greedy, and no penalty, min_tokens mask or
        logprobs. Read every step for every request, so written out flat (no nested properties)."""
        return (self.temperature < _GREEDY_EPS and self.logprobs is None and self.min_tokens == 0
                and self.presence_penalty == 0 and self.frequency_penalty == 0 and self.repetition_penalty == 1
                and self.logit_bias is None and self.allowed_token_ids is None and not self.bad_words)

    @property
    def samples_in_graph(self) -> bool:
        """A decode CUDA graph can draw this request's tokens: no seed (its own generator), penalty,
        min_tokens mask, logprobs or logits filter (the graph's forward still runs; the sampler then
        applies them to its logits)."""
        return self.seed is None and self.logprobs is None and self.min_tokens == 0 and not self.has_penalties \
            and not self.has_logits_filters

    def clone(self, **changes) -> "SamplingParams":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}
        values.update(changes)
        clone = SamplingParams(**values)
        if "bad_words" not in changes:
            clone._bad_words_token_ids = self._bad_words_token_ids
        return clone


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


MAX_BEAM_WIDTH = 10  # each beam asks for its top 2 * beam_width logprobs, at most 20 (SamplingParams.logprobs)
# length ** length_penalty stays a float at any length with |length_penalty| <= this (10 x ln 2**63 < 709)
MAX_LENGTH_PENALTY = 10


@dataclass
class BeamSearchParams:
    """Beam search (LLM.beam_search), scored and ended by Hugging Face transformers' rules, so that
    generate(num_beams=beam_width, length_penalty=..., early_stopping=...) gives the same beams:

    - Each step every running beam proposes its 2 * beam_width likeliest next tokens; the candidates
      are ranked by cumulative logprob (the sum of the raw model logprobs of the generated tokens).
    - Among the best beam_width candidates, one that ends (EOS, unless ignore_eos, or max_tokens
      reached) becomes a finished hypothesis scored cum_logprob / generated_len ** length_penalty
      (generated_len counts the EOS); the best beam_width hypotheses are kept. The best beam_width
      candidates that do not end run on. An EOS candidate ranked below beam_width is dropped.
    - length_penalty > 0 favours longer sequences, < 0 shorter ones, 0 ranks by cum_logprob alone;
      it lies in [-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY] (transformers takes any float).
    - early_stopping: True stops once beam_width hypotheses are finished. False (transformers'
      default) also stops when the best running beam, scored at its current length, cannot beat
      the worst kept hypothesis. "never" scores it at max_tokens when length_penalty > 0 (the
      canonical beam search, which stops only when no improvement is possible).
    - The result is the kept hypotheses, best score first.

    beam_width 1 runs the same algorithm with one beam: greedy decoding (what transformers runs for
    num_beams=1) except with early_stopping="never" and length_penalty > 0. The search is
    deterministic: temperature must be 0 (transformers' beam sampling is not implemented)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field (ValueError naming it): at construction, and again in the engine."""
        checks = [
            ("beam_width", _is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
             f"must be an integer in [1, {MAX_BEAM_WIDTH}]"),
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be a bool"),
            ("temperature", self.temperature == 0, "must be 0: beam search is deterministic (beam sampling is not "
             "implemented)"),
            ("length_penalty", _real_in(self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
             f"must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]"),
            ("early_stopping", isinstance(self.early_stopping, bool) or self.early_stopping == "never",
             "must be True, False or 'never'"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"BeamSearchParams.{name} {message}, got {getattr(self, name)!r}")

    def sampling_params(self) -> SamplingParams:
        """What each beam's steps ask of the sampler: the top 2 * beam_width raw logprobs."""
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                                logprobs=2 * self.beam_width, output_kind=RequestOutputKind.FINAL_ONLY)
        params._beam_step = True
        return params


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
