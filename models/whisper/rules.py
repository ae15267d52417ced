"""Whisper's token rules for one window's decode, as transformers' generate applies them
(SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor and, with timestamps,
WhisperTimeStampLogitsProcessor) and openai-whisper's logit filters do:

- `suppress_tokens` never, `begin_suppress_tokens` not as the first generated token;
- with timestamps: `<|notimestamps|>` never; timestamps come in pairs (after a timestamp that
  follows text, the next token is a timestamp or `<|endoftext|>`; after two timestamps, text);
  they do not decrease (nor repeat, except to close a pair); the first generated token is a
  timestamp, at most `max_initial_timestamp_index` steps of 0.02 s (no bound when the
  generation config has none, transformers' default); and when the summed probability of the
  timestamps is above that of every text token, a timestamp is sampled.

"First" is the first generated token: rules see only the request's output tokens, never its
prompt (transformers' `begin_index`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from models.token_rules import VOCAB_END, TokenMask


@dataclass(frozen=True)
class WhisperRules:
    """The rules of one decode (models.token_rules.TokenRules)."""

    end: int  # <|endoftext|>: every token below it is text
    no_timestamps: int  # <|notimestamps|>; timestamps follow it
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()
    timestamps: bool = False
    max_initial_timestamp_index: int | None = None
    timestamp_from_probability: bool = True

    def __post_init__(self) -> None:
        if self.max_initial_timestamp_index is not None and self.max_initial_timestamp_index < 0:
            raise ValueError("max_initial_timestamp_index must be >= 0, got "
                             f"{self.max_initial_timestamp_index}")

    def mask(self, output_ids: Sequence[int]) -> TokenMask:
        tokens = list(self.suppress)
        if not output_ids:
            tokens += self.begin_suppress
        if not self.timestamps:
            return TokenMask(tokens=tuple(tokens))
        tokens.append(self.no_timestamps)
        begin = self.no_timestamps + 1
        ranges = []
        last = len(output_ids) >= 1 and output_ids[-1] >= begin
        penultimate = len(output_ids) < 2 or output_ids[-2] >= begin
        if last:
            ranges.append((begin, VOCAB_END) if penultimate else (0, self.end))
        stamps = [t for t in output_ids if t >= begin]
        if stamps:  # not below the last one; equal only to close a pair
            ranges.append((begin, stamps[-1] if last and not penultimate else stamps[-1] + 1))
        if not output_ids:
            ranges.append((0, begin))
            if self.max_initial_timestamp_index is not None:
                ranges.append((begin + self.max_initial_timestamp_index + 1, VOCAB_END))
        return TokenMask(tuple(ranges), tuple(tokens),
                         begin if self.timestamp_from_probability else None)
