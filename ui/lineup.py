"""The models the picker offers: the engines already loaded, and models found on this machine
(Ollama's and LM Studio's stores) that load only when chosen, and models that could not start
(`Refused`: their label and their choice say why). Loading runs in a worker thread, once per
model, however many sessions choose it at once, and `loading(name)` says which start-up stage
it is at (engine/load_progress.py); a model that fails to load says why and stays on the
list."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping

from engine.interface import ChatEngine
from engine.load_progress import LoadProgress, ProgressListener

Loader = Callable[[ProgressListener], ChatEngine]
"""Loads a model, telling the listener of each start-up stage (AsyncLLM's `load_progress`)."""

NOT_LOADED = " (found on this machine: loads when chosen)"
NOT_STARTED = " (not started: {reason})"


class Refused:
    """The loader of a model that could not start (the options it refused): choosing it
    says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __call__(self, progress: ProgressListener | None = None) -> ChatEngine:
        raise ValueError(self.reason)


class Lineup:
    """Named engines, loaded or loadable; `engines` holds the loaded ones (the same dict the
    chat reads, so a model loaded here is served from then on)."""

    def __init__(self, engines: dict[str, ChatEngine],
                 available: Mapping[str, Loader] | None = None) -> None:
        self.engines = engines
        self.available = {k: v for k, v in (available or {}).items() if k not in engines}
        self._loading: dict[str, asyncio.Future] = {}
        self._stage: dict[str, LoadProgress] = {}  # the latest report of each load running

    def names(self) -> list[str]:
        return [*self.engines, *self.available]

    def choices(self) -> list[tuple[str, str]]:
        """(label, name) per model, the loadable ones said so."""
        return [(name, name) for name in self.engines] + [
            (name + self._label(loader), name) for name, loader in self.available.items()
            if name not in self.engines]

    @staticmethod
    def _label(loader: Loader) -> str:
        if isinstance(loader, Refused):
            reason = loader.reason if len(loader.reason) <= 160 else loader.reason[:157] + "..."
            return NOT_STARTED.format(reason=reason)
        return NOT_LOADED

    def loaded(self, name: str) -> bool:
        return name in self.engines

    def loading(self, name: str) -> LoadProgress | None:
        """The stage the load of `name` last reported (None: not loading, or no report yet)."""
        return self._stage.get(name) if name in self._loading else None

    def _heard(self, name: str, report: LoadProgress) -> None:
        self._stage[name] = report  # from the loading thread: one assignment, read as a whole

    async def load(self, name: str) -> ChatEngine:
        """The engine of `name`, loaded now if it is not (once: concurrent callers wait for
        the same load). A KeyError for a name that is neither loaded nor loadable; a load's
        error is raised to every caller, and the next choice tries again."""
        if name in self.engines:
            return self.engines[name]
        if name not in self.available:
            raise KeyError(name)
        future = self._loading.get(name)
        if future is None:
            self._stage.pop(name, None)
            future = asyncio.ensure_future(asyncio.to_thread(
                self.available[name], functools.partial(self._heard, name)))
            self._loading[name] = future
        try:
            engine = await asyncio.shield(future)
        finally:
            if future.done():
                self._loading.pop(name, None)
                self._stage.pop(name, None)
        self.engines[name] = engine
        return engine

    def shutdown(self) -> None:
        """Shut down the engines loaded here (those given loaded belong to the caller)."""
        for name in list(self.engines):
            if name in self.available:
                self.engines.pop(name).shutdown()
