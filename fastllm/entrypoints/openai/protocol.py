"""The OpenAI API's request bodies (msgspec structs: every OpenAI field, plus vLLM's sampling extras and
its beam search on completions), their checks, and OpenAI's error body.

A body is decoded and type-checked by msgspec (an error names the field: "Expected `int`, got `str` -
at `$.n`"), then turned into SamplingParams, whose own checks name the field and its range. Every field
of OpenAI's API is declared: the harmless ones are accepted (user, metadata, response_format "text",
...), the others are refused as "not supported" (tools, response_format json, audio, ...); only a name
that is no OpenAI or vLLM field is an "unknown field". Every failure is HTTP 400 with OpenAI's error body.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

import msgspec

from fastllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return error_body(self.status, str(self), self.kind, self.param)


def error_body(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


_AT = re.compile(r"at `\$\.?([A-Za-z_][\w]*)")
_UNKNOWN = re.compile(r"unknown field `(\w+)`")
_FIELD = re.compile(r"(?:Sampling|BeamSearch)Params\.(\w+)")


def param_of(message: str) -> str | None:
    """The field an error message names (msgspec's "at `$.n`", SamplingParams' "SamplingParams.n",
    BeamSearchParams' likewise)."""
    # (msgspec's path first: an unknown key inside a field names that field)
    match = _AT.search(message) or _UNKNOWN.search(message) or _FIELD.search(message)
    return match.group(1) if match else None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What completions and chat share: OpenAI's sampling fields and vLLM's extras."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_token_ids: bool = False  # each choice (and chunk) carries its token ids too

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=_or(self.n, 1), temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0),
            min_p=_or(self.min_p, 0.0), seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self.token_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with token-id keys, each value in OpenAI's [-100, 100]; the ids are checked against
        the vocabulary where it is known (SamplingParams.check_token_ids)."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not re.fullmatch(r"[0-9]{1,19}", key):  # (ASCII: \d takes every script's digits)
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            if not (math.isfinite(value) and -100 <= value <= 100):
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {value!r}",
                               param="logit_bias")
            bias[int(key)] = value
        return bias

    _PROMPT_FIELD = "prompt"  # (not a field: unannotated)

    def refusal(self, e: ValueError) -> APIError:
        """The engine's refusal of this request as a 400 naming the field its message names, else the
        prompt's (empty, too long, a token id outside the vocabulary)."""
        message = str(e)
        return APIError(400, message, param=param_of(message) or self._PROMPT_FIELD)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_options(self) -> None:
        """As vLLM: stream_options only with stream; usage in every chunk is not done here (no silent no-op)."""
        if self.stream_options is None:
            return
        if not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if self.stream_options.continuous_usage_stats:
            raise APIError(400, "stream_options.continuous_usage_stats is not supported (include_usage is)",
                           param="stream_options")


def _or(value, default):
    return default if value is None else value


