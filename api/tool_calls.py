"""Tool calls of one chat request: the constraint that `tool_choice` required or a named
function puts on the reply, the calls found in a finished reply, and the tool-call deltas of
a streamed one (OpenAI's shape: a call's first delta carries its index, id, type and name
with empty arguments; later ones carry pieces of the arguments' JSON text)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from api.errors import APIError
from api.protocol import ChatCompletionRequest
from engine.structured_outputs import StructuredOutputs
from engine.tools import ToolParser


@dataclass(frozen=True)
class ToolPlan:
    """How a request's reply is read: `parser` finds calls in it (None: plain text), and
    `constraint` (tool_choice required or named) makes it calls only."""

    parser: ToolParser | None = None
    constraint: StructuredOutputs | None = None

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: ToolParser | None, tokenizer) -> ToolPlan:
        mode = body.tool_choice_mode
        if mode == "none" or not body.tools:
            return cls()
        if parser is None:
            raise APIError(400, "tools: this model's chat template does not say how the model "
                           "writes tool calls (a Hermes <tool_call>, Mistral [TOOL_CALLS], Llama "
                           "3 JSON, pythonic, Phi-4 <|tool_call|> or Gemma 4 <|tool_call> "
                           "template is needed)", param="tools")
        constraint = None
        if mode in ("required", "named"):
            tools = [t.model_dump(exclude_none=True) for t in body.tools]
            if mode == "named":
                tools = [t for t in tools if t["function"]["name"]
                         == body.tool_choice.function.name]
            parallel = body.parallel_tool_calls and mode == "required"
            constraint = StructuredOutputs(
                grammar=parser.grammar(tools, parallel, added_token_id(tokenizer)))
        return cls(parser, constraint)

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """A finished reply's content and tool calls (OpenAI's message fields)."""
        if self.parser is None:
            return text, []
        content, calls = self.parser.calls(text)
        return content, [_call(c.name, c.arguments) for c in calls]


@dataclass
class ToolStream:
    """One choice's reply as it streams: content deltas until calls start, then call
    deltas."""

    parser: ToolParser
    text: str = ""
    content_sent: int = 0
    calls_sent: list[list] = field(default_factory=list)  # [id, arguments sent]

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        self.text += delta
        parsed = self.parser.parse(self.text, final=finished)
        content = parsed.content or ""
        out_content = content[self.content_sent:] if len(content) > self.content_sent else ""
        self.content_sent = max(self.content_sent, len(content))
        deltas = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if i == len(self.calls_sent):
                self.calls_sent.append([_call_id(), 0])
                deltas.append({"index": i, "id": self.calls_sent[i][0], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self.calls_sent[i][1]
            if len(call.arguments) > sent:
                deltas.append({"index": i, "function": {"arguments": call.arguments[sent:]}})
                self.calls_sent[i][1] = len(call.arguments)
        if finished and not self.calls_sent:  # no call read whole: the reply is all text
            out_content += self.text[self.content_sent:]
            self.content_sent = len(self.text)
        return out_content, deltas

    @property
    def called(self) -> bool:
        return bool(self.calls_sent)


def _call(name: str, arguments: str) -> dict:
    return {"id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def added_token_id(tokenizer):
    """Marker -> id, for markers that are one added token of the model (special or not:
    llguidance treats every added token as special, so a grammar names them by id)."""
    added = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    return added.get
