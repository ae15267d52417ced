"""Server-sent-event chunks of a streamed completion, from the engine's successive
RequestOutputs: per choice, a chunk per output that carries new text (or new logprobs), then
one with its finish_reason; then the usage. Chat chunks carry the reply's pieces as OpenAI
and vLLM send them: `content`, `reasoning_content` (thinking models) and `tool_calls` deltas.
"""

from __future__ import annotations

from typing import Any

from api.responses import (
    EXTENSION,
    ResponseContext,
    chat_logprobs,
    completion_logprobs,
    extension,
    usage,
)
from api.tool_calls import ToolStream
from engine import CompletionOutput, RequestOutput


class _Stream:
    """Turns one request's outputs into chunks, each choice (completion index) on its own."""

    object_name: str

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self._sent: dict[int, int] = {}  # output tokens already covered, per choice
        self._done: set[int] = set()

    def chunks(self, out: RequestOutput) -> list[dict]:
        chunks = []
        for c in out.outputs:
            if c.index in self._done:
                continue
            chunks += self._choice_chunks(out, c)
        if out.finished and self.ctx.include_usage:
            chunks.append({**self.ctx.envelope(self.object_name), "choices": [],
                           "usage": usage(out)})
        return chunks

    def _choice_chunks(self, out: RequestOutput, c: CompletionOutput) -> list[dict]:
        sent = self._sent.get(c.index, 0)
        ids = c.token_ids[sent:]
        entries = None if c.logprobs is None else c.logprobs[sent:len(c.token_ids)]
        chunks = []
        fields = self._delta(c, c.finished)
        if fields or entries or (ids and self.ctx.return_token_ids):
            self._sent[c.index] = len(c.token_ids)
            chunks.append(self._chunk(self._choice(c.index, fields, ids, entries, None)))
        if c.finished:
            self._done.add(c.index)
            # Ids held back with text (a partial character, a possible stop string) go here.
            last = self._choice(c.index, {}, c.token_ids[self._sent.get(c.index, 0):], None,
                                self._finish_reason(c))
            self._sent[c.index] = len(c.token_ids)
            chunks.append({**self._chunk(last), EXTENSION: extension(out)})
        return chunks

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self.ctx.envelope(self.object_name), "choices": [choice]}
        if self.ctx.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, index: int, fields: dict, ids: list[int], entries: list[dict] | None,
                finish_reason: str | None) -> dict:
        choice = {"index": index, **self._fields(index, fields, ids, entries, finish_reason)}
        if self.ctx.return_token_ids:
            choice["token_ids"] = ids
        return choice

    def _delta(self, c: CompletionOutput, finished: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _fields(self, index: int, fields: dict, ids: list[int], entries: list[dict] | None,
                finish_reason: str | None) -> dict:
        raise NotImplementedError

    def _finish_reason(self, c: CompletionOutput) -> str | None:
        return c.finish_reason


class ChatStream(_Stream):
    """chat.completion.chunk events; the first one of each choice announces the assistant
    role."""

    object_name = "chat.completion.chunk"

    def __init__(self, ctx: ResponseContext) -> None:
        super().__init__(ctx)
        self._started = False
        self._tools: dict[int, ToolStream] = {}

    def chunks(self, out: RequestOutput) -> list[dict]:
        chunks = super().chunks(out)
        if not self._started:
            self._started = True
            roles = []
            for c in out.outputs:
                role = self._chunk({"index": c.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None})
                roles.append(role)
            if self.ctx.return_token_ids:
                roles[0]["prompt_token_ids"] = out.prompt_token_ids
            # The placeholders and their cache outcome are known by the first output: a
            # front end can show them while the reply streams.
            roles[0][EXTENSION] = extension(out)
            chunks[:0] = roles
        return chunks

    def _delta(self, c: CompletionOutput, finished: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if c.delta_reasoning_content:
            delta["reasoning_content"] = c.delta_reasoning_content
        text = c.delta_text
        if self.ctx.tools.parser is not None:
            stream = self._tools.setdefault(c.index, ToolStream(self.ctx.tools.parser))
            text, calls = stream.feed(text, finished)
            if calls:
                delta["tool_calls"] = calls
        if text:
            delta["content"] = text
        return delta

    def _fields(self, index, fields, ids, entries, finish_reason):
        return {
            "delta": fields,
            "logprobs": chat_logprobs(self.ctx, ids, entries),
            "finish_reason": finish_reason,
        }

    def _finish_reason(self, c: CompletionOutput) -> str | None:
        stream = self._tools.get(c.index)
        if stream is not None and stream.called and c.finish_reason == "stop":
            return "tool_calls"
        return c.finish_reason


class CompletionStream(_Stream):
    """text_completion events (with `echo`, the prompt comes first)."""

    object_name = "text_completion"

    def __init__(self, ctx: ResponseContext) -> None:
        super().__init__(ctx)
        self._offset: dict[int, int] = {}  # text_offset of the next token, per choice
        self._echoed: set[int] = set()

    def _delta(self, c: CompletionOutput, finished: bool) -> dict[str, Any]:
        text = c.delta_text
        if self.ctx.echo and c.index not in self._echoed:
            self._echoed.add(c.index)
            text = self.ctx.echo + text
        return {"text": text} if text else {}

    def _fields(self, index, fields, ids, entries, finish_reason):
        logprobs = completion_logprobs(self.ctx, ids, entries, self._offset.get(index, 0))
        if logprobs is not None:
            self._offset[index] = self._offset.get(index, 0) + sum(
                len(t) for t in logprobs["tokens"])
        return {"text": fields.get("text", ""), "logprobs": logprobs,
                "finish_reason": finish_reason}