class CompletionRequest(_Request, kw_only=True):
    # text, texts, token ids, or lists of token ids (checked by prompts(): msgspec takes one list type)
    prompt: str | list[Any] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's beam search: the beam width is best_of, else n; the n best beams are the choices
    use_beam_search: bool = False
    length_penalty: float | None = None  # None: 1.0
    early_stopping: bool | Literal["never"] | None = None  # None: False

    def check_supported(self) -> None:
        self.check_stream_options()
        if self.prompt is None:
            raise APIError(400, "prompt is required", param="prompt")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        n = _or(self.n, 1)
        if self.best_of is not None and self.best_of < n:
            raise APIError(400, f"best_of must be >= n ({n}), got {self.best_of}", param="best_of")
        if self.use_beam_search:
            return  # beam_search_params() checks the rest
        if self.best_of is not None and self.best_of > n:
            raise APIError(400, "best_of > n is not supported without use_beam_search (whose beam width it "
                           "is): sampling best_of sequences to return the n likeliest is not implemented",
                           param="best_of")
        for name, neutral in (("length_penalty", 1), ("early_stopping", False)):
            if getattr(self, name) not in (None, neutral):
                raise APIError(400, f"{name} applies to beam search only (use_beam_search: true)", param=name)

    def beam_search_params(self) -> tuple[BeamSearchParams, int]:
        """use_beam_search's BeamSearchParams, and n: how many of its best beams are the choices. A sampling
        field that beam search does not apply is refused unless it asks for nothing; temperature must
        be 0 (None means 0 here) and max_tokens given."""
        for name, neutral in _NOT_WITH_BEAMS.items():
            if getattr(self, name) not in neutral:
                raise APIError(400, f"{name} is not supported with use_beam_search", param=name)
        if self.temperature not in (None, 0):
            raise APIError(400, f"temperature must be 0 with use_beam_search (the search is deterministic: "
                           f"beam sampling is not implemented), got {self.temperature}", param="temperature")
        if self.max_tokens is None:
            raise APIError(400, "max_tokens is required with use_beam_search", param="max_tokens")
        n = _or(self.n, 1)
        if n < 1:
            raise APIError(400, f"n must be >= 1, got {n}", param="n")
        try:
            params = BeamSearchParams(_or(self.best_of, n), self.max_tokens, ignore_eos=self.ignore_eos,
                                      length_penalty=_or(self.length_penalty, 1.0),
                                      early_stopping=_or(self.early_stopping, False))
        except ValueError as e:
            raise self.beam_search_error(e) from None
        return params, n

    def beam_search_error(self, e: ValueError) -> APIError:
        """A beam search's ValueError in this request's terms: its beam_width is best_of (or n)."""
        width_field = "best_of" if self.best_of is not None else "n"
        message = str(e).replace("BeamSearchParams.beam_width", f"{width_field} (the beam width)")
        param = param_of(str(e)) or self._PROMPT_FIELD  # (no field named: the engine refused the prompt)
        return APIError(400, message, param=width_field if param == "beam_width" else param)

    def prompts(self) -> list:
        """One engine prompt per entry: text, or token ids as {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(_is_token(t) for t in p):
            return [{"prompt_token_ids": p}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) and all(_is_token(t) for t in x) for x in p):
            return [{"prompt_token_ids": x} for x in p]
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                       "lists of token ids", param="prompt")


# Sampling fields that beam search does not apply, and the values of each that ask for nothing.
_NOT_WITH_BEAMS = {
    "logprobs": (None,), "top_p": (None, 1), "top_k": (None, 0, -1), "min_p": (None, 0), "seed": (None,),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "min_tokens": (0,), "stop": (None, [], ""), "stop_token_ids": (None, []), "logit_bias": (None, {}),
    "allowed_token_ids": (None,), "bad_words": (None, []), "include_stop_str_in_output": (False,),
}


def _is_token(t) -> bool:
    return type(t) is int


class ContentPart(msgspec.Struct, kw_only=True):
    """A part of a chat message's content: text, or a kind this server does not take."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted, not used
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None

    def text(self, index: int) -> str:
        """The content as one string: text parts joined by newlines (vLLM's way)."""
        where = f"messages[{index}]"
        if self.role in ("tool", "function") or self.tool_calls or self.tool_call_id or self.function_call:
            raise APIError(400, f"{where}: tool and function calls are not supported", param="messages")
        if self.audio is not None:
            raise APIError(400, f"{where}: audio is not supported", param="messages")
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type not in ("text", "refusal"):
                raise APIError(400, f"{where}: content parts of type {part.type!r} are not supported "
                               "(text only)", param="messages")
            text = part.text if part.type == "text" else part.refusal
            if text is None:
                raise APIError(400, f"{where}: a content part of type {part.type!r} needs its `{part.type}` "
                               "field", param="messages")
            texts.append(text)
        return "\n".join(texts)


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: Any = None


# OpenAI chat fields this server refuses when they ask for something (an empty or default value passes).
_UNSUPPORTED_CHAT = ("tools", "functions", "audio", "prediction", "web_search_options")


