"""What a model's start-up is doing, as it does it: each stage that takes time on a first start
(reading or mapping the weights, quantizing or repacking them, building the C kernels, planning
the kernels, reserving the KV and state pools) reports `LoadProgress(stage, done, total)`, from
0 to total, to the listeners of a `StartupProgress`: the terminal's line (`TerminalProgress`,
one line rewritten in place, or a log line per quarter where stderr is not a terminal, as in
CI) and whoever else asked (the app's model picker). Plain Python: the UI imports it."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

log = logging.getLogger(__name__)

BAR_WIDTH = 20
CLEAR_LINE = "\x1b[K"  # erases from the cursor to the end of the line


@dataclass(frozen=True)
class LoadProgress:
    """One report of a start-up stage: `done` of its `total` steps (0 <= done <= total)."""

    stage: str
    done: int
    total: int

    def __post_init__(self) -> None:
        if not self.stage:
            raise ValueError("a load stage needs a name")
        if self.total < 1 or not 0 <= self.done <= self.total:
            raise ValueError(f"load stage {self.stage!r}: done={self.done} of total="
                             f"{self.total} (0 <= done <= total, total >= 1)")

    @property
    def finished(self) -> bool:
        return self.done == self.total

    def line(self, width: int = BAR_WIDTH) -> str:
        """`stage [#####---------------] 5/20`: the stage with a bar of `width` characters."""
        filled = self.done * width // self.total
        return f"{self.stage} [{'#' * filled}{'-' * (width - filled)}] {self.done}/{self.total}"


ProgressListener = Callable[[LoadProgress], None]


class StartupProgress:
    """Hands each stage's reports to the listeners. Called as `progress(stage, done, total)`
    (the plain form models/ reports in), or `with progress.step(stage):` for a stage of one
    step (0/1 on entry, 1/1 on leaving)."""

    def __init__(self, listeners: Sequence[ProgressListener] = ()) -> None:
        self.listeners = list(listeners)

    def __call__(self, stage: str, done: int, total: int) -> None:
        report = LoadProgress(stage, done, total)
        for listener in self.listeners:
            listener(report)

    @contextmanager
    def step(self, stage: str) -> Iterator[None]:
        self(stage, 0, 1)
        yield
        self(stage, 1, 1)


class TerminalProgress:
    """A listener that shows the stages on `stream` (stderr). On a terminal: one line,
    rewritten in place by each report and erased when its stage is done (the cursor is left at
    its start, so a log line written meanwhile overwrites it rather than trailing it).
    Elsewhere (CI, a log file): a log line as each stage starts and, for a stage of several
    steps, at each quarter of it."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def __call__(self, report: LoadProgress) -> None:
        stream = self.stream or sys.stderr
        if stream.isatty():
            text = "" if report.finished else f"loading: {report.line()}"
            stream.write(f"\r{CLEAR_LINE}{text}\r")
            stream.flush()
        elif report.done == 0 or report.total > 1 and (
                report.done * 4 // report.total != (report.done - 1) * 4 // report.total):
            log.info("loading: %s", report.line())
