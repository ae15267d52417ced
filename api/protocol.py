"""OpenAI request bodies as pydantic models (the published schema of /openapi.json), and their
mapping onto SamplingParams and the engine's chat options.

Unknown fields are ignored, as OpenAI does; known fields of the wrong type are refused (strict
JSON types: a string is never read as a number). Value ranges are checked here where the schema
states them and by SamplingParams otherwise (a ValueError naming the field: a 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from api.errors import APIError
from api.messages import ChatMessage
from api.options import (
    NamedToolChoice,
    ResponseFormat,
    SpeculativeConfig,
    StructuredOutputsField,
    Tool,
    ToolChoice,
    structured_outputs,
)
from engine import SamplingParams
from engine.sampling_params import MAX_LOGPROBS, MAX_N
from engine.structured_outputs import StructuredOutputs

# Used when a request sets neither max_tokens nor max_completion_tokens. The engine also caps
# every request at what fits in max_model_len (prompt + output), ending it with "length".
DEFAULT_MAX_TOKENS = 512


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_N, description="completions of the prompt (one prefill)")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit")
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, description="token ids that end generation")
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # prompt_token_ids and token_ids in the response
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    lora: str | None = None  # ours: a LoRA adapter the engine loaded (SamplingParams.lora)
    speculative_config: SpeculativeConfig | None = None  # vLLM's names, per request

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_logprobs(self) -> int | None:
        """How many top alternatives to return per token; None: no logprobs at all."""
        raise NotImplementedError

    def sampling_params(
        self, defaults: Mapping[str, Any] | None = None,
        constraint: StructuredOutputs | None = None,
    ) -> SamplingParams:
        """The engine's parameters; a sampling field the request leaves out takes the model's
        default (`defaults`, from its generation_config.json, as vLLM does), else OpenAI's.
        Raises APIError for an unsupported combination and ValueError (from SamplingParams,
        naming the field) for a value out of range."""
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
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self._logit_bias(),
            structured_outputs=constraint or self.output_constraint(),
            lora=self.lora,
            **self._speculation(),
        )

    def _speculation(self) -> dict[str, Any]:
        spec = self.speculative_config
        if spec is None:
            return {}
        return {"num_speculative_tokens": spec.num_speculative_tokens,
                "speculative_method": spec.method}

    def output_constraint(self) -> StructuredOutputs | None:
        guided = {k: getattr(self, k) for k in
                  ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}
        return structured_outputs(None, self.structured_outputs, guided)

    def _logit_bias(self) -> dict[int, float]:
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise APIError(400, f"logit_bias: key {key!r} is not a token id (an integer "
                               "written as a string)", param="logit_bias")
            out[int(key)] = value
        return out

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _refuse_unsupported(self) -> None:
        pass


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="variables for the chat template (only ones it reads), such as "
                          "enable_thinking")
    # vLLM extension: per-request options of the model's media processor (min_pixels, fps...),
    # checked against the ranges the processor declares (a 400 names the option and range).
    mm_processor_kwargs: dict[str, Any] | None = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_choice_mode(self) -> str:
        """none, auto, required or named (OpenAI's default: auto with tools, else none)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def output_constraint(self) -> StructuredOutputs | None:
        guided = {k: getattr(self, k) for k in
                  ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}
        return structured_outputs(self.response_format, self.structured_outputs, guided)

    def engine_messages(self) -> list[dict]:
        return [m.engine_message() for m in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for AsyncLLM.chat beyond the messages."""
        kwargs: dict[str, Any] = {}
        if self.chat_template_kwargs:
            kwargs["chat_template_kwargs"] = self.chat_template_kwargs
        if self.mm_processor_kwargs:
            kwargs["mm_processor_kwargs"] = self.mm_processor_kwargs
        if self.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        return kwargs

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _refuse_unsupported(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise _unsupported("top_logprobs", "top_logprobs requires logprobs to be true")
        mode = self.tool_choice_mode
        if mode in ("required", "named") and not self.tools:
            raise _unsupported("tool_choice", f"tool_choice {mode!r} needs tools")
        if mode == "named":
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise _unsupported("tool_choice", f"tool_choice names {name!r}, which is not "
                                   "one of the tools")
        if mode in ("required", "named") and self.output_constraint() is not None:
            raise _unsupported("tool_choice", f"tool_choice {mode!r} constrains the reply to "
                               "tool calls; it cannot also follow response_format")


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt, as a string or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

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
        if self.echo and self.logprobs is not None:
            raise _unsupported("echo", "echo with logprobs is not supported (it needs the "
                               "prompt's log-probabilities, which this server does not compute)")
        if self.suffix and self.echo:
            raise _unsupported("suffix", "suffix cannot be combined with echo")
        if self.suffix and not isinstance(self.engine_prompt(), str):
            raise _unsupported("suffix", "suffix needs a text prompt")
        if self.best_of not in (None, self.n):
            raise _unsupported("best_of", "best_of must equal n (every completion is returned)")


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")
