"""One streamed chat completion, read chunk by chunk into RequestOutputs.

It reads the fields every OpenAI-compatible server sends (`choices[0].delta.content`,
`finish_reason`, the `usage` chunk of `stream_options.include_usage` with
`prompt_tokens_details.cached_tokens`), vLLM's token ids (`prompt_token_ids` in the first chunk,
`choices[0].token_ids` in each) and mmserve's `mmserve` object (placeholders with their
encoder-cache outcome, and the server's stage timings). TTFT and decode times are measured
here, at arrival. What the server did not send is listed in `RequestOutput.unreported`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.metrics import RequestMetrics
from engine.outputs import CompletionOutput, PlaceholderInfo, RequestOutput

EXTENSION = "mmserve"  # the key of mmserve's own fields in responses

# Why a panel lacks something, for each thing a server may not report.
NO_PROMPT_IDS = (
    "The server did not return the prompt's token ids: vLLM returns them from version 0.10.2 "
    "on when asked (this app asks, unless started with --backend-no-token-ids); SGLang does "
    "not."
)
NO_SPANS = "The media spans cannot be located without the prompt's token ids."
NO_CACHED_TOKENS = (
    "Not reported by the server: vLLM reports reused prompt tokens only when started with "
    "--enable-prompt-tokens-details, and leaves a count of 0 out; SGLang needs "
    "--enable-cache-report."
)
AT_THE_END = "Reported by the server when the reply ends."
NO_ENCODER_CACHE = (
    "Not reported by the server: per-item encoder-cache outcomes and content hashes are not "
    "part of the OpenAI API (an mmserve server sends them)."
)
NO_SERVER_TIMING = (
    "The server does not report its stages (media decoding, queue, encoder, prefill): TTFT "
    "and decode are measured at this app, network included."
)


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each server-sent event (multi-line data joined by newlines; comments and
    other fields skipped)."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


@dataclass
class StreamState:
    """What one request's chunks said so far, and the client-side instants."""

    request_id: str
    arrival_time: float
    encode_seconds: float
    media: tuple[str, ...]  # the modality of each media item sent, in order
    from_mmserve: bool = False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict[str, Any] | None = None
    report: dict[str, Any] | None = None  # the `mmserve` object
    placeholders: list[PlaceholderInfo] | None = None  # located from the prompt's ids
    placeholders_note: str | None = None  # why they are missing or approximate
    first_token_time: float | None = None
    last_token_time: float | None = None
    reasoning: str | None = None  # `reasoning_content` deltas (vLLM's, ours)
    _delta_text: str = ""
    _delta_reasoning: str = ""
    _delta_ids: list[int] = field(default_factory=list)

    def add(self, chunk: dict[str, Any], now: float) -> bool:
        """Take one chunk; True when it carried generated text or tokens."""
        if isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_token_ids = [int(t) for t in chunk["prompt_token_ids"]]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get(EXTENSION), dict):
            self.report = chunk[EXTENSION]
        choices = chunk.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return False
        choice = choices[0]
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
        ids = [int(t) for t in choice.get("token_ids") or []]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
            self.stop_reason = choice.get("stop_reason")
        if isinstance(thought, str) and thought:
            self.reasoning = (self.reasoning or "") + thought
            self._delta_reasoning += thought
        if not text and not ids and not thought:
            return False
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.text += text
        self.token_ids += ids
        self._delta_text += text
        self._delta_ids += ids
        return True

    def output(self, *, finished: bool = False, finish_reason: str | None = None,
               now: float | None = None) -> RequestOutput:
        """The request as a RequestOutput (the deltas since the previous call); `finished`
        with the server's finish_reason, or `finish_reason` to end it otherwise ("abort")."""
        reason = (finish_reason or self.finish_reason) if finished else None
        usage = self.usage or {}
        completion = CompletionOutput(
            index=0, text=self.text, token_ids=list(self.token_ids), finish_reason=reason,
            stop_reason=self.stop_reason if finished else None, delta_text=self._delta_text,
            delta_token_ids=self._delta_ids, num_tokens=self._num_output_tokens(usage),
            reasoning_content=self.reasoning, delta_reasoning_content=self._delta_reasoning,
        )
        self._delta_text, self._delta_ids, self._delta_reasoning = "", [], ""
        prompt_ids = self.prompt_token_ids
        unreported = self._unreported(finished)
        return RequestOutput(
            request_id=self.request_id,
            prompt=None,
            prompt_token_ids=list(prompt_ids or []),
            outputs=[completion],
            finished=finished,
            num_cached_tokens=_cached_tokens(usage),
            metrics=self._metrics(now if finished else None),
            multi_modal_placeholders=self._placeholders(),
            num_prompt_tokens=len(prompt_ids) if prompt_ids is not None else _int(
                usage.get("prompt_tokens")),
            unreported=unreported,
        )

    def _num_output_tokens(self, usage: dict[str, Any]) -> int | None:
        if self.token_ids:
            return len(self.token_ids)
        return _int(usage.get("completion_tokens"))

    def _placeholders(self) -> list[PlaceholderInfo]:
        if self.report is not None:
            return _report_placeholders(self.report.get("placeholders") or [])
        return list(self.placeholders or [])

    def _unreported(self, finished: bool) -> dict[str, str]:
        notes: dict[str, str] = {}
        if self.prompt_token_ids is None:
            notes["prompt_token_ids"] = NO_PROMPT_IDS
        if _cached_tokens(self.usage or {}) is None:
            notes["cached_tokens"] = AT_THE_END if self.usage is None else NO_CACHED_TOKENS
        if self.report is not None:  # mmserve reported everything else
            return notes
        pending = self.from_mmserve and not finished  # mmserve reports on its last chunk
        notes["server_timing"] = AT_THE_END if pending else NO_SERVER_TIMING
        if self.media:
            notes["encoder_cache"] = AT_THE_END if pending else NO_ENCODER_CACHE
            if pending:
                notes["placeholders"] = AT_THE_END
            elif self.placeholders_note is not None:
                notes["placeholders"] = self.placeholders_note
            elif self.placeholders is None:
                notes["placeholders"] = NO_SPANS
        return notes

    def _metrics(self, finished_time: float | None) -> RequestMetrics:
        m = RequestMetrics(
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            last_token_time=self.last_token_time,
            finished_time=finished_time,
            stages={"encode_request": self.encode_seconds},
        )
        server = (self.report or {}).get("metrics")
        if isinstance(server, dict):
            _merge_server_metrics(m, server)
        return m


