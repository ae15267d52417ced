"""What an engine hands back: RequestOutput snapshots, safe to read from any thread.

The in-process engine knows everything about a request. A remote engine knows what its server
returns: what it could not learn is left empty (or None) and `RequestOutput.unreported` says
why, so that the panels can say what they do not know instead of inventing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.metrics import RequestMetrics


@dataclass(frozen=True)
class PlaceholderInfo:
    """An encoder item's place in the prompt, for the UI: span, embed positions, content hash
    (None when the backend did not report it), encoder-cache outcome (None: not looked up,
    or not reported), and the media item it is part of."""

    modality: str
    offset: int
    length: int
    num_embeds: int
    identifier: str | None
    cache_hit: bool | None
    parts: tuple[tuple[str, int], ...] = ()  # labelled sub-ranges (e.g. base image, tiles)
    # Offsets inside the span of the tokens that keep their text embeddings (row breaks, tile
    # labels, timestamps): the positions the span's `is_embed` mask leaves out.
    text_offsets: tuple[int, ...] = ()
    # The media item this encoder item is part of (the encoder items of one item share it: a
    # video's temporal patches, the frames and sound of a video heard with its sound; None:
    # the identifier's part before ":") and this part's label ("sound 0-2 s"; "": none).
    item: str | None = None
    part: str = ""


@dataclass
class CompletionOutput:
    """The generated sequence so far. `text`/`token_ids` are cumulative; `delta_*` are new
    since the previous output of the same request (what a stream should print).
    `num_tokens` counts the tokens generated: `len(token_ids)` unless a remote server
    reported the count without the ids (None: not known yet).

    For a thinking model's chat (engine/reasoning.py) `text` is the answer and
    `reasoning_content` the thinking (None: a model or request without it). Speculative
    decoding: `num_draft_tokens` drafts were verified for it, `num_accepted_tokens` kept."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    num_tokens: int | None = -1  # -1: len(token_ids), filled in on construction
    reasoning_content: str | None = None
    delta_reasoning_content: str = ""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens == -1:
            self.num_tokens = len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# Keys of RequestOutput.unreported: what a remote server did not report.
UNREPORTED_KEYS = (
    "prompt_token_ids", "cached_tokens", "placeholders", "encoder_cache", "server_timing",
)


@dataclass
class RequestOutput:
    """One request's state: prompt, output so far, cache use, placeholders and timings.

    `num_prompt_tokens` is `len(prompt_token_ids)` unless a remote server reported the count
    without the ids (None: not known yet). `num_cached_tokens` is None when the server did
    not report it. `unreported` maps each thing the backend did not report (a key of
    UNREPORTED_KEYS) to a sentence that says why, and how to make it report it; it is empty
    for the in-process engine.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None
    metrics: RequestMetrics
    multi_modal_placeholders: list[PlaceholderInfo] = field(default_factory=list)
    error: str | None = None
    num_prompt_tokens: int | None = -1  # -1: len(prompt_token_ids), filled in on construction
    unreported: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens == -1:
            self.num_prompt_tokens = len(self.prompt_token_ids)
        unknown = sorted(set(self.unreported) - set(UNREPORTED_KEYS))
        if unknown:
            raise ValueError(f"RequestOutput.unreported: unknown key {unknown[0]!r}")
