"""The JSON tool-call formats: Hermes' (Qwen), Mistral's, Llama 3's and the tagged list
(Phi-4-mini / Phi-4-multimodal). Each call is a JSON object with the function's name and its
arguments; they differ in the markers around the objects and in the arguments' key."""

from __future__ import annotations

import json
import re

from engine.tools.base import (
    Parsed,
    PartialCall,
    TokenId,
    ToolParser,
    call_object_schema,
    held_back,
    lark_literal,
    value_end,
)

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


class JsonCalls(ToolParser):
    """Calls as JSON objects after `opener` (hermes: each wrapped in opener ... closer;
    mistral: one array after the opener; tagged_list: one array between opener and closer;
    llama3: no opener, the reply itself)."""

    def __init__(self, name: str, opener: str, closer: str, args_key: str, array: bool,
                 separator: str, prefix: str = "") -> None:
        self.name = name
        self.opener = opener
        self.closer = closer
        self.args_key = args_key
        self.array = array
        self.separator = separator
        self.prefix = prefix  # llama3's optional <|python_tag|>

    def parse(self, text: str, final: bool) -> Parsed:
        if self.opener:
            at = text.find(self.opener)
            if at == -1:
                keep = 0 if final else held_back(text, self.opener)
                return Parsed(text[: len(text) - keep], [])
            content, body = text[:at].strip() or None, text[at:]
        else:  # the reply is the calls, if it starts like one
            body = text.lstrip()
            if body.startswith(self.prefix):
                body = body[len(self.prefix):].lstrip()
            if not body or (not final and self.prefix.startswith(text.lstrip())):
                return Parsed("" if not final else text, [])
            if not body.startswith("{"):
                return Parsed(text, [])
            content = None
        return Parsed(content, self._objects(body))

    def _objects(self, body: str) -> list[PartialCall]:
        calls, i = [], 0
        while True:
            start = body.find("{", i)
            if start == -1:
                return calls
            end = value_end(body, start)
            obj = body[start:] if end is None else body[start:end]
            calls.append(self._call(obj, complete=end is not None))
            if end is None:
                return calls
            i = end

    def _call(self, obj: str, complete: bool) -> PartialCall:
        name = _NAME.search(obj)
        name = json.loads(f'"{name.group(1)}"') if name else None
        key = re.search(rf'"({self.args_key}|arguments|parameters)"\s*:\s*', obj)
        args = ""
        if key:
            end = value_end(obj, key.end())
            args = obj[key.end():] if end is None else obj[key.end():end].strip()
            if end is None and not complete:
                args = args.rstrip()
            elif end is None:
                args = ""
        if complete:
            try:
                parsed = json.loads(obj)
            except ValueError:
                return PartialCall(name, args, False)
            if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
                return PartialCall(name, args, False)
            value = parsed.get(self.args_key, parsed.get("arguments", parsed.get("parameters")))
            if not args:  # arguments left out: none
                args = json.dumps(value if value is not None else {})
            return PartialCall(parsed["name"], args, True)
        return PartialCall(name, args, False)

    def grammar(self, tools: list[dict], parallel: bool, token_id: TokenId) -> str:
        schema = json.dumps(call_object_schema(tools, self.args_key))
        sep = json.dumps(self.separator)
        if self.array:
            calls = f'call ({sep} call)*' if parallel else "call"
            start = f'{lark_literal(self.opener, token_id)} "[" {calls} "]"'
            if self.closer:
                start += f" {lark_literal(self.closer, token_id)}"
        elif self.opener:
            one = f'{lark_literal(self.opener, token_id)} "\\n" call "\\n" ' \
                  f'{lark_literal(self.closer, token_id)}'
            start = f"block ({sep} block)*" if parallel else "block"
            return f"start: {start}\nblock: {one}\ncall: %json {schema}\n"
        else:
            start = f"call ({sep} call)*" if parallel else "call"
        return f"start: {start}\ncall: %json {schema}\n"


HERMES = JsonCalls("hermes", "<tool_call>", "</tool_call>", "arguments", False, "\n")
MISTRAL = JsonCalls("mistral", "[TOOL_CALLS]", "", "arguments", True, ", ")
# Phi-4-mini and Phi-4-multimodal: `<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>`
TAGGED_LIST = JsonCalls("tagged_list", "<|tool_call|>", "<|/tool_call|>", "arguments", True,
                        ", ")
LLAMA3 = JsonCalls("llama3", "", "", "parameters", False, "; ", prefix="<|python_tag|>")
