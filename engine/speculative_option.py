"""The `speculative` engine option: which drafter proposes tokens, parsed once and checked.

"ngram" looks the last tokens up in the prompt and the output so far; "draft:PATH" runs a small
model of the same tokenizer (a checkpoint directory, a GGUF file or a Hub id) or, where PATH
holds one, Gemma 4's assistant drafter for its Gemma 4 target; "mtp" runs the target
checkpoint's own multi-token-prediction layer (Qwen3.5's `mtp.*` weights). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft", "mtp")
FORMS = "ngram, draft:PATH or mtp"
MAX_SPECULATIVE_TOKENS = 16  # the most drafts one step verifies per request


@dataclass(frozen=True)
class SpeculativeMethod:
    """A parsed `speculative` option: `name` one of METHODS, `path` the draft checkpoint."""

    name: str
    path: str | None = None

    @classmethod
    def parse(cls, text: str) -> SpeculativeMethod:
        """ValueError naming the accepted forms for anything else."""
        if not isinstance(text, str):
            raise ValueError(f"speculative must be one of {FORMS}, got {text!r}")
        name, sep, path = text.partition(":")
        if name == "draft" and sep and path.strip():
            return cls("draft", path.strip())
        if name in ("ngram", "mtp") and not sep:
            return cls(name)
        raise ValueError(f"speculative must be one of {FORMS}, got {text!r}")

    def __str__(self) -> str:
        return self.name if self.path is None else f"{self.name}:{self.path}"
