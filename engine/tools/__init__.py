"""Tool calls in the formats the model families write them, each a `ToolParser`: it finds
the calls in a reply (whole or as it streams) and, for `tool_choice` required or a named
function, writes the grammar that constrains the reply to calls whose arguments fit their
schemas (structured output underneath). Pure Python.

- hermes (Qwen2.5, Qwen3, Qwen3.5): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- mistral (Mistral, Mistral Small 3.1): `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`
- llama3 (Llama 3.1 / 3.2, JSON): the reply is `{"name": ..., "parameters": {...}}`
- pythonic (Gemma 3, as Google's guide prompts it): the reply is `[name(key=value), ...]`
- tagged_list (Phi-4-mini, Phi-4-multimodal):
  `<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>`
- bare_keys (Gemma 4): `<|tool_call>call:name{key:<|"|>text<|"|>,n:3}<tool_call|>`, one block a
  call (engine/tools/bare_keys.py)

The chat template says which one a model writes (`detect`).
"""

from __future__ import annotations

from engine.tools.bare_keys import BARE_KEYS
from engine.tools.base import PartialCall, ToolCall, ToolParser
from engine.tools.json_calls import HERMES, LLAMA3, MISTRAL, TAGGED_LIST
from engine.tools.pythonic import PYTHONIC

PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HERMES, MISTRAL, LLAMA3, PYTHONIC, TAGGED_LIST, BARE_KEYS)}


def detect(template: str | None) -> ToolParser | None:
    """The format a chat template teaches its model, from what it renders."""
    if not template or "tools" not in template:
        return None
    if "<|tool_call|>" in template:
        return TAGGED_LIST
    if "<|tool_call>" in template:
        return BARE_KEYS
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return LLAMA3
    if "tool_code" in template or "func_name1(" in template:
        return PYTHONIC
    return None


__all__ = ["PARSERS", "PartialCall", "ToolCall", "ToolParser", "detect"]
