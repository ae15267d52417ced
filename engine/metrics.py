"""Per-request stage timings and cache statistics, read by the UI panels. Pure Python.

All instants are `time.monotonic()` seconds; durations are derived, never stored twice.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """What happened to one request, stage by stage.

    `stages` holds the pre-engine stages measured in worker threads (media_load, preprocess,
    hashing), in seconds. `prefill_chunks` lists (tokens, seconds) for every step that computed
    part of the prompt. Encoder fields count only the work done for this request's items.
    Speculative decoding's fields count this request's drafts (engine/speculative/).
    """

    arrival_time: float = field(default_factory=time.monotonic)  # at the front door
    queued_time: float | None = None  # handed to the scheduler (after media and processing)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    stages: dict[str, float] = field(default_factory=dict)
    prefill_chunks: list[tuple[int, float]] = field(default_factory=list)
    num_preemptions: int = 0
    encoder_time: float = 0.0
    encoder_calls: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    # Speculative decoding: draft tokens verified and accepted, the drafter's time spent on
    # this request's drafts and the time of the steps that verified them.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    verify_steps: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None or self.queued_time is None:
            return None
        return self.first_scheduled_time - self.queued_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival at the front door (media loading included)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    def snapshot(self) -> RequestMetrics:
        """A copy that later engine steps will not mutate."""
        return dataclasses.replace(
            self, stages=dict(self.stages), prefill_chunks=list(self.prefill_chunks)
        )

    def as_dict(self) -> dict[str, object]:
        """A plain snapshot for the UI and the API (no engine objects)."""
        return {
            "queue_time": self.queue_time,
            "ttft": self.ttft,
            "prefill_time": self.prefill_time,
            "decode_time": self.decode_time,
            "stages": dict(self.stages),
            "prefill_chunks": list(self.prefill_chunks),
            "num_preemptions": self.num_preemptions,
            "encoder_time": self.encoder_time,
            "encoder_calls": self.encoder_calls,
            "encoder_cache_hits": self.encoder_cache_hits,
            "encoder_cache_misses": self.encoder_cache_misses,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_time": self.draft_time,
            "verify_time": self.verify_time,
            "verify_steps": self.verify_steps,
        }
