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

from models.interfaces import PromptPlan
from models.mm_options import check_mm_kwargs

__all__ = ["ProcessedCache", "ProcessorDefaults", "check_mm_kwargs", "hashed_and_processed"]


class ProcessorDefaults:
    """What most processors do for the optional parts of models.interfaces.MultimodalProcessor:
    no bidirectional spans, no text-level expansion, no plan before processing."""

    def max_bidirectional_span(self) -> int:
        return 0

    def expand_text(self, text: str, media: dict[str, list], mm_kwargs: Mapping[str, Any]) -> str:
        return text

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan | None:
        return None


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
