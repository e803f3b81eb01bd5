"""Incremental detokenization and stop strings.

tokenizers' DecodeStream, primed with the prompt's last tokens, turns each new token id into the
text it adds: sentencepiece word-boundary spaces come out right, and a multi-byte character split
across byte-fallback tokens appears only once it is complete.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# Prompt tokens given to the stream as context (enough for any multi-token character or space).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool = False):
        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.text = ""

    def add_token(self, token_id: int) -> str | None:
        """Extend the text by one token. Returns the stop string if one now appears (the text is
        then cut before it, or after it with include_stop_str_in_output)."""
        piece = self.stream.step(self.backend, token_id)
        if not piece:
            return None
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += piece
        for stop in self.stop:
            index = self.text.find(stop, start)
            if index != -1:
                self.text = self.text[:index + (len(stop) if self.include_stop else 0)]
                return stop
        return None