class ChatCompletionRequest(_Request, kw_only=True):
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # OpenAI fields accepted when harmless
    response_format: ResponseFormat | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI fields refused (not supported)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # vLLM's
    use_beam_search: bool = False  # refused: beam search is served on /v1/completions
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        self.check_stream_options()
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        for name in _UNSUPPORTED_CHAT:
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", param=name)
        if self.function_call not in (None, "none"):
            raise APIError(400, "function_call is not supported", param="function_call")
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice is not supported (no tools)", param="tool_choice")
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, f"response_format {self.response_format.type!r} is not supported (text only)",
                           param="response_format")
        if self.modalities not in (None, ["text"]):
            raise APIError(400, "modalities other than [\"text\"] are not supported", param="modalities")
        if self.store:
            raise APIError(400, "store is not supported", param="store")
        if self.use_beam_search:
            raise APIError(400, "use_beam_search is supported on /v1/completions only",
                           param="use_beam_search")

    _PROMPT_FIELD = "messages"

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def refusal(self, e: ValueError) -> APIError:
        """As _Request's, in chat's names: SamplingParams.logprobs is top_logprobs here, and max_tokens is
        max_completion_tokens where that was given."""
        refused = super().refusal(e)
        message, param = str(refused), refused.param
        if param == "logprobs":
            message, param = message.replace("SamplingParams.logprobs", "top_logprobs"), "top_logprobs"
        elif param == "max_tokens" and self.max_completion_tokens is not None:
            message = message.replace("SamplingParams.max_tokens", "max_tokens")
            message, param = message.replace("max_tokens", "max_completion_tokens"), "max_completion_tokens"
        return APIError(400, message, param=param)

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def texts(self) -> list[dict]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


def decode_body(body: bytes, kind: type):
    """A request body as `kind`, or APIError 400 naming what is wrong."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        message = str(e)
        raise APIError(400, message, param=param_of(message)) from None
    except RecursionError:  # (msgspec's decoder recurses into each array and object)
        raise APIError(400, "the body nests arrays or objects too deeply to parse") from None
    except msgspec.DecodeError as e:
        message = str(e)
        surrogate = _LONE_SURROGATE.search(body)
        if surrogate is not None:  # msgspec says only "truncated"
            message = f"a string holds a lone surrogate ({surrogate.group().decode()})"
        field = _field_json_cannot_hold(body)
        where = f" (at `{field}`)" if field else ""
        raise APIError(400, f"the request body is not valid JSON of valid Unicode{where}: {message}",
                       param=field) from None


_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|"
                             rb"(?<![0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _field_json_cannot_hold(body: bytes) -> str | None:
    """The top-level field whose value holds what strict JSON cannot (NaN, Infinity, a lone surrogate):
    Python's parser takes those, so the body is parsed again by it and its fields searched; a value no
    parser takes (inf, nan) names the key right before it. None where the body itself is malformed
    (truncated, trailing data, invalid UTF-8) or a key is the culprit."""
    try:
        fields = json.loads(body)
    except json.JSONDecodeError as e:
        key = _KEY_BEFORE.search(e.doc[:e.pos]) if e.msg == "Expecting value" else None
        return key.group(1) if key else None
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    if isinstance(fields, dict) and all(_strict(key) for key in fields):
        return next((key for key, value in fields.items() if not _strict(value)), None)
    return None


def _strict(value) -> bool:
    """Whether strict JSON of valid Unicode holds value (parsed by Python's json)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return not _SURROGATE.search(value)
    if isinstance(value, list):
        return all(_strict(v) for v in value)
    if isinstance(value, dict):
        return all(_strict(k) and _strict(v) for k, v in value.items())
    return True


_SURROGATE = re.compile("[\ud800-\udfff]")
_KEY_BEFORE = re.compile(r'"(\w+)"\s*:\s*$')


def request_schemas() -> dict:
    """JSON schemas of the two request bodies (the OpenAPI document's components)."""
    (completion, chat), components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest], ref_template="#/components/schemas/{name}")
    return {"completion": completion, "chat": chat, "components": components}
