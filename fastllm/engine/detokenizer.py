"""Incremental detokenization, stop strings, and token strings for logprobs.

tokenizers' DecodeStream, primed with the prompt's last tokens, turns each new token id into the
text it adds: sentencepiece word-boundary spaces come out right, and a multi-byte character split
across byte-fallback tokens appears only once it is complete.

Stop strings are looked for once min_tokens tokens exist. The text's tail that could still grow into a
stop string is held back (`held`): a stream never shows characters that a later stop would cut.
"""

from __future__ import annotations

import logging
import re

from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

# Prompt tokens given to the stream as context (enough for any multi-token character or space).
_CONTEXT_TOKENS = 6
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.context = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # the last tokens, for render()
        self.stream = DecodeStream(ids=list(self.context), skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.text = ""
        self.held = 0  # characters at the end of text that may yet start a stop string
        self.last_piece = ""  # the text the last token added (what it renders as, in context)
        self.restarted = False  # the stream raised on a token and started again (_step)

    def add_token(self, token_id: int) -> str | None:
        """Extend the text by one token. Returns the stop string if one now appears (the text is
        then cut before it, or after it with include_stop_str_in_output)."""
        self.num_tokens += 1
        piece = self._step(token_id) or ""
        self.context = self.context[1 - _CONTEXT_TOKENS:] + [token_id]
        self.last_piece = piece
        if not piece:
            return None
        before = len(self.text)
        self.text += piece
        if self.stop and self.num_tokens >= self.min_tokens:
            for stop in self.stop:
                # only a stop that ends in this piece: one wholly before it was found then, or came before
                # min_tokens (and was streamed)
                index = self.text.find(stop, max(0, before - len(stop) + 1))
                if index != -1:
                    self.text = self.text[:index + (len(stop) if self.include_stop else 0)]
                    self.held = 0
                    return stop
        if self.stop:
            self.held = _stop_prefix_len(self.text, self.stop)
        return None

    def _step(self, token_id: int) -> str | None:
        """The stream's step. DecodeStream raises "Invalid prefix encountered" where a byte-fallback token
        that ends no character turns text it already gave out into another (a newline, then the lead byte
        <0xCE>, then "."), a sequence any model may sample. The stream then starts again from this token
        alone (as vLLM's does): the text streamed so far stays as it was given."""
        try:
            return self.stream.step(self.backend, token_id)
        except Exception as e:  # tokenizers raises a bare Exception
            if "Invalid prefix" not in str(e):
                raise
            if not self.restarted:  # (once a request: a model can sample such tokens often)
                logger.warning("detokenizer: %s; the stream starts again", e)
            self.restarted = True
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return self.stream.step(self.backend, token_id)

    def render(self, token_id: int) -> str:
        """The text token_id would add after the tokens so far (each top-logprob alternative): its
        leading space and all. A token that ends inside a multi-byte character is written
        "bytes:\\xNN..." from its own bytes, as OpenAI does."""
        return render_token(self.tokenizer, self.context, token_id, self.skip_special_tokens)


def render_token(tokenizer, context: list[int], token_id: int, skip_special_tokens: bool = True) -> str:
    backend = tokenizer.backend_tokenizer
    before = backend.decode(context, skip_special_tokens=skip_special_tokens).rstrip("\ufffd")
    after = backend.decode(context + [token_id], skip_special_tokens=skip_special_tokens)
    if after.startswith(before) and not after.endswith("\ufffd"):
        return after[len(before):]
    return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes(tokenizer, token_id))


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for: a byte-fallback token's byte, a byte-level BPE token's bytes,
    or the UTF-8 of a sentencepiece piece (its word-boundary mark as a space)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    match = _BYTE_TOKEN.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    byte_decoder = getattr(tokenizer, "byte_decoder", None) or _byte_level_decoder(tokenizer)
    if byte_decoder is not None and all(c in byte_decoder for c in piece):
        return bytes(byte_decoder[c] for c in piece)
    return piece.replace("\u2581", " ").encode()


def text_bytes(text: str, tokenizer=None, token_id: int | None = None) -> list[int]:
    """A logprob token's bytes (chat's `bytes`): its rendered text's UTF-8, or a "bytes:" token's own."""
    if text.startswith("bytes:\\x") and tokenizer is not None and token_id is not None:
        return list(token_bytes(tokenizer, token_id))
    return list(text.encode())


def _byte_level_decoder(tokenizer) -> dict[str, int] | None:
    """GPT-2's byte <-> printable character map, for tokenizers whose decoder is ByteLevel."""
    if "ByteLevel" not in repr(tokenizer.backend_tokenizer.decoder):
        return None
    cached = getattr(_byte_level_decoder, "table", None)
    if cached is None:
        printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
            + list(range(ord("\xae"), ord("\xff") + 1))
        codes, n = list(printable), 0
        for b in range(256):
            if b not in printable:
                printable.append(b)
                codes.append(256 + n)
                n += 1
        cached = _byte_level_decoder.table = {chr(c): b for b, c in zip(printable, codes)}
    return cached


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """The longest tail of text that is a proper prefix of a stop string (0 when none)."""
    last = text[-1:]
    best = 0
    for stop in stops:
        # Only prefixes that end with text's last character can match its tail.
        index = stop.find(last, 0, len(stop) - 1)
        while index != -1:
            k = index + 1
            if k > best and k <= len(text) and text.endswith(stop[:k]):
                best = k
            index = stop.find(last, index + 1, len(stop) - 1)
    return best
