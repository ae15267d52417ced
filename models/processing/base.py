"""Helpers every family's processor shares: defaults for the optional parts of the processor
interface, the processed-inputs cache, option checks, hashing an item before processing it
(so that a repeated item skips resizing and normalizing), looking up the special tokens a
processor writes, checking the prompt's placeholder counts and expanding each placeholder token
into its item's spans (or finding the spans of a prompt expanded before tokenizing).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from models.checkpoint import CheckpointError, Settings
from models.interfaces import MultiModalFeature, PlaceholderRange, PromptPlan
from models.processing.options import check_mm_kwargs

__all__ = [
    "Expansion", "Pieces", "ProcessedCache", "ProcessorDefaults", "check_mm_kwargs",
    "check_placeholder_count", "expand_placeholders", "hashed_and_processed", "soft_runs",
    "special_token_id", "tokenizer_special_tokens",
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


def check_placeholder_count(
    token_ids: Sequence[int], placeholders: Mapping[int | None, str],
    media: Mapping[str, Sequence[Any]], nouns: Mapping[str, str] | None = None,
) -> None:
    """ValueError unless the prompt holds one placeholder token per item of each modality.

    `placeholders`: token id -> modality (None: a modality the tokenizer has no placeholder
    for, so no item of it can be placed); `media`: the items by modality; `nouns`: what the
    message calls an item of a modality ("audio clip"), where not the modality's name."""
    for token, modality in placeholders.items():
        found = 0 if token is None else token_ids.count(token)
        given = len(media.get(modality, ()))
        noun = (nouns or {}).get(modality, modality)
        if found != given:
            raise ValueError(
                f"the prompt has {found} {modality} placeholder(s) but {given} {noun}(s) were "
                f"given; each {noun} needs one placeholder (the chat template adds it)"
            )


def special_token_id(tokenizer: Any, token: str, source: str) -> int:
    """The id of `token`, which must be one token of the tokenizer's vocabulary; a
    CheckpointError naming `source` (the file and field, or the class, that names the token)
    otherwise."""
    found = tokenizer.convert_tokens_to_ids(token)
    if (found is None or found == tokenizer.unk_token_id
            or tokenizer.convert_ids_to_tokens(found) != token):
        raise CheckpointError(
            f"{source}: the tokenizer has no {token!r} token (one token of its vocabulary: "
            "tokenizer.json, tokenizer_config.json's added tokens)")
    return found


def tokenizer_special_tokens(tokenizer: Any, names: Sequence[str],
                             reader: str) -> dict[str, tuple[str, int]]:
    """The tokens the tokenizer's attributes `names` name (its extra special tokens, from
    tokenizer_config.json), each one token: name -> (text, id); a CheckpointError naming the
    attribute otherwise. `reader`: the class that reads them there."""
    out = {}
    for name in names:
        text = getattr(tokenizer, name, None)
        source = f"tokenizer_config.json: {name} (where {reader} reads it)"
        if not isinstance(text, str):
            raise CheckpointError(f"{source}: the tokenizer has no {name}")
        out[name] = (text, special_token_id(tokenizer, text, source))
    return out


def soft_runs(token_ids: Sequence[int], kinds: Mapping[int, str]) -> list[tuple[int, int, str]]:
    """(offset, length, modality) of every run of one soft token (`kinds`: token -> modality),
    for prompts whose placeholders were written out before tokenizing."""
    runs: list[tuple[int, int, str]] = []
    start, current = 0, None
    for i, token in enumerate([*token_ids, -1]):
        if current is not None and token != current:
            runs.append((start, i - start, kinds[current]))
            current = None
        if current is None and token in kinds:
            start, current = i, token
    return runs


@dataclass(frozen=True)
class Expansion:
    """One encoder item's span in the expanded prompt: its tokens, which of them take
    embeddings (None: all), labelled parts for display (see PlaceholderRange); and the feature
    it makes: the item's content hash and encoder inputs, its modality (None: its
    placeholder's), the media item it is part of and its part's label (see
    MultiModalFeature)."""

    tokens: list[int]
    is_embed: tuple[bool, ...] | None = None
    parts: tuple[tuple[str, int], ...] = ()
    identifier: str = ""
    data: Any = None
    modality: str | None = None
    item: str | None = None
    part: str = ""


# What one placeholder becomes: in order, spans of encoder items and runs of plain tokens (text
# between spans, such as separators, which take their text embeddings and make no feature).
Pieces = Sequence["Expansion | Sequence[int]"]


def expand_placeholders(
    token_ids: Sequence[int], placeholders: Mapping[int, str],
    items: Mapping[str, Iterable[Any]], expand: Callable[[str, Any], Pieces],
) -> tuple[list[int], list[MultiModalFeature]]:
    """Each placeholder token, in order, replaced by what its item expands to: the prompt's ids
    and one feature (span, content hash, encoder inputs) per Expansion.

    `placeholders`: token id -> modality; `items`: each modality's items in prompt order, as
    many as its placeholders (check_placeholder_count); `expand(modality, item)`: the pieces
    the item's placeholder becomes."""
    ids: list[int] = []
    features: list[MultiModalFeature] = []
    pending = {modality: iter(queue) for modality, queue in items.items()}
    for token in token_ids:
        modality = placeholders.get(token)
        if modality is None:
            ids.append(token)
            continue
        for piece in expand(modality, next(pending[modality])):
            if not isinstance(piece, Expansion):
                ids.extend(piece)
                continue
            span = PlaceholderRange(len(ids), len(piece.tokens), is_embed=piece.is_embed,
                                    parts=piece.parts)
            features.append(MultiModalFeature(piece.modality or modality, piece.identifier, span,
                                              piece.data, item=piece.item, part=piece.part))
            ids.extend(piece.tokens)
    return ids, features
