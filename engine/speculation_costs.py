"""What speculation costs on this machine, measured while serving: a decode step's time by the
rows it computes, and each drafter's time per draft. Pure Python.

A step of B decoding requests computes B rows; verifying k drafts beside them adds k rows. How
much a row adds depends on the weights' format, the kernels and the CPU: near nothing where a
step is bound by reading the weights once, most of a plain step where each row pays its own
arithmetic (two-digit integer kernels at a width the CPU executes slowly). So the cost of k
drafts is not assumed but measured: steps of decodes and verifications only (no prompt chunk,
no encoder) feed a decayed mean of the step's seconds per row count R, and a verify of k drafts
beside B decodes costs t(B + k) / t(B) plain steps, t read between the row counts measured
(linear between neighbours; past the last by the slope of the last two, or the prior's). A
drafter's seconds per draft (its round's time over the round's most drafts) are weighed the same
way, in plain steps. Until a count is measured the prior stands in (`prior_per_draft` for each
verified draft, the drafter's own estimate for drafting).

A plain step's time t(B) is what every ratio divides by: when the current B has no sample, or
none in the last STALE decode steps, `needs_plain(B)` asks the speculator to draft nothing for
one step, so that the baseline follows the machine (memory bandwidth drifts over seconds on
shared hosts).

A drafter's round is timed only when each of its requests drafted the step before: a request
that resumes drafting first catches up on every token since (a draft model's forward over
them), a cost of resuming, not of a draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.8  # weight of the past in a row count's mean step time, per sample
STALE = 32  # decode steps after which a plain step's time is measured again
PRIOR_PER_DRAFT = 0.25  # a verified draft's share of a plain step before any is measured
SETTLED = 3  # samples of a step with one draft before "drafts cannot pay" is believed


@dataclass
class _Mean:
    """A decayed mean of samples (the plain mean of the first few, so that one odd first
    sample does not linger), and the decode step of the last one."""

    value: float
    at: int
    n: int = 1

    def add(self, sample: float, at: int) -> None:
        self.n += 1
        weight = max(1 - DECAY, 1 / self.n)
        self.value += weight * (sample - self.value)
        self.at = at


@dataclass
class StepCosts:
    """Measured step and drafting times, read as costs in plain decode steps."""

    prior_per_draft: float = PRIOR_PER_DRAFT
    steps: int = field(default=0, init=False)  # decode-only steps recorded
    # R -> seconds of a step of R rows; drafter -> seconds per draft
    _rows: dict[int, _Mean] = field(default_factory=dict, init=False)
    _drafting: dict[str, _Mean] = field(default_factory=dict, init=False)
    _held: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.prior_per_draft >= 0:
            raise ValueError(f"prior_per_draft must be >= 0, got {self.prior_per_draft}")

    def hold(self, per_draft: float) -> None:
        """Stop measuring: every draft costs `per_draft` plain steps (verifying and drafting
        it together). For tests and benches that need the number of drafts to be fixed by
        acceptance alone."""
        if not per_draft >= 0:
            raise ValueError(f"per_draft must be >= 0, got {per_draft}")
        self._held = per_draft

    def record_step(self, rows: int, seconds: float) -> None:
        """A step of decodes and verifications only ran: `rows` rows (one per request, one per
        verified draft) in `seconds`."""
        if rows < 1 or seconds <= 0:
            return
        self.steps += 1
        mean = self._rows.get(rows)
        if mean is None:
            self._rows[rows] = _Mean(seconds, self.steps)
        else:
            mean.add(seconds, self.steps)

    def record_drafting(self, drafter: str, depth: int, seconds: float) -> None:
        """`drafter` drafted up to `depth` tokens for each of its requests in `seconds`."""
        if depth < 1 or seconds < 0:
            return
        mean = self._drafting.get(drafter)
        if mean is None:
            self._drafting[drafter] = _Mean(seconds / depth, self.steps)
        else:
            mean.add(seconds / depth, self.steps)

    def needs_plain(self, decoding: int) -> bool:
        """Whether the next step, of `decoding` requests, should verify no drafts, so that a
        plain step of that many rows is measured (never while held)."""
        if self._held is not None or decoding < 1:
            return False
        mean = self._rows.get(decoding)
        return mean is None or self.steps - mean.at >= STALE

    def cost(self, decoding: int, cap: int, drafter: str, prior_draft: float) -> CostOfDrafts:
        """The cost of up to `cap` drafts of a request in a step of `decoding` requests, from
        `drafter`, whose own estimate of a draft's cost is `prior_draft` plain steps."""
        if self._held is not None:
            return CostOfDrafts({}, self._held, 0.0, settled=True)
        base = self.step_seconds(decoding)
        if base is None:
            return CostOfDrafts({}, self.prior_per_draft, prior_draft)
        mean = self._drafting.get(drafter)
        draft = prior_draft if mean is None else mean.value / base
        steps = {k: self.step_seconds(decoding + k) / base for k in range(1, cap + 1)}
        one = self._rows.get(decoding + 1)
        return CostOfDrafts(steps, self.prior_per_draft, draft,
                            settled=one is not None and one.n >= SETTLED)

    def step_seconds(self, rows: int) -> float | None:
        """The estimated seconds of a step of `rows` rows (None before any step is measured)."""
        if not self._rows:
            return None
        if rows in self._rows:
            return self._rows[rows].value
        known = sorted(self._rows)
        below = [r for r in known if r < rows]
        above = [r for r in known if r > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            t_lo, t_hi = self._rows[lo].value, self._rows[hi].value
            return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
        if below:  # past the last measured: the slope of the last two, or the prior's
            last = below[-1]
            t_last = self._rows[last].value
            if len(below) > 1:
                prev = below[-2]
                slope = max(0.0, (t_last - self._rows[prev].value) / (last - prev))
            else:
                slope = self.prior_per_draft * t_last
            return t_last + slope * (rows - last)
        first = above[0]  # below the first measured: fewer rows never cost more
        return self._rows[first].value / (1 + self.prior_per_draft * (first - rows))

    def report(self) -> dict[str, float]:
        """The measured costs for the panels, at the fewest rows measured (a plain step of
        that many decodes): a step verifying 1 and 4 more drafts over it, and each drafter's
        cost per draft, in plain steps."""
        if not self._rows:
            return {}
        fewest = min(self._rows)
        base = self._rows[fewest].value
        out = {f"verify_{k}_cost": round(self.step_seconds(fewest + k) / base, 3)
               for k in (1, 4)}
        for name, mean in self._drafting.items():
            out[f"draft_cost_{name}"] = round(mean.value / base, 3)
        return out


@dataclass(frozen=True)
class CostOfDrafts:
    """The cost of a step with k drafts, in plain steps (1 at k = 0): measured step times
    `steps[k]` (the step's time over a plain step's, drafts verified beside the step's
    decodes), else 1 + k * `per_verify`; plus k * `per_draft` for drafting them. `settled`:
    a step with one draft has been measured enough to conclude from (or the cost is held)."""

    steps: dict[int, float]
    per_verify: float
    per_draft: float
    settled: bool = False

    def __call__(self, k: int) -> float:
        if k == 0:
            return 1.0
        verify = self.steps.get(k)
        if verify is None:
            verify = 1.0 + self.per_verify * k
        return max(verify, 1.0) + self.per_draft * k
