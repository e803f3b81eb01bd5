"""The OpenAI JSON of a response, whole or as SSE chunks (bytes): its choices' text, logprobs in the
completions' legacy form or chat's, an echoed prompt, usage."""

from __future__ import annotations

import time
import uuid

import msgspec

from fastllm.engine.detokenizer import IncrementalDetokenizer, text_bytes
from fastllm.outputs import CompletionOutput, RequestOutput


def sse(payload) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class _Echo:
    """A prompt as `echo` writes it back: its text and, when the prompt was scored, the legacy logprobs
    of its tokens (the first has none: nothing predicts it), each token as it renders in the prompt."""

    def __init__(self, out: RequestOutput, tokenizer, skip_special_tokens: bool):
        ids = out.prompt_token_ids
        detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens, stop=[])
        self.pieces, self.offsets = [], []
        for token in ids:
            self.offsets.append(len(detokenizer.text))
            detokenizer.add_token(token)
            self.pieces.append(detokenizer.last_piece)
        self.text = out.prompt if out.prompt is not None else detokenizer.text
        self.logprobs = None
        if out.prompt_logprobs is not None:
            scored = out.prompt_logprobs
            rest = range(1, len(ids))
            self.logprobs = (list(self.pieces), [None] + [scored[p][ids[p]].logprob for p in rest],
                             [None] + [_top_dict(scored[p], ids[p], self.pieces[p]) for p in rest])


def _top_dict(step: dict, chosen: int, chosen_text: str) -> dict:
    """Legacy top_logprobs: token string -> logprob, one key per string (the likelier wins)."""
    top = {}
    for token_id, lp in step.items():
        if token_id == chosen:
            key = chosen_text
        else:
            key = lp.decoded_token if lp.decoded_token is not None else str(token_id)
        if key not in top:
            top[key] = lp.logprob
    return top


