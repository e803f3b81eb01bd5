"""When speculation pays: the number of tokens to propose each step, k or 0 (pure Python).

A decode step that verifies k drafts takes T_k(B) at batch B against T_0(B) for a plain decode step,
and gives each request E_k = 1 + a + ... + a^k tokens on average when each draft is accepted with
probability a given the ones before it were. Speculation pays while E_k / T_k(B) beats 1 / T_0(B).
It turns on only when it pays by a 5% margin and off when it stops paying at all: between the two, the
choice stays as it is, so an estimate that wanders around one threshold does not flip it step after step
(each turn on after plain steps costs the draft a catch-up forward).

- T is wall-clock time per step, as the engine sees it (observe()): a plain step overlaps its host
  work with the GPU (async scheduling) while a speculative one cannot, so a small model whose plain
  steps are host-bound gains from drafts that its GPU time alone would reject. A size's cost is the
  low median of its last STEP_TIME_WINDOW measured steps of that kind, so a pause in one step (a
  collection) moves it by nothing once a second step is measured; until one is, the CUDA graphs' replay
  time at startup stands in.
- a is measured as accepted / tried over the last WINDOW_DRAFT_TOKENS tried drafts (or over the k drafts a
  request of the last WINDOW_STEPS steps, at batches where that is more: a step of 32 requests tries ~100, too
  noisy an estimate to decide on), with PRIOR_DRAFTS more counted as accepted: a verification of n drafts
  that keeps m tried m + 1 of them (m if m = n); the drafts after the first rejection were never tried.
  The prior makes the first steps speculate and keeps a few unlucky first verifications from turning
  speculation off; a prior worth a whole window would keep a batch-1 request speculating for tens of steps
  at no acceptance.
- While speculation is off nothing measures a, so a step proposes again after PROBE_INTERVAL plain
  steps; each probe that finds it still not paying doubles the interval (up to MAX_PROBE_INTERVAL).
  A probe costs more than its speculative step: the draft model first catches up on the tokens it
  missed (one forward of the draft without graphs). So the wait before the next probe is also at least what keeps
  probes, at the last one's measured cost beyond plain steps, under PROBE_BUDGET of the decode time.

Without step costs (no CUDA graphs: the CPU, enforce_eager) or with adaptive=False the policy always
proposes k.
"""

from __future__ import annotations

import bisect
import logging
import statistics
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

MARGIN = 1.05
PROBE_INTERVAL = 32
MAX_PROBE_INTERVAL = 1024
WINDOW_DRAFT_TOKENS = 64  # the acceptance estimate is over about this many recent tried drafts, at least
WINDOW_STEPS = 4  # and over about this many steps' drafts at larger batches
PRIOR_DRAFTS = 4  # pseudo-drafts, all accepted, in every estimate (speculate first, then judge)
STEP_TIME_WINDOW = 8  # a size's last measured steps of each kind, whose low median is its cost
PROBE_BUDGET = 0.02  # of the decode time, at most, spent on probes beyond what plain steps would take


