"""Choosing a linear formulation by measurement: row-count buckets, the on-disk cache of choices
(one JSON file per CPU model and torch version), and the rule that picks the fastest.

The bookkeeping here is plain Python: `choose` takes the timer as an argument, so tests drive it
with fake timings. The timer used in production, `measure`, runs the candidates round-robin and
keeps each one's minimum (interference on a shared machine only ever adds time).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Row-count buckets of a linear's input and the row count each is timed at. Decode steps carry
# one row per running request (1, 2-8, 9-64); more rows is a prefill chunk, short or long (a
# per-call dequantization of quantized weights pays only over enough rows).
BUCKETS = ("1", "2-8", "9-64", "65-256", "257+")
PROBE_ROWS = (1, 4, 32, 128, 512)
BASELINE = "F.linear"
MARGIN = 0.05  # another candidate must beat the baseline by this fraction to be preferred

CACHE_ENV = "MMSERVE_KERNEL_CACHE"  # a directory for the cache file; overrides the default

Timer = Callable[[Mapping[str, Callable[[], object]]], dict[str, float]]


def bucket_index(rows: int) -> int:
    """The index into BUCKETS of an input with `rows` rows."""
    for i, limit in enumerate((1, 8, 64, 256)):
        if rows <= limit:
            return i
    return 4


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
    entry being {"choice": name, "seconds": {candidate: time}}). A missing or unreadable file is
    an empty cache; saving replaces the file atomically."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict] = {}
        if path is not None and path.exists():
            try:
                self.entries = dict(json.loads(path.read_text())["choices"])
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("ignoring unreadable kernel cache %s", path)
        self.dirty = False

    def get(self, key: str, allowed: set[str]) -> str | None:
        """The cached choice, if it is allowed and every allowed candidate was timed (a
        candidate new to this machine, say a kernel that now builds, is timed again)."""
        entry = self.entries.get(key)
        if not isinstance(entry, dict):
            return None
        choice, timed = entry.get("choice"), entry.get("seconds")
        if choice not in allowed or not isinstance(timed, dict) or not allowed <= set(timed):
            return None
        return choice

    def put(self, key: str, choice: str, seconds: Mapping[str, float]) -> None:
        self.entries[key] = {"choice": choice, "seconds": {k: float(v) for k, v in
                                                           seconds.items()}}
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
) -> str:
    """The cached choice for `key` if it names a candidate, else time them, cache and log.
    The first candidate is the baseline (kept unless another wins by `margin`); a winner
    other than the baseline is timed against it once more and must win both times (each keeps
    its slower time)."""
    cached = cache.get(key, set(candidates))
    if cached is not None:
        return cached
    baseline = next(iter(candidates))
    if len(candidates) == 1:
        return baseline
    seconds = timer(candidates)
    choice = pick(seconds, baseline, margin)
    if choice != baseline:
        # Confirm against the baseline: a burst of load on a shared machine during the first
        # timing must not leave a slower choice in the cache for good.
        again = timer({n: candidates[n] for n in (baseline, choice)})
        seconds = {**seconds, **{n: max(seconds[n], t) for n, t in again.items()}}
        choice = pick(seconds, baseline, margin)
    cache.put(key, choice, seconds)
    shown = ", ".join(f"{k} {v * 1e6:.0f}us" for k, v in sorted(seconds.items()))
    log.info("linear kernel %s: %s (%s)", key, choice, shown)
    return choice


def measure(candidates: Mapping[str, Callable[[], object]], rounds: int = 2) -> dict[str, float]:
    """Seconds per call of each candidate: one warm-up call each, then `rounds` calls each,
    interleaved; the minimum of each."""
    best = {}
    for name, fn in candidates.items():
        fn()
        best[name] = float("inf")
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best
