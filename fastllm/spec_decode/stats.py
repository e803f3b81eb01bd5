"""Counts of speculative decoding's drafts and how many of their tokens the target accepted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verifications of one request's draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def since(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts added after `earlier` (a copy taken then)."""
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step gives a request: its accepted drafts plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
