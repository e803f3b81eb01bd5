"""When speculation pays: the number of tokens to propose each step, k or 0 (pure Python).

A step that verifies k drafts costs T_k(B) at batch B (the speculative graph's measured replay time)
against T_0(B) for a plain decode step, and gives each request E_k = (1 - a^(k+1)) / (1 - a) tokens
on average when each draft is accepted with probability a (the acceptance rate measured over the
last drafts). Speculation pays while E_k / T_k(B) beats 1 / T_0(B); a 5% margin keeps the choice
from flapping. While it is off nothing measures a, so every PROBE_INTERVAL plain steps one step
proposes again, and the step that verifies those drafts refreshes the estimate.

Without measured step costs (no CUDA graphs: the CPU, enforce_eager) or with adaptive=False the
policy always proposes k.
"""

from __future__ import annotations

import bisect
import logging

logger = logging.getLogger(__name__)

MARGIN = 1.05
PROBE_INTERVAL = 32
WINDOW_DRAFT_TOKENS = 256  # the acceptance estimate covers about this many recent draft tokens


def expected_tokens(acceptance_rate: float, k: int) -> float:
    """Tokens a request emits per verify step with k drafts, each accepted with probability a
    until the first rejection: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance_rate ** i for i in range(k + 1))


class SpecPolicy:
    def __init__(self, k: int, adaptive: bool):
        self.k = k
        self.adaptive = adaptive
        self.acceptance_rate = 1.0  # optimistic until measured: speculate first, then judge
        self._spec_ms: list[tuple[int, float]] = []  # (batch size, ms), sorted
        self._plain_ms: list[tuple[int, float]] = []
        self._plain_steps = 0
        self._on: bool | None = None

    def set_step_costs(self, spec_ms: dict[int, float], plain_ms: dict[int, float]) -> None:
        """Measured step times by batch size; sizes past the largest speculative one never speculate."""
        self._spec_ms, self._plain_ms = sorted(spec_ms.items()), sorted(plain_ms.items())

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verified drafts: update the acceptance estimate (an exponential average of
        about WINDOW_DRAFT_TOKENS draft tokens)."""
        if num_drafts:
            weight = min(1.0, num_drafts / WINDOW_DRAFT_TOKENS)
            self.acceptance_rate += weight * (num_accepted / num_drafts - self.acceptance_rate)

    def num_to_propose(self, batch_size: int) -> int:
        if not self.adaptive or not self._spec_ms or batch_size == 0:
            return self.k
        pays, why = self._pays(batch_size)
        if not pays:
            self._plain_steps += 1
            if self._plain_steps % PROBE_INTERVAL == 0 and batch_size <= self._spec_ms[-1][0]:
                return self.k  # a probe: its drafts are verified next step, which measures them again
        self._say(pays, batch_size, why)
        return self.k if pays else 0

    def _pays(self, batch_size: int) -> tuple[bool, str]:
        spec, plain = _at(self._spec_ms, batch_size), _at(self._plain_ms, batch_size)
        if spec is None:
            return False, f"batch {batch_size} is past the largest speculative graph"
        if plain is None:
            return True, "no plain decode graph to compare with"
        tokens = expected_tokens(self.acceptance_rate, self.k)
        gain = tokens * plain / spec
        return gain >= MARGIN, (f"batch {batch_size}: acceptance {self.acceptance_rate:.2f} gives {tokens:.2f} tokens "
                                f"a step at {spec:.2f} ms against 1 at {plain:.2f} ms plain ({gain:.2f}x)")

    def _say(self, on: bool, batch_size: int, why: str) -> None:
        if on != self._on:
            self._on = on
            logger.info("speculative decoding %s: %s", "on" if on else "off (proposes again to re-measure)", why)


def _at(costs: list[tuple[int, float]], batch_size: int) -> float | None:
    """The cost of the smallest measured size >= batch_size (the graph a batch pads to)."""
    i = bisect.bisect_left(costs, (batch_size, float("-inf")))
    return costs[i][1] if i < len(costs) else None
