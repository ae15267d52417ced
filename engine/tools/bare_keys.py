"""The bare-keys tool-call format (Gemma 4, as its chat template writes calls and vLLM's
`gemma4` parser reads them): each call a block `<|tool_call>call:NAME{key:value,...}<tool_call|>`,
blocks back to back. Keys are bare words; strings sit between `<|"|>` delimiters; numbers,
true, false and null are written bare; lists as `[...]` and objects as `{...}` with bare keys.
A call's arguments come out as JSON text. Pure Python.

A block that does not read as such a call (an unknown value, a missing brace) is no call: the
reply stays text.
"""

from __future__ import annotations

import json
import re

from engine.tools.base import (
    Parsed,
    PartialCall,
    TokenId,
    ToolParser,
    compact,
    held_back,
    lark_literal,
    ordered_pairs,
)

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_HEAD = re.compile(r"\s*call:([\w\-.]+)\{")
_BARE = re.compile(r"[^,\]\}\s]+")
_KEY = re.compile(r"[^:,\{\}\[\]\s]+")
# Schema words that describe a value without constraining it.
_ANNOTATIONS = {"description", "title", "default", "examples", "additionalProperties",
                "$schema", "nullable"}


class BareKeys(ToolParser):
    name = "bare_keys"

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(OPEN)
        if at == -1:
            keep = 0 if final else held_back(text, OPEN)
            return Parsed(text[: len(text) - keep], [])
        calls, i = [], at
        while i != -1:
            start = i + len(OPEN)
            end = text.find(CLOSE, start)
            calls.append(_call(text[start:] if end == -1 else text[start:end], end != -1))
            if end == -1:
                break
            i = text.find(OPEN, end + len(CLOSE))
        return Parsed(text[:at].strip() or None, calls)

    def grammar(self, tools: list[dict], parallel: bool, token_id: TokenId) -> str:
        rules = _Rules(lark_literal(QUOTE, token_id))
        names = []
        for tool in tools:
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            body = rules.object_body(params, f"tools.{fn['name']}")
            names.append(rules.add(f'{json.dumps(fn["name"] + "{")} {body} "}}"'))
        block = (f'{lark_literal(OPEN, token_id)} "call:" ({" | ".join(names)}) '
                 f"{lark_literal(CLOSE, token_id)}")
        start = "start: block+" if parallel else "start: block"
        return "\n".join([start, f"block: {block}", *rules.lines]) + "\n"


def _call(body: str, complete: bool) -> PartialCall:
    """One block's call, once the block is closed and reads whole: its name and arguments
    (JSON text). Until then it has no name, so that a stream sends nothing of a block that
    turns out malformed (its text is then the reply's)."""
    head = _HEAD.match(body)
    if head is None or not complete:
        return PartialCall(None, "", False)
    try:
        args, end = _object(body, head.end() - 1)
    except ValueError:
        return PartialCall(None, "", False)
    if body[end:].strip():
        return PartialCall(None, "", False)
    return PartialCall(head.group(1), json.dumps(args, ensure_ascii=False), True)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _object(text: str, i: int) -> tuple[dict, int]:
    """The object whose `{` is at `i`, and the index after its `}` (ValueError if malformed)."""
    out: dict = {}
    i = _skip(text, i + 1)
    if text.startswith("}", i):
        return out, i + 1
    while True:
        if text.startswith(QUOTE, i):
            key, i = _string(text, i)
        else:
            m = _KEY.match(text, i)
            if m is None:
                raise ValueError(f"no key at {i}")
            key, i = m.group(), m.end()
        i = _skip(text, i)
        if not text.startswith(":", i):
            raise ValueError(f"no ':' after key {key!r}")
        out[key], i = _value(text, _skip(text, i + 1))
        i = _skip(text, i)
        if text.startswith("}", i):
            return out, i + 1
        if not text.startswith(",", i):
            raise ValueError(f"no ',' or '}}' at {i}")
        i = _skip(text, i + 1)


def _value(text: str, i: int):
    if text.startswith(QUOTE, i):
        return _string(text, i)
    if text.startswith("{", i):
        return _object(text, i)
    if text.startswith("[", i):
        items: list = []
        i = _skip(text, i + 1)
        if text.startswith("]", i):
            return items, i + 1
        while True:
            item, i = _value(text, i)
            items.append(item)
            i = _skip(text, i)
            if text.startswith("]", i):
                return items, i + 1
            if not text.startswith(",", i):
                raise ValueError(f"no ',' or ']' at {i}")
            i = _skip(text, i + 1)
    m = _BARE.match(text, i)
    if m is None:
        raise ValueError(f"no value at {i}")
    word = m.group()
    try:
        value = json.loads(word)
    except ValueError:
        raise ValueError(f"{word!r} is not a number, true, false or null") from None
    if isinstance(value, (dict, list, str)):
        raise ValueError(f"{word!r} is not a bare value")
    return value, m.end()