def _merge_server_metrics(m: RequestMetrics, server: dict[str, Any]) -> None:
    """The server's stage durations into the client's metrics (its instants are on another
    clock, so only durations are taken; the queue time becomes the stage "queue")."""
    stages = server.get("stages")
    if isinstance(stages, dict):
        m.stages.update({k: float(v) for k, v in stages.items() if _is_number(v)})
    if _is_number(server.get("queue_time")):
        m.stages["queue"] = float(server["queue_time"])
    chunks = server.get("prefill_chunks")
    if isinstance(chunks, list):
        m.prefill_chunks = [(int(t), float(s)) for t, s in chunks]
    for name in ("encoder_time",):
        if _is_number(server.get(name)):
            setattr(m, name, float(server[name]))
    for name in ("num_preemptions", "encoder_calls", "encoder_cache_hits",
                 "encoder_cache_misses"):
        if _is_number(server.get(name)):
            setattr(m, name, int(server[name]))


def _report_placeholders(items: Sequence[Any]) -> list[PlaceholderInfo]:
    """mmserve's placeholders as PlaceholderInfo; fields an older server leaves out (`item`,
    `part`, ...) take their defaults."""
    out = []
    for p in items:
        if isinstance(p, dict):
            hit, item, part = p.get("cache_hit"), p.get("item"), p.get("part")
            out.append(PlaceholderInfo(
                str(p["modality"]), int(p["offset"]), int(p["length"]), int(p["num_embeds"]),
                p.get("identifier") if isinstance(p.get("identifier"), str) else None,
                hit if isinstance(hit, bool) else None,
                tuple((str(name), int(n)) for name, n in p.get("parts") or ()),
                tuple(int(k) for k in p.get("text_offsets") or ()),
                item if isinstance(item, str) else None,
                part if isinstance(part, str) else "",
            ))
    return out


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    return _int(details.get("cached_tokens")) if isinstance(details, dict) else None


def _int(value: Any) -> int | None:
    return int(value) if _is_number(value) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
