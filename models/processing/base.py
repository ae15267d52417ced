"""Helpers every family's processor shares: defaults for the optional parts of the processor
interface, the processed-inputs cache, option checks, hashing an item before processing it
(so that a repeated item skips resizing and normalizing), and expanding one placeholder token
per item into the item's span.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from models.checkpoint import Found, Schema, Settings
from models.interfaces import MultiModalFeature, PlaceholderRange, PromptPlan
from models.processing.options import check_mm_kwargs

__all__ = [
    "Expansion", "ProcessedCache", "ProcessorDefaults", "check_mm_kwargs",
    "check_placeholder_count", "expand_placeholders", "hashed_and_processed", "own_keys",
]


class ProcessorDefaults:
    """What most processors do for the optional parts of models.interfaces.MultimodalProcessor:
    no bidirectional spans, no text-level expansion, no plan before processing; `settings`
    returns what the processor stored in `self.read` while it was built."""

    read: Mapping[str, Settings] = {}

    def settings(self) -> Mapping[str, Settings]:
        return dict(self.read)

    def max_bidirectional_span(self) -> int:
        return 0

    def expand_text(self, text: str, media: dict[str, list], mm_kwargs: Mapping[str, Any]) -> str:
        return text

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan | None:
        return None


def own_keys(found: Found | None, other: Found | None, *schemas: Schema) -> Found | None:
    """`found` less the keys of `schemas` (another component's) when both components were read
    from the same file (the Hub keeps an image processor and a feature extractor in one
    preprocessor_config.json, each reading its own keys of it, as transformers' classes do)."""
    if found is None or other is None or found.source != other.source:
        return found
    foreign = set().union(*(set(s.defaults) | set(s.fixed) | s.inert for s in schemas))
    return Found({k: v for k, v in found.data.items() if k not in foreign}, found.source)


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


def check_placeholder_count(token_ids: list[int], placeholder: int, given: int,
                            modality: str) -> None:
    """ValueError unless the prompt holds one `placeholder` token per item given."""
    found = token_ids.count(placeholder)
    if found != given:
        raise ValueError(
            f"the prompt has {found} {modality} placeholder(s) but {given} {modality}(s) were "
            f"given; each {modality} needs one placeholder (the chat template adds it)"
        )


@dataclass(frozen=True)
class Expansion:
    """What one placeholder token becomes: the span's tokens, which of them take embeddings
    (None: all), and labelled parts for display (see PlaceholderRange)."""

    tokens: list[int]
    is_embed: tuple[bool, ...] | None = None
    parts: tuple[tuple[str, int], ...] = ()


def expand_placeholders(
    token_ids: list[int], placeholder: int, modality: str, items: Sequence[tuple[str, Any]],
    expand: Callable[[Any], Expansion],
) -> tuple[list[int], list[MultiModalFeature]]:
    """Each `placeholder` token, in order, replaced by its item's expansion: the prompt's ids
    and one feature (span, content hash, encoder inputs) per item. `items` are (identifier,
    encoder inputs) in prompt order, as many as the placeholders (check_placeholder_count)."""
    ids: list[int] = []
    features: list[MultiModalFeature] = []
    pending = iter(items)
    for token in token_ids:
        if token != placeholder:
            ids.append(token)
            continue
        identifier, data = next(pending)
        run = expand(data)
        span = PlaceholderRange(len(ids), len(run.tokens), is_embed=run.is_embed, parts=run.parts)
        features.append(MultiModalFeature(modality, identifier, span, data))
        ids.extend(run.tokens)
    return ids, features
