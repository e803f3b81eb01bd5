"""A model directory's Hugging Face tokenizer: loaded by the engine, and by a server's process for its own
tokenizing and detokenizing (which imports none of the model stack for it)."""

from __future__ import annotations

import logging
import threading

from fastllm.config import has_tokenizer

logger = logging.getLogger(__name__)

# One load at a time: transformers' lazy imports are not thread-safe (a second thread importing them
# meanwhile got "cannot import name 'AutoTokenizer'"), and a server loads its tokenizer on a thread.
_loading = threading.Lock()


def load_tokenizer(path: str):
    """The HF tokenizer of a model directory, or None when it ships none (dummy-weight configs)."""
    if not has_tokenizer(path):
        logger.info("no tokenizer in %s: prompts must be token ids and outputs carry no text", path)
        return None
    with _loading:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)


def eos_token_id(tokenizer, config_eos_token_id: int | None) -> int | None:
    """The token that ends a sequence: the tokenizer's, else the model config's."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return config_eos_token_id
