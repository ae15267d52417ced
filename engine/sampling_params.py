"""SamplingParams: how one request's tokens are chosen and when its generation stops."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.speculative_option import MAX_SPECULATIVE_TOKENS, METHODS
from engine.structured_outputs import StructuredOutputs
from models.token_rules import TokenRules

MAX_LOGPROBS = 20
MAX_N = 16  # completions per request


class SamplingParamsError(ValueError):
    """An invalid sampling option; `field` names it (front ends map it to their own names)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options (the vLLM names, which our users already know).

    temperature 0 means greedy. top_k 0 (or -1) disables top-k; top_p 1 and min_p 0 disable
    those filters. `seed` makes one request reproducible whatever else shares its batch.
    `stop` strings end generation and are not included in the text; `stop_token_ids` end it too.
    `logprobs=k` returns, for every sampled token, its log-probability and the k most likely.
    `n` completions share one prompt (and one prefill; see engine/fanout.py); with a seed,
    completion i draws from its own stream derived from (seed, i).
    `presence_penalty` / `frequency_penalty` (OpenAI's, in [-2, 2]) subtract from the logit of
    every token already generated, once / per occurrence; `logit_bias` adds to given token ids'
    logits (a mapping, stored as sorted (id, bias) pairs). `structured_outputs` constrains the
    output (engine/structured_outputs.py).
    `lora` names a LoRA adapter the engine loaded (EngineConfig.lora_adapters, or one the
    checkpoint ships); None: the model's default for the request's media (most: none).
    `num_speculative_tokens` caps the draft tokens verified per step for this request on an
    engine started with `speculative` (0: it does not speculate; None: the engine's cap), and
    `speculative_method` "ngram" has it drafted by n-gram lookup whatever the engine's drafter
    (None: the engine's). Speculation never changes which tokens come out at temperature 0,
    nor their distribution above it.
    `token_rules` rules tokens out step by step from the tokens generated so far, before
    anything else applies (models/token_rules.py; Whisper's timestamp rules); its
    log-probabilities are those of the ruled distribution.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    structured_outputs: StructuredOutputs | None = None
    lora: str | None = None
    num_speculative_tokens: int | None = None
    speculative_method: str | None = None
    token_rules: TokenRules | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        object.__setattr__(self, "logit_bias", tuple(tuple(p) for p in self.logit_bias))
        # Accept a single string / lists for convenience; store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            got = getattr(self, name)
            return SamplingParamsError(name, f"SamplingParams.{name} {rule}, got {got!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be None or an integer in [0, 2**63)")
        if not _is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise bad("lora", "must be None or an adapter's name")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_num(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not all(len(p) == 2 and _is_int(p[0]) and p[0] >= 0 and _is_num(p[1])
                   and -100.0 <= p[1] <= 100.0 for p in self.logit_bias):
            raise bad("logit_bias", "must map token ids (integers >= 0) to biases in [-100, 100]")
        if self.num_speculative_tokens is not None and (
                not _is_int(self.num_speculative_tokens)
                or not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise bad("num_speculative_tokens",
                      f"must be None or an integer in [0, {MAX_SPECULATIVE_TOKENS}]")
        if self.speculative_method is not None and self.speculative_method not in METHODS:
            raise bad("speculative_method", f"must be None or one of {', '.join(METHODS)}")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", "must be a StructuredOutputs")
        if self.token_rules is not None and not isinstance(self.token_rules, TokenRules):
            raise bad("token_rules", "must be None or a TokenRules (a `mask` method)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError for a token id (logit_bias, stop_token_ids) outside the vocabulary."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]),
                          ("stop_token_ids", self.stop_token_ids)):
            if any(t >= vocab_size for t in ids):
                raise SamplingParamsError(name, f"{name}: token id {max(ids)} is outside the "
                                          f"vocabulary (ids 0 to {vocab_size - 1})")

    @property
    def penalized(self) -> bool:
        """Whether presence or frequency penalties apply."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # v == v: not NaN
