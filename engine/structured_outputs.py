"""StructuredOutputs: what a request's output must fit (vLLM's names): a JSON schema, any JSON
object, a regular expression, one of a list of strings, or a grammar in llguidance's Lark
dialect. Pure Python (front ends import it without torch); compiled by engine.grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint. `json` is a JSON schema (a dict, or its JSON text), kept as
    canonical JSON text so that equal schemas share one compiled grammar; `json_object` asks
    for any JSON object; `regex` for text matching it whole; `choice` for one of the strings;
    `grammar` for text in the Lark grammar (llguidance's dialect, whose `%json {...}` embeds a
    schema). Output JSON is compact unless `whitespace_flexible` (which lets a model pad it
    with whitespace indefinitely)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputs takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_schema(self.json))
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("StructuredOutputs.choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output fits, for json and json_object (else None)."""
        if self.json is not None:
            return json.loads(self.json)
        return {"type": "object"} if self.json_object else None


def _canonical_schema(schema: str | dict) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"StructuredOutputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("StructuredOutputs.json must be a JSON schema object (a dict), got "
                         f"{type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False)  # key order kept: it orders the output
