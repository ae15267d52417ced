"""OpenAI request bodies: parsing with type checks, and their mapping onto SamplingParams.

Unknown fields are ignored, as OpenAI does; known fields of the wrong type are refused (strict
JSON types: a string is never read as a number). Value ranges are checked by SamplingParams.
Fields that would change the meaning of the request but are not supported (n > 1, penalties,
logit_bias, tools, echo, suffix) are refused rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.errors import APIError
from engine import SamplingParams

# Used when a request sets neither max_tokens nor max_completion_tokens. The engine also caps
# every request at what fits in max_model_len (prompt + output), ending it with "length".
DEFAULT_MAX_TOKENS = 512


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # prompt_token_ids and token_ids in the response
    lora: str | None = None  # ours: a LoRA adapter the engine loaded (SamplingParams.lora)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_logprobs(self) -> int | None:
        """How many top alternatives to return per token; None: no logprobs at all."""
        raise NotImplementedError

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters; a sampling field the request leaves out takes the model's
        default (`defaults`, from its generation_config.json, as vLLM does), else OpenAI's.
        Raises APIError for an unsupported field and ValueError (from SamplingParams, naming
        the field) for a value out of range."""
        self._refuse_unsupported()
        defaults = defaults or {}

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            max_tokens=self._max_tokens() or DEFAULT_MAX_TOKENS,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            repetition_penalty=pick("repetition_penalty", 1.0),
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            lora=self.lora,
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise _unsupported("n", f"n={self.n} is not supported: this server returns one "
                               "choice per request (n must be 1)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise _unsupported(name, f"{name} is not supported (only 0); "
                                   "use repetition_penalty instead")
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias is not supported")


class ChatMessage(BaseModel):
    """One message; extra keys (name, ...) are kept for the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    # vLLM extension: per-request options of the model's media processor (min_pixels, fps...),
    # checked against the ranges the processor declares (a 400 names the option and range).
    mm_processor_kwargs: dict[str, Any] | None = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_messages(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for AsyncLLM.chat beyond the messages."""
        return {"mm_processor_kwargs": self.mm_processor_kwargs} if self.mm_processor_kwargs else {}

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise _unsupported("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.tools:
            raise _unsupported("tools", "tools (function calling) are not supported")


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt, as a string or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def engine_prompt(self) -> str | list[int]:
        """The single prompt; a batch of one is accepted, larger batches are refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _unsupported("prompt", f"got {len(prompt)} prompts; this server takes one "
                                   "prompt per request")
            prompt = prompt[0]
        return prompt

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if self.echo:
            raise _unsupported("echo", "echo is not supported")
        if self.suffix:
            raise _unsupported("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise _unsupported("best_of", "best_of must be 1")


Req = TypeVar("Req", bound=BaseModel)


def parse_request(model: type[Req], body: bytes) -> Req:
    """Validate a JSON body; the 400 error names the first offending field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {first['msg']}") from None
        where = ".".join(str(p) for p in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        raise APIError(400, f"invalid request: {where or 'body'}: {first['msg']}",
                       param=param) from None


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")
