"""The published schema of response bodies (/openapi.json, /docs): what the routes send,
as pydantic models. The routes build plain dicts for speed; tests validate them against these
models, so the document stays true."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.messages import ToolCallItem


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int | None] | None = None
    # speculative decoding: the draft tokens accepted and rejected (OpenAI's names)
    completion_tokens_details: dict[str, int] | None = None


class ReplyMessage(_Model):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(None, description="thinking models: the thinking")
    tool_calls: list[ToolCallItem] | None = None


class ChatChoice(_Model):
    index: int
    message: ReplyMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls", "abort", "error"] | None


class ChatCompletion(_Model):
    """POST /v1/chat/completions (not streamed). `mmserve`: each media item's placeholder
    and encoder-cache outcome, and the request's stage timings."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    mmserve: dict[str, Any]
    prompt_token_ids: list[int] | None = None


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort", "error"] | None


class Completion(_Model):
    """POST /v1/completions (not streamed)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    mmserve: dict[str, Any]
    prompt_token_ids: list[int] | None = None


class ModelCard(_Model):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    mmserve: dict[str, Any]


class ModelList(_Model):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(_Model):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Model):
    error: ErrorDetail


DOCUMENTED: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text} for status, text in (
        (400, "a bad request: the message names the field or the problem"),
        (401, "missing or wrong API key"),
        (413, "the body is larger than the server's limit"),
        (415, "the body was not sent as application/json"),
        (422, "a media URL could not be fetched"),
        (503, "the model's queue is full, or the engine stopped"),
    )
}