class ResponseShape:
    """The OpenAI JSON of one response: completion or chat, whole or as SSE chunks (bytes)."""

    def __init__(self, prefix: str, kind: str, model: str, n: int, chat: bool, num_logprobs: int | None,
                 echo_tokenizer=None, tokenizer=None, score_only: bool = False, token_ids: bool = False,
                 skip_special_tokens: bool = True):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.kind, self.model, self.n, self.chat = kind, model, n, chat
        self.created = int(time.time())
        self.num_logprobs = num_logprobs or 0
        self.echo_tokenizer = echo_tokenizer  # set for completions' echo: it writes the prompt back
        self.skip_special_tokens = skip_special_tokens  # the echo's, as the generated text's
        self.tokenizer = tokenizer or echo_tokenizer  # chat logprobs' bytes of "bytes:" tokens
        self.score_only = score_only  # echo with max_tokens 0: the generated token is not shown
        self.token_ids = token_ids  # return_token_ids: each choice carries its token ids
        self._echoes: dict[int, _Echo] = {}  # prompt index -> its echo, shared by the prompt's n choices
        self._text_offsets: dict[int, int] = {}  # choice index -> characters streamed so far
        self._ended: set[int] = set()  # choices whose finish_reason has been streamed
        self.chunk_kind = kind + ".chunk" if chat else kind
        self._chunk_head = (b'data: {"id":' + msgspec.json.encode(self.id) + b',"object":"'
                            + self.chunk_kind.encode() + b'","created":' + str(self.created).encode()
                            + b',"model":' + msgspec.json.encode(model) + b',"choices":[')

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def _echo(self, prompt_index: int, out: RequestOutput) -> _Echo | None:
        if self.echo_tokenizer is None:
            return None
        if prompt_index not in self._echoes:
            self._echoes[prompt_index] = _Echo(out, self.echo_tokenizer, self.skip_special_tokens)
        return self._echoes[prompt_index]

    # whole responses

    def full(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for p, out in enumerate(finals):
            for o in out.outputs:
                choice = {"index": p * self.n + o.index}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": o.text}
                    choice["logprobs"] = self._chat_logprobs(o)
                else:
                    echo = self._echo(p, out)
                    generated = o if not self.score_only else _nothing(o)
                    choice["text"] = (echo.text if echo else "") + generated.text
                    choice["logprobs"] = _completion_logprobs(generated, 0, echo)
                choice["finish_reason"] = o.finish_reason
                if self.token_ids:
                    choice["token_ids"] = [] if self.score_only else o.token_ids
                choices.append(choice)
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        completion_tokens = sum(len(o.token_ids) for out in finals for o in out.outputs)
        usage = _usage(prompt_tokens, 0 if self.score_only else completion_tokens)
        return {**self._head(self.kind), "choices": choices, "usage": usage}

    # stream chunks

    def role_chunk(self) -> bytes:
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(self.n)]
        return self._chunk_head + msgspec.json.encode(choices)[1:-1] + b"]}\n\n"

    def chunk(self, prompt_index: int, out: RequestOutput) -> bytes:
        """One SSE event with each sample's news of one prompt's output (b"" when none has any): a choice
        that has ended is not written again (its delta repeats its finish_reason)."""
        parts = []
        for o in out.outputs:
            index = prompt_index * self.n + o.index
            if index in self._ended:
                continue
            if o.finish_reason is not None:
                self._ended.add(index)
            if self.chat:
                choice = {"index": index, "delta": {"content": o.text} if o.text else {},
                          "logprobs": self._chat_logprobs(o) if o.logprobs is not None else None,
                          "finish_reason": o.finish_reason}
            else:
                text, logprobs = self._completion_delta(index, prompt_index, o, out)
                choice = {"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": o.finish_reason}
            if self.token_ids:
                choice["token_ids"] = [] if self.score_only else o.token_ids
            parts.append(msgspec.json.encode(choice))
        return self._chunk_head + b",".join(parts) + b"]}\n\n" if parts else b""

    def _completion_delta(self, index: int, prompt_index: int, o: CompletionOutput, out: RequestOutput):
        echo = None
        if index not in self._text_offsets:  # the choice's first chunk writes the prompt back
            if out.prompt_logprobs is not None and len(out.prompt_logprobs) < len(out.prompt_token_ids):
                return "", None  # a prompt scored in chunks: its echo waits for the last chunk's logprobs
            echo = self._echo(prompt_index, out)
        generated = o if not self.score_only else _nothing(o)
        offset = self._text_offsets.get(index, 0)
        # The next token's offset: after this chunk's tokens, the text of which may come in a later chunk
        # (held back while it could begin a stop string).
        added = len(generated.text) if o.logprobs is None else sum(
            len(step[t].decoded_token or "") for t, step in zip(generated.token_ids, generated.logprobs))
        self._text_offsets[index] = offset + added + (len(echo.text) if echo else 0)
        text = (echo.text if echo else "") + generated.text
        logprobs = _completion_logprobs(generated, offset, echo) if o.logprobs is not None else None
        return text, logprobs

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        payload = {**self._head(self.chunk_kind), "choices": [],
                   "usage": _usage(prompt_tokens, 0 if self.score_only else completion_tokens)}
        return sse(payload)

    def _chat_logprobs(self, o: CompletionOutput) -> dict | None:
        """The chat form: per token its text, logprob, UTF-8 bytes and the most likely alternatives."""
        if o.logprobs is None:
            return None
        tokenizer, num = self.tokenizer, self.num_logprobs

        def entry(token_id, lp):
            text = lp.decoded_token if lp.decoded_token is not None else ""
            return {"token": text, "logprob": lp.logprob, "bytes": text_bytes(text, tokenizer, token_id)}

        content = []
        for token_id, step in zip(o.token_ids, o.logprobs):
            top, seen = [], set()
            for t, lp in sorted(step.items(), key=lambda item: item[1].rank):
                if lp.rank <= num and lp.decoded_token not in seen:
                    seen.add(lp.decoded_token)
                    top.append(entry(t, lp))
            content.append({**entry(token_id, step[token_id]), "top_logprobs": top[:num]})
        return {"content": content}


def _nothing(o: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(o.index, "", [], o.cumulative_logprob, [] if o.logprobs is not None else None,
                            o.finish_reason, o.stop_reason)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _completion_logprobs(o: CompletionOutput, text_offset: int, echo: _Echo | None = None) -> dict | None:
    """The legacy completions form: tokens, token_logprobs, top_logprobs, text_offset; an echoed
    prompt's tokens first. Each token's string is what it adds to the text, so they join to it."""
    if o.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    if echo is not None:
        if echo.logprobs is not None:
            tokens, token_logprobs, top = (list(x) for x in echo.logprobs)
            offsets = [text_offset + o for o in echo.offsets]
        text_offset += len(echo.text)
    for token_id, step in zip(o.token_ids, o.logprobs):
        chosen = step[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top.append(_top_dict(step, token_id, text))
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