def expected_tokens(acceptance_rate: float, k: int) -> float:
    """Tokens a request emits per verify step with k drafts, each accepted with probability a
    until the first rejection: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance_rate ** i for i in range(k + 1))


class SpecPolicy:
    def __init__(self, k: int, adaptive: bool):
        self.k = k
        self.adaptive = adaptive
        self._verified: deque[tuple[int, int]] = deque()  # (accepted, tried) of recent verifications
        self._accepted = self._tried = 0  # their sums
        self._window = WINDOW_DRAFT_TOKENS  # tried drafts
        self._sizes: list[int] = []  # the speculative graphs' batch sizes, sorted
        self._ms: dict[bool, dict[int, float]] = {True: {}, False: {}}  # speculative? -> size -> ms a step
        self._measured_ms: dict[tuple[bool, int], deque[float]] = {}  # (speculative?, size) -> last ms
        self._plain_steps = 0
        self._probe_interval = PROBE_INTERVAL
        self._probe_ms = 0.0  # the last probe's steps' time beyond plain steps
        self._on: bool | None = None

    def set_step_costs(self, spec_ms: dict[int, float], plain_ms: dict[int, float]) -> None:
        """The graphs' replay times by batch size; sizes past the largest speculative one never speculate."""
        self._sizes = sorted(spec_ms)
        self._ms = {True: dict(spec_ms), False: {b: plain_ms.get(b, 0.0) for b in spec_ms}}
        self._measured_ms = {}

    def step_ms(self, speculative: bool, size: int) -> float:
        """A step's cost at a graph size: the low median of its last measured steps, else its replay."""
        return self._ms[speculative][size]

    def observe(self, speculative: bool, batch_size: int, seconds: float, caught_up: bool = False) -> None:
        """The wall time of one decode step (speculative or plain) of batch_size requests. A step whose draft
        first caught up on tokens it missed in plain steps counts only towards a probe's cost; a speculative
        step that ran eagerly (seeds, penalties, logprobs) is what such batches cost, and counts."""
        size = self._size(batch_size)
        if size is None:
            return
        if speculative and self._on is False:  # a probe's step
            self._probe_ms += max(0.0, 1e3 * seconds - self._ms[False][size])
        if not caught_up:
            measured = self._measured_ms.setdefault((speculative, size), deque(maxlen=STEP_TIME_WINDOW))
            measured.append(1e3 * seconds)
            self._ms[speculative][size] = statistics.median_low(measured)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verified drafts (into the window of about WINDOW_DRAFT_TOKENS tried drafts)."""
        tried = num_accepted + (num_accepted < num_drafts)
        if not tried:
            return
        self._verified.append((num_accepted, tried))
        self._accepted, self._tried = self._accepted + num_accepted, self._tried + tried
        self._trim()

    def _trim(self) -> None:
        while self._verified and self._tried - self._verified[0][1] >= self._window:
            accepted, tried = self._verified.popleft()
            self._accepted, self._tried = self._accepted - accepted, self._tried - tried

    def record_failed_lookups(self, n: int) -> None:
        """n n-gram lookups that found nothing: each request's next step gives one token, as a verification
        whose first draft is rejected does, at a speculative step's cost (it waits for its tokens to look
        up again)."""
        for _ in range(n):
            self.record(1, 0)

    @property
    def acceptance_rate(self) -> float:
        """a: accepted / tried over the window and the prior."""
        return (self._accepted + PRIOR_DRAFTS) / (self._tried + PRIOR_DRAFTS)

    def num_to_propose(self, batch_size: int) -> int:
        if not self.adaptive or not self._sizes or batch_size == 0:
            return self.k
        if self._size(batch_size) is not None:
            self._window = max(WINDOW_DRAFT_TOKENS, WINDOW_STEPS * self.k * batch_size)
            self._trim()
        pays, why = self._pays(batch_size)
        self._say(pays, why)
        if pays:
            self._plain_steps, self._probe_interval = 0, PROBE_INTERVAL
            return self.k
        self._plain_steps += 1
        size = self._size(batch_size)
        if size is not None and self._plain_steps >= self._steps_before_probe(size):
            # A probe: its drafts are verified next step, which measures them again.
            self._plain_steps, self._probe_ms = 0, 0.0
            self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
            return self.k
        return 0

    def _steps_before_probe(self, size: int) -> float:
        """The probe interval, or more plain steps if the last probe cost more than PROBE_BUDGET of them."""
        plain_ms = self._ms[False][size]
        budgeted = self._probe_ms / (PROBE_BUDGET * plain_ms) if plain_ms > 0 else 0.0
        return min(MAX_PROBE_INTERVAL, max(self._probe_interval, budgeted))

    def _size(self, batch_size: int) -> int | None:
        """The graph size a batch pads to, or None past the largest."""
        i = bisect.bisect_left(self._sizes, batch_size)
        return self._sizes[i] if i < len(self._sizes) else None

    def _pays(self, batch_size: int) -> tuple[bool, Callable[[], str]]:
        """Whether drafts pay at this batch, and why (a message made only when the decision is logged: this
        runs every step)."""
        size = self._size(batch_size)
        if size is None:
            largest = self._sizes[-1]
            return False, lambda: f"batch {batch_size} is past the largest speculative graph ({largest})"
        spec, plain = self._ms[True][size], self._ms[False][size]
        a = self.acceptance_rate
        tokens = expected_tokens(a, self.k)
        gain = tokens * plain / spec
        threshold = 1.0 if self._on else MARGIN
        return gain >= threshold, lambda: (f"batch {batch_size}: acceptance {a:.2f} gives {tokens:.2f} "
                                           f"tokens a step of {spec:.2f} ms against 1 a plain step of "
                                           f"{plain:.2f} ms ({gain:.2f}x)")

    def _say(self, on: bool, why: Callable[[], str]) -> None:
        if on != self._on:
            self._on = on
            logger.info("speculative decoding %s: %s", "on" if on else "off (probes now and then)", why())
