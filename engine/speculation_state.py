"""A request's speculation: its drafts for the next step, what became of earlier ones, and how
many drafts to ask for next (adapted to the measured acceptance). Pure Python.

How many drafts pay depends on how often they are accepted. Taking each draft as accepted with
probability a, independently, until the first rejection, k drafts yield on average
(1 - a^(k+1)) / (1 - a) tokens (the accepted ones and the token the verify step samples after
them) for a step that costs cost(k) plain decode steps (verifying and drafting them, as
measured on this machine: engine/speculation_costs.py). The next k maximises tokens per cost
over 0 .. cap. `a` is estimated per request from its own verify steps: accepted drafts
against first rejections, both decayed step by step (a drafter good on a copied passage and
poor after it is soon asked for fewer). A request whose estimate says 0 drafts is asked for one
draft every PROBE_EVERY steps, so that a passage worth drafting is found again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

DECAY = 0.85  # weight of the past in the acceptance counts, per verify step
PRIOR = (2.0, 1.0)  # pseudo-counts (accepted, rejected): 2/3 before any verify step
PROBE_EVERY = 8  # steps between probes of a request whose estimate asks for no drafts


@dataclass
class Proposal:
    """Draft tokens for a request's next step. `probs`: the drafter's distribution at each
    draft ([k, V] float32 on the model's device) when it sampled them; None when it chose them
    outright (an n-gram continuation, a greedy draft): then verification compares them with
    the target's own tokens."""

    tokens: tuple[int, ...]
    probs: object | None = None


@dataclass
class SpeculationState:
    """One request's speculation. `method`: the drafter ("ngram", "draft", "mtp"); `cap`: the
    most drafts per step; `drafter`: the drafter's own per-request state."""

    method: str
    cap: int
    proposal: Proposal | None = None
    drafter: object | None = None
    drafted: int = 0  # draft tokens verified so far
    accepted: int = 0  # of which accepted
    steps: int = 0  # verify steps
    _hits: float = PRIOR[0]
    _misses: float = PRIOR[1]
    asked: int = 0  # drafts asked for at the last step (0: none, a plain step)
    _idle: int = 0  # steps since the last draft
    history: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per step

    @property
    def acceptance(self) -> float:
        """The estimated probability that a draft is accepted (given its predecessors were)."""
        return self._hits / (self._hits + self._misses)

    def record(self, drafted: int, accepted: int) -> None:
        """A verify step checked `drafted` drafts and kept the first `accepted`."""
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        self.history.append((drafted, accepted))
        self._hits = DECAY * self._hits + accepted
        self._misses = DECAY * self._misses + (accepted < drafted)

    def next_k(self, cost: Callable[[int], float], settled: bool = True) -> int:
        """How many drafts to ask for next: see the module docstring. `cost(k)`: a step with k
        drafts in plain decode steps (1 at k = 0); `settled`: measured enough to stop probing
        on."""
        self.asked = self._next_k(cost, settled)
        return self.asked

    def _next_k(self, cost: Callable[[int], float], settled: bool) -> int:
        k = best_k(self.acceptance, self.cap, cost)
        if k == 0:
            if settled and best_k(1.0, self.cap, cost) == 0:  # no acceptance would pay
                self._idle = 0
                return 0
            self._idle += 1
            if self._idle >= PROBE_EVERY:
                self._idle = 0
                return min(1, self.cap)
            return 0
        self._idle = 0
        return k


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step of k drafts yields on average (accepted drafts + the sampled one)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_k(acceptance: float, cap: int, cost: Callable[[int], float]) -> int:
    """The k in 0 .. cap with the most tokens per unit of cost (the smallest on a tie);
    `cost(k)` in plain decode steps."""
    best, best_rate = 0, 1.0 / cost(0)
    for k in range(1, cap + 1):
        rate = expected_tokens(acceptance, k) / cost(k)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best
