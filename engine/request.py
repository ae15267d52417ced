"""A request's engine-side state: tokens, progress, KV blocks, media spans. Pure Python."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.metrics import RequestMetrics
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(frozen=True)
class PlaceholderRange:
    """Where one media item sits in the prompt: `length` token positions from `offset`.

    `is_embed` is None when every position receives an encoder embedding; otherwise a mask of
    `length` booleans (structure tokens such as row breaks sit inside the span but keep their
    text embedding). `bidirectional` spans are attended both ways inside themselves (Gemma 3's
    images); the scheduler never cuts a prefill chunk inside one.
    """

    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None
    bidirectional: bool = False

    def __post_init__(self) -> None:
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(f"is_embed has {len(self.is_embed)} entries for length {self.length}")

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else sum(self.is_embed)

    def embeds_before(self, pos: int) -> int:
        """Embed positions of this span that lie before absolute position `pos`."""
        k = min(max(pos - self.offset, 0), self.length)
        return k if self.is_embed is None else sum(self.is_embed[:k])


@dataclass
class MultiModalFeature:
    """One media item of a request: its span, its content hash and its encoder inputs.

    `data` holds the processed encoder inputs (tensors). They stay until the request ends, as
    in vLLM: a request preempted after its prompt was computed recomputes it, and its
    embeddings may have been evicted from the encoder cache meanwhile.
    """

    modality: str
    identifier: str
    placeholder: PlaceholderRange
    data: dict[str, Any] | None = None
    # Filled by the engine for the UI: did this item hit the encoder cache?
    cache_hit: bool | None = None


@dataclass
class Request:
    """Everything the scheduler, block manager and runner need to know about one request.

    Invariant: `num_computed_tokens <= num_tokens`; the token at `num_computed_tokens` (if any)
    is the next one to feed. A request whose window reaches `num_tokens` samples one token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    prompt: str | None = None
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # Model-specific per-request position data (mRoPE ids and decode delta), set by the processor.
    position_info: Any = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hits at first admission; -1 until then
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    stop_reason: str | int | None = None
    error: str | None = None
    # Output-side state, owned by the engine's postprocessing.
    detokenizer: Any = None  # IncrementalDetokenizer
    num_streamed_tokens: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        """True while part of the prompt (or of recomputed output) is still to be computed."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
