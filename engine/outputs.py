"""What the engine hands back: RequestOutput snapshots, safe to read from any thread."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.metrics import RequestMetrics


@dataclass(frozen=True)
class PlaceholderInfo:
    """A media item's place in the prompt, for the UI: span, embed positions, content hash."""

    modality: str
    offset: int
    length: int
    num_embeds: int
    identifier: str
    cache_hit: bool | None


@dataclass
class CompletionOutput:
    """The generated sequence so far. `text`/`token_ids` are cumulative; `delta_*` are new
    since the previous output of the same request (what a stream should print)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    multi_modal_placeholders: list[PlaceholderInfo] = field(default_factory=list)
    error: str | None = None