def _string(text: str, i: int) -> tuple[str, int]:
    end = text.find(QUOTE, i + len(QUOTE))
    if end == -1:
        raise ValueError("unterminated string")
    return text[i + len(QUOTE):end], end + len(QUOTE)


class _Rules:
    """Lark rules for values written in the format, one per schema node that needs its own."""

    def __init__(self, quote: str) -> None:
        self.quote = quote
        self.lines: list[str] = []

    def add(self, body: str) -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def value(self, schema: dict, where: str) -> str:
        """A Lark expression for a value fitting `schema` (ValueError naming `where` and the
        schema word this grammar cannot enforce)."""
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: a schema must be an object")
        for word in ("anyOf", "oneOf"):
            if word in schema:
                return "(" + " | ".join(self.value(s, f"{where}.{word}")
                                        for s in schema[word]) + ")"
        if "enum" in schema or "const" in schema:
            options = schema["enum"] if "enum" in schema else [schema["const"]]
            return "(" + " | ".join(self.literal(v) for v in options) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}, where) for k in kind) + ")"
        known = {"type", *_ANNOTATIONS}
        if kind == "string":
            return self.string(schema, where)
        if kind in ("integer", "number", "boolean", "null"):
            return self.add(f"%json {json.dumps(compact(schema))}")  # written as JSON does
        if kind == "array":
            self.check(schema, known | {"items", "minItems", "maxItems"}, where)
            item = self.value(schema.get("items") or {}, f"{where}.items")
            low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
            if high == 0:
                return '"[" "]"'
            first = max(low, 1)
            need = " ".join([item] + [f'"," {item}'] * (first - 1))
            more = f'("," {item})*' if high is None else \
                f'("," {item}){{0,{high - first}}}' if high > first else ""
            return self.add(f'"[" {need} {more} "]"' + ("" if low else ' | "[" "]"'))
        if kind == "object":
            return self.add(f'"{{" {self.object_body(schema, where)} "}}"')
        raise ValueError(f"{where}: the bare-keys call grammar needs a 'type' of string, "
                         "integer, number, boolean, null, array or object (or an enum)")

    def object_body(self, schema: dict, where: str) -> str:
        """An object's `key:value` pairs in the template's order (keys sorted), each optional
        one skippable, commas between."""
        self.check(schema, {"type", "properties", "required", *_ANNOTATIONS}, where)
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        pairs = [(f'{json.dumps(k + ":")} {self.value(props[k], f"{where}.{k}")}',
                  k in required) for k in sorted(props)]
        return ordered_pairs(pairs, '","')

    def string(self, schema: dict, where: str) -> str:
        self.check(schema, {"type", "minLength", "maxLength", "pattern", *_ANNOTATIONS}, where)
        if "pattern" in schema:
            if "minLength" in schema or "maxLength" in schema:
                raise ValueError(f"{where}: the bare-keys call grammar takes a string's "
                                 "pattern or its lengths, not both")
            pattern = schema["pattern"]
            body = pattern[1:-1] if pattern.startswith("^") and pattern.endswith("$") \
                else f"[\\s\\S]*(?:{pattern})[\\s\\S]*"
        else:
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            body = f"[\\s\\S]{{{low},{'' if high is None else high}}}"
        return f"{self.quote} /{body.replace('/', chr(92) + '/')}/ {self.quote}"

    def literal(self, value) -> str:
        if isinstance(value, str):
            return f"{self.quote} {json.dumps(value)} {self.quote}" if value else \
                f"{self.quote} {self.quote}"
        if isinstance(value, (bool, int, float)) or value is None:
            return json.dumps(json.dumps(value))
        raise ValueError(f"enum value {value!r}: only strings, numbers, booleans and null")

    @staticmethod
    def check(schema: dict, known: set[str], where: str) -> None:
        extra = sorted(set(schema) - known)
        if extra:
            raise ValueError(f"{where}: the bare-keys call grammar cannot enforce "
                             f"{', '.join(extra)}")


BARE_KEYS = BareKeys()
