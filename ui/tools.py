"""The app's demo tool: a `get_weather(city)` function the chat can offer the model, and a
reply's tool calls as chat messages.

The tool is only offered, never run: the app shows what the model asks for (the call's name
and arguments, folded like a thought) so that a model's tool calling can be seen offline.
`TOOL_CHOICES` are OpenAI's tool_choice modes: "off" sends no tool, "auto" lets the model
decide, "required" constrains the reply to calls (structured output underneath, as the API
does for tool_choice required). Only an engine whose chat template says how its model writes
calls can take the tool (the in-process engine reads that from the template; a remote server
does not report it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import gradio as gr

from engine.interface import ChatEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputs
from engine.tools import ToolParser

TOOL_CHOICES = ("off", "auto", "required")
TOOL_CALL = "Tool call"  # the title prefix of a reply's tool-call message
DEMO_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name",
                                    "maxLength": 40}},
            "required": ["city"],
            # no other argument: a required call's grammar is then bounded (JSON Schema lets
            # an object hold keys it does not name, which a random model writes on and on)
            "additionalProperties": False,
        },
    },
}


def tool_parser(llm: ChatEngine) -> ToolParser | None:
    """How `llm`'s model writes tool calls (None: it cannot be told, or it writes none)."""
    return getattr(getattr(llm, "processor", None), "tool_parser", None)


def tool_request(
    llm: ChatEngine, model: str, choice: str, params: SamplingParams
) -> tuple[ToolParser | None, SamplingParams, dict[str, Any]]:
    """The parser of the reply, its sampling parameters and the chat template's keywords for
    tool_choice `choice`; gr.Error when the model cannot take tools."""
    if choice not in TOOL_CHOICES:
        raise gr.Error(f"Unknown tool choice {choice!r}; choose one of {', '.join(TOOL_CHOICES)}.")
    if choice == "off":
        return None, params, {}
    parser = tool_parser(llm)
    if parser is None:
        raise gr.Error(f"{model} cannot take the demo tool here: its chat template does not say "
                       "how it writes tool calls (or it is served remotely). Set the tool to off.")
    tools = [DEMO_TOOL]
    # A call's marker may be a special token ([TOOL_CALLS]): the parser must see it.
    changes: dict[str, Any] = {"skip_special_tokens": False}
    if choice == "required":
        added = {t.content: i for i, t in
                 getattr(getattr(llm, "tokenizer", None), "added_tokens_decoder", {}).items()}
        changes["structured_outputs"] = StructuredOutputs(
            grammar=parser.grammar(tools, False, added.get))
    return parser, replace(params, **changes), {"tools": tools}


def call_messages(out: RequestOutput, parser: ToolParser) -> tuple[str | None, list[dict]]:
    """A reply's text before any call, and each call as a chat message folded under its
    name ("pending" while its arguments still stream). A finished reply in which no call reads
    whole (malformed) is all text, as the API returns it."""
    parsed = parser.parse(out.outputs[0].text, final=out.finished)
    if out.finished and not any(c.complete and c.name for c in parsed.calls):
        return out.outputs[0].text, []
    messages = []
    for call in parsed.calls:
        if call.name is None:
            break
        try:
            arguments = json.dumps(json.loads(call.arguments), indent=2, ensure_ascii=False)
        except ValueError:
            arguments = call.arguments
        messages.append({
            "role": "assistant", "content": f"```json\n{arguments}\n```",
            "metadata": {"title": f"{TOOL_CALL}: {call.name}",
                         "status": "done" if call.complete else "pending"}})
    return parsed.content, messages
