"""The published schema of a request's output options: `response_format` (OpenAI's text,
json_object and json_schema), vLLM's `structured_outputs` (and its older `guided_*` fields),
function tools with `tool_choice`, and speculative decoding's per-request `speculative_config`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.speculative_option import MAX_SPECULATIVE_TOKENS
from engine.structured_outputs import StructuredOutputs


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextFormat(_Model):
    type: Literal["text"]


class JsonObjectFormat(_Model):
    type: Literal["json_object"]


class JsonSchema(_Model):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Model):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class StructuredOutputsField(_Model):
    """vLLM's extension: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect)")
    disable_any_whitespace: bool = True


def structured_outputs(
    response_format: Any | None,
    field: StructuredOutputsField | None,
    guided: dict[str, Any],
) -> StructuredOutputs | None:
    """The request's constraint, from whichever field sets it (ValueError if several do)."""
    found: list[StructuredOutputs] = []
    if isinstance(response_format, JsonSchemaFormat):
        found.append(StructuredOutputs(json=response_format.json_schema.schema_))
    elif isinstance(response_format, JsonObjectFormat):
        found.append(StructuredOutputs(json_object=True))
    if field is not None:
        found.append(StructuredOutputs(
            json=field.json_, json_object=bool(field.json_object), regex=field.regex,
            choice=field.choice, grammar=field.grammar,
            whitespace_flexible=not field.disable_any_whitespace))
    kinds = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
             "guided_grammar": "grammar"}
    for name, value in guided.items():
        if value is not None:
            found.append(StructuredOutputs(**{kinds[name]: value}))
    if len(found) > 1:
        raise ValueError("response_format, structured_outputs and guided_* each set an output "
                         "constraint; send one")
    return found[0] if found else None


class FunctionDefinition(_Model):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class SpeculativeConfig(_Model):
    """Per request, vLLM's `speculative_config` names: `method` "ngram" (n-gram lookup, on any
    engine started with speculative decoding) or the engine's own drafter ("draft", "mtp"),
    and `num_speculative_tokens`, the most draft tokens verified per step (0: this request does
    not speculate). The output is unchanged either way (docs/speculative.md)."""

    method: Literal["ngram", "draft", "mtp"] | None = None
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
