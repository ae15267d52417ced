"""Choosing a linear formulation by measurement: row-count buckets, the on-disk cache of choices
(one JSON file per CPU model and torch version), and the rule that picks the fastest (its
margin, with the plan's other thresholds, in models.kernels.linear_policy).

The bookkeeping here is plain Python: `choose` takes the timer as an argument, so tests drive it
with fake timings. The timer used in production, `measure`, runs the candidates round-robin and
keeps every repeat: a candidate's time is its best repeat (interference on a shared machine only
ever adds time), and the repeats must agree (their median within `SETTLED_SPREAD` of the best)
for the choice to be *settled*. A choice that is not (the machine or the process was busy while
it was timed) is used, and saved marked unsettled, so the next start times it again.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from models.kernels.linear_policy import MARGIN

log = logging.getLogger(__name__)

# Row-count buckets of a linear's input and the row count each is timed at. Decode steps carry
# one row per running request (1, 2-8, 9-64); more rows is a prefill chunk, short, long (a text
# turn) or very long (a media turn's chunks run up to max_num_batched_tokens rows; a GEMM's best
# formulation at 512 rows is not always the best at 2048).
BUCKETS = ("1", "2-8", "9-64", "65-256", "257-1024", "1025+")
PROBE_ROWS = (1, 4, 32, 128, 512, 2048)
BUCKET_LAST_ROWS = (1, 8, 64, 256, 1024)  # the largest row count of each bucket but the last
BASELINE = "F.linear"
# A candidate's repeats agree when their median is within this factor of their best; otherwise
# the machine (or another thread pool of the same process) was busy while it was timed.
SETTLED_SPREAD = 1.25
ROUNDS = 5  # timed repeats per candidate, after one warm-up call
TIMINGS = 2  # processes that time an entry whose repeats disagree, before it stands
# A candidate whose first timed call takes this many times the fastest first call is not timed
# further (to be the fastest, a burst of load falling on it alone must have tripled its time); on
# the largest probes (thousands of rows) the losers' repeats were most of a plan's time.
DROP_SLOWER = 3.0

CACHE_ENV = "MMSERVE_KERNEL_CACHE"  # a directory for the cache file; overrides the default


@dataclass(frozen=True)
class Timing:
    """One candidate's timed repeats, seconds per call."""

    samples: tuple[float, ...]

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def settled(self) -> bool:
        """Whether the repeats agree (their median within SETTLED_SPREAD of the best)."""
        return statistics.median(self.samples) <= self.best * SETTLED_SPREAD


Timer = Callable[[Mapping[str, Callable[[], object]]], dict[str, Timing]]


@dataclass(frozen=True)
class Choice:
    """What `choose` decided for one key: the formulation, whether it was timed now (else it
    came from the cache) and whether its timing was settled."""

    name: str
    timed: bool = False
    settled: bool = True


