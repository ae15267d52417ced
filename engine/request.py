"""A request's engine-side state: tokens, progress, KV blocks, media spans. Pure Python."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.metrics import RequestMetrics
from engine.sampling_params import SamplingParams
from models.interfaces import MultiModalFeature, PlaceholderRange, PositionInfo

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer
    from engine.grammar import GrammarState
    from engine.reasoning import ReasoningSplitter
    from engine.speculation_state import SpeculationState

__all__ = ["MultiModalFeature", "PlaceholderRange", "Request", "RequestStatus"]


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
    # Multi-row positions (mRoPE), from the processor; None for 1-D positions.
    position_info: PositionInfo | None = None
    # Token offsets where chat messages start (prefixes likely to be reused; may be empty).
    message_starts: tuple[int, ...] = ()
    # The LoRA adapter its tokens compute with (None: the base model); part of its KV blocks'
    # prefix-cache identity.
    adapter: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Completion `index` of a request fanned out for n > 1 (engine/fanout.py), and its parent.
    index: int = 0
    parent_id: str | None = None
    # Structured output: the request's place in its grammar (None: unconstrained).
    grammar: GrammarState | None = None
    # Speculative decoding: its drafter, drafts for the next step and their record (None:
    # it does not speculate).
    speculation: SpeculationState | None = None

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
    detokenizer: IncrementalDetokenizer | None = None
    reasoning: ReasoningSplitter | None = None  # thinking models' chats: splits the text
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

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        """Draft tokens proposed for the request's next step (verified with its last token)."""
        spec = self.speculation
        return () if spec is None or spec.proposal is None else spec.proposal.tokens

    def drop_drafts(self) -> None:
        """Forget the proposed drafts (preempted, finished, or verified)."""
        if self.speculation is not None:
            self.speculation.proposal = None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def release_grammar(self) -> None:
        """Drop the grammar's live matcher (finished, aborted, failed or preempted: it is
        rebuilt from the output tokens if the request runs again)."""
        if self.grammar is not None:
            self.grammar.release()
