"""What every tool-call format shares: the calls found in a reply, a reply parsed as it
streams, and JSON scanning that tolerates an unfinished value."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """A call: the function's name and its arguments as JSON text (as the model wrote them,
    for the JSON formats, so that a stream's pieces add up to the same text)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class PartialCall:
    """A call as far as it has streamed: its name once known (else None), the arguments'
    text so far, and whether it is complete."""

    name: str | None
    arguments: str
    complete: bool


@dataclass(frozen=True)
class Parsed:
    """A reply split into its text (the part before any call; None if there is none) and
    its calls."""

    content: str | None
    calls: list[PartialCall]


# The token id of a marker when it is a single added token of the model (None otherwise):
# a grammar must name such a token by id (llguidance treats added tokens as special; their
# text as a string does not match them).
TokenId = Callable[[str], "int | None"]


class ToolParser:
    """One family's format. `parse` reads a reply so far (`final` when it has ended);
    `grammar` writes the Lark grammar (llguidance's dialect) of a reply made of calls only:
    one call (`parallel` false) or several, to `tools` (OpenAI tool definitions)."""

    name: str

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def grammar(self, tools: list[dict], parallel: bool, token_id: TokenId) -> str:
        raise NotImplementedError

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole reply's content and complete calls (a call cut off or malformed is left
        out; a reply with no call that reads whole is all content)."""
        parsed = self.parse(text, final=True)
        calls = [ToolCall(c.name, c.arguments) for c in parsed.calls if c.complete and c.name]
        return (parsed.content, calls) if calls else (text, [])


def value_end(text: str, start: int) -> int | None:
    """The end of the JSON value starting at `start` (whitespace skipped), or None if the
    text ends before it does."""
    i, n = start, len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    if text[i] not in "{[\"":
        m = re.compile(r"[^,\]\}\s;]*").match(text, i)
        return m.end() if m.end() < n else None
    depth, in_string, escaped = 0, False, False
    for j in range(i, n):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def function_schema(tool: dict) -> dict:
    """A tool's parameters schema (an object with no properties when it declares none)."""
    params = tool["function"].get("parameters") or {"type": "object", "properties": {}}
    return params


def compact(schema: dict) -> dict:
    """`schema` written without whitespace between tokens (llguidance's option), so that a
    constrained call cannot run on in blanks."""
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def call_object_schema(tools: list[dict], args_key: str) -> dict:
    """The JSON schema of one call object {"name": ..., <args_key>: {...}} to any of
    `tools`, written compactly."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]},
                       args_key: function_schema(t)},
        "required": ["name", args_key],
        "additionalProperties": False,
    } for t in tools]
    return compact(options[0] if len(options) == 1 else {"anyOf": options})


def lark_literal(marker: str, token_id: TokenId) -> str:
    """A marker in a grammar: by id where it is one added token, else as text."""
    tid = token_id(marker)
    return f"<[{tid}]>" if tid is not None else json.dumps(marker)


def ordered_pairs(pairs: list[tuple[str, bool]], separator: str) -> str:
    """A grammar rule for key-value pairs (each `(rule, required)`) in order, each optional one
    skippable, `separator` (a grammar string literal) between them."""
    if not pairs:
        return '""'
    (first, required), rest = pairs[0], pairs[1:]
    tail = " ".join(f"{separator} {kv}" if req else f"({separator} {kv})?"
                    for kv, req in rest) or '""'
    if required:
        return f"{first} {tail}"
    return f"({first} {tail} | {ordered_pairs(rest, separator)})"