def bucket_index(rows: int) -> int:
    """The index into BUCKETS of an input with `rows` rows."""
    for i, limit in enumerate(BUCKET_LAST_ROWS):
        if rows <= limit:
            return i
    return len(BUCKET_LAST_ROWS)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else platform.processor(), else the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def cache_path(cpu: str | None = None, torch_version: str | None = None,
               native_build: str | None = None, rules: int | None = None) -> Path:
    """kernels-<cpu model>-<torch version>[-native-<build>][-plan<rules>].json under
    $MMSERVE_KERNEL_CACHE, else $MMSERVE_CACHE, else ~/.cache/mmserve. `native_build`
    identifies the build of our own kernels (models.kernels.native) among the candidates,
    `rules` the version of the plan's candidates and choosing rules: either new is timed
    afresh."""
    root = os.environ.get(CACHE_ENV) or os.environ.get("MMSERVE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "mmserve"
    name = f"kernels-{cpu or cpu_model()}-{torch_version or torch.__version__}"
    if native_build:
        name += f"-native-{native_build}"
    if rules is not None:
        name += f"-plan{rules}"
    return base / (re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("_") + ".json")


def pick(timings: Mapping[str, float], baseline: str = BASELINE, margin: float = MARGIN) -> str:
    """The fastest candidate; the baseline unless another is faster by more than `margin`.
    (The baseline of a dense linear is F.linear; of a quantized one, its int kernel.)"""
    if not timings:
        raise ValueError("no timings to choose from")
    best = min(timings, key=timings.__getitem__)
    if baseline in timings and timings[best] > timings[baseline] * (1 - margin):
        return baseline
    return best


class KernelCache:
    """Choices by key, loaded from and saved to one JSON file ({"choices": {key: entry}}, an
    entry being {"choice": name, "seconds": {candidate: time}, "settled": bool, "timings": n}).
    A missing or unreadable file is an empty cache; saving replaces the file atomically. An
    unsettled entry serves the process that timed it and is timed again by the next ones, up
    to TIMINGS times in all, then stands: on a machine whose load never lets repeats agree,
    not every start times the plan anew."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict] = {}
        if path is not None and path.exists():
            try:
                self.entries = dict(json.loads(path.read_text())["choices"])
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("ignoring unreadable kernel cache %s", path)
        self.dirty = False
        self.loaded = set(self.entries)  # keys read from the file (not timed by this process)

    def get(self, key: str, allowed: set[str]) -> str | None:
        """The cached choice, if it is allowed and every allowed candidate was timed (a
        candidate new to this machine, say a kernel that now builds, is timed again), and it
        was settled or timed by this process."""
        entry = self.entries.get(key)
        if not isinstance(entry, dict):
            return None
        choice, timed = entry.get("choice"), entry.get("seconds")
        if choice not in allowed or not isinstance(timed, dict) or not allowed <= set(timed):
            return None
        if (key in self.loaded and entry.get("settled", True) is not True
                and self.timings(key) < TIMINGS):
            return None
        return choice

    def timings(self, key: str) -> int:
        """How many processes have timed `key` (0: none)."""
        entry = self.entries.get(key)
        count = entry.get("timings", 1) if isinstance(entry, dict) else 0
        return count if isinstance(count, int) else 1

    def seconds(self, key: str, name: str) -> float | None:
        """The time saved for candidate `name` under `key`, if any."""
        entry = self.entries.get(key)
        timed = entry.get("seconds") if isinstance(entry, dict) else None
        value = timed.get(name) if isinstance(timed, dict) else None
        return float(value) if isinstance(value, (int, float)) else None

    def put(self, key: str, choice: str, seconds: Mapping[str, float],
            settled: bool = True, timings: int = 1) -> None:
        self.entries[key] = {"choice": choice, "seconds": {k: float(v) for k, v in
                                                           seconds.items()},
                             "settled": bool(settled), "timings": int(timings)}
        self.loaded.discard(key)
        self.dirty = True

    def forget(self, keys: set[str]) -> None:
        """Drop these entries (a saved plan found wrong): they are timed again."""
        for key in keys & set(self.entries):
            del self.entries[key]
            self.loaded.discard(key)
            self.dirty = True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"choices": self.entries}, indent=1, sort_keys=True))
            tmp.replace(self.path)
            self.dirty = False
        except OSError as e:
            log.warning("could not save the kernel cache %s: %s", self.path, e)


def choose(
    key: str, candidates: Mapping[str, Callable[[], object]], cache: KernelCache, timer: Timer,
    margin: float = MARGIN,
) -> Choice:
    """The cached choice for `key` if it names a candidate, else time them, cache and log (at
    DEBUG). The first candidate is the baseline (kept unless another wins by `margin`); a
    winner other than the baseline is timed against it once more and must win both times (each
    keeps its slower best). Unsettled when the baseline's or the winner's repeats disagree."""
    cached = cache.get(key, set(candidates))
    if cached is not None:
        return Choice(cached)
    baseline = next(iter(candidates))
    if len(candidates) == 1:
        return Choice(baseline)
    before = cache.timings(key)  # > 0: an unsettled entry timed again
    timings = timer(candidates)
    seconds = {n: t.best for n, t in timings.items()}
    choice = pick(seconds, baseline, margin)
    settled = timings[baseline].settled and timings[choice].settled
    if choice != baseline:
        # Confirm against the baseline: a burst of load on a shared machine during the first
        # timing must not leave a slower choice in the cache for good.
        again = timer({n: candidates[n] for n in (baseline, choice)})
        seconds = {**seconds, **{n: max(seconds[n], t.best) for n, t in again.items()}}
        settled = settled and all(t.settled for t in again.values())
        choice = pick(seconds, baseline, margin)
    cache.put(key, choice, seconds, settled, before + 1)
    shown = ", ".join(f"{k} {v * 1e6:.0f}us" for k, v in sorted(seconds.items()))
    log.debug("linear kernel %s: %s (%s)%s", key, choice, shown,
              "" if settled else "; repeats disagree: not final")
    return Choice(choice, timed=True, settled=settled)


def measure(candidates: Mapping[str, Callable[[], object]],
            rounds: int = ROUNDS) -> dict[str, Timing]:
    """Each candidate's repeats: one warm-up call each (not timed: first calls build packs and
    primitives), then `rounds` calls each, interleaved (a burst of load then falls on every
    candidate alike); after the first round, a candidate DROP_SLOWER times the fastest is left
    with that one sample."""
    samples: dict[str, list[float]] = {}
    for name, fn in candidates.items():
        fn()
        samples[name] = []
    timing = list(candidates)
    for round_ in range(rounds):
        for name in timing:
            t0 = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - t0)
        if round_ == 0:
            fastest = min(samples[name][0] for name in timing)
            timing = [name for name in timing if samples[name][0] <= DROP_SLOWER * fastest]
    return {name: Timing(tuple(s)) for name, s in samples.items()}
