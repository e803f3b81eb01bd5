"""Prompt-lookup proposals (n-gram speculation): no model, a search of the request's own tokens.

The last n tokens of prompt + output are looked for earlier in the same tokens, n from
prompt_lookup_max down to prompt_lookup_min; at the most recent earlier match, the (up to k) tokens
that followed it are proposed. Text that repeats its context (code edits, quoting, summaries,
extraction) is drafted for free. Runs on the host with numpy: O(length x n) a request a step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (int64, the request's whole sequence); [] without a match."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0..length-n-1: every earlier n-gram that has a token after it.
            windows = sliding_window_view(tokens[:length - 1], n)
            matches = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start:start + k].tolist()
        return []
