"""Per-request token rules: which tokens a request may not sample next, decided on the host from
the tokens it has generated so far (Whisper's timestamp rules, models/whisper/rules.py), applied
to its row of logits by the sampler before anything else (so that the log-probabilities a
request gets back are those of the ruled distribution, as transformers' logits processors and
openai-whisper's logit filters return them).

A rule says, for the next token: token id ranges and single tokens ruled out (their logits set
to -inf), and optionally a threshold `force_from`: if the summed probability of the tokens at or
above it (after the exclusions) is larger than that of every single token below it, every token
below it is ruled out too (Whisper: a timestamp is due). That last comparison runs on the device,
with no host sync (engine/rule_batch.py). Plain Python: front ends import it without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# The end of an open range: past any vocabulary.
VOCAB_END = 2**40


@dataclass(frozen=True)
class TokenMask:
    """What one request may not sample next: [lo, hi) ranges and single tokens ruled out, and
    `force_from` (None: no such rule) as the module docstring says."""

    ranges: tuple[tuple[int, int], ...] = ()
    tokens: tuple[int, ...] = ()
    force_from: int | None = None


@runtime_checkable
class TokenRules(Protocol):
    """A request's rules (SamplingParams.token_rules): frozen, plain Python."""

    def mask(self, output_ids: Sequence[int]) -> TokenMask:
        """The exclusions for the token after `output_ids` (the request's generated tokens)."""
        ...
