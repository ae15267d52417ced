"""Helpers every family's processor shares: defaults for the optional parts of the processor
interface, the processed-inputs cache, option checks, and hashing an item before processing it
(so that a repeated item skips resizing and normalizing).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any


class ProcessorDefaults:
    """What most processors do for the optional parts of models.interfaces.MultimodalProcessor:
    no bidirectional spans, no text-level expansion."""

    def max_bidirectional_span(self) -> int:
        return 0

    def expand_text(self, text: str, media: dict[str, list], mm_kwargs: Mapping[str, Any]) -> str:
        return text


class ProcessedCache:
    """LRU of processed encoder inputs by content hash: a repeated item skips resizing and
    normalizing. Shared by the worker threads that process prompts, hence the lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    def get_or_compute(self, key: str, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
        value = compute()  # outside the lock: other prompts keep processing meanwhile
        if self.capacity:
            with self._lock:
                self._items[key] = value
                while len(self._items) > self.capacity:
                    self._items.popitem(last=False)
        return value


def check_mm_kwargs(mm_kwargs: Mapping[str, Any], accepted: tuple[str, ...], family: str) -> None:
    """Refuse mm_processor_kwargs a model's processor does not know, naming those it does."""
    unknown = set(mm_kwargs) - set(accepted)
    if unknown:
        raise ValueError(
            f"unknown mm_processor_kwargs {', '.join(sorted(unknown))} "
            f"({family} accepts {', '.join(accepted)})"
        )


def hashed_and_processed(
    cache: ProcessedCache, identify: Callable[[], str], compute: Callable[[], Any],
    stages: dict[str, float],
) -> tuple[str, Any]:
    """The item's content hash and its encoder inputs (from `cache` when seen before); the
    seconds spent go to `stages` ("hashing", "preprocess")."""
    t0 = time.perf_counter()
    identifier = identify()
    t1 = time.perf_counter()
    data = cache.get_or_compute(identifier, compute)
    stages["hashing"] = stages.get("hashing", 0.0) + t1 - t0
    stages["preprocess"] = stages.get("preprocess", 0.0) + time.perf_counter() - t1
    return identifier, data
