"""Whisper's decoder prompt: `<|startoftranscript|>`, the language and the task (multilingual
checkpoints only), `<|notimestamps|>` unless timestamps are asked for, optionally preceded by
`<|startofprev|>` and earlier text (a long clip's previous window, or the user's prompt), as
transformers' WhisperForConditionalGeneration.generate writes it.

The special tokens' ids come from the checkpoint's generation_config.json where transformers
reads them (`decoder_start_token_id`, `no_timestamps_token_id`, `lang_to_id`, `task_to_id`,
`is_multilingual`, `prev_sot_token_id`, `suppress_tokens`, `begin_suppress_tokens`,
`max_initial_timestamp_index`, `alignment_heads`; a missing optional one is transformers'
default); timestamps start right after `<|notimestamps|>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from models.whisper.rules import WhisperRules

TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class WhisperTokens:
    """The special token ids a Whisper checkpoint's prompts and timestamps use."""

    start: int  # <|startoftranscript|>
    end: int  # <|endoftext|>
    no_timestamps: int
    multilingual: bool
    previous: int | None = None  # <|startofprev|>
    languages: Mapping[str, int] = field(default_factory=dict)  # "en" -> <|en|>'s id
    tasks: Mapping[str, int] = field(default_factory=dict)
    suppress: tuple[int, ...] = ()  # never sampled
    begin_suppress: tuple[int, ...] = ()  # not sampled first
    max_initial_timestamp_index: int | None = None  # None: the first timestamp is not bounded
    alignment_heads: tuple[tuple[int, int], ...] = ()  # (decoder layer, head) pairs

    def __post_init__(self) -> None:
        if self.multilingual and not (self.languages and set(TASKS) <= set(self.tasks)):
            raise ValueError("a multilingual Whisper generation config needs lang_to_id and "
                             "task_to_id (transcribe, translate)")

    @property
    def timestamp_begin(self) -> int:
        """<|0.00|>: timestamps follow <|notimestamps|>, 0.02 s apart."""
        return self.no_timestamps + 1

    def rules(self, timestamps: bool) -> WhisperRules:
        """The token rules of a decode with or without timestamps (models/whisper/rules.py)."""
        return WhisperRules(self.end, self.no_timestamps, self.suppress, self.begin_suppress,
                            timestamps, self.max_initial_timestamp_index)

    @classmethod
    def from_generation_config(cls, gen: Mapping[str, Any] | None) -> WhisperTokens:
        """From generation_config.json's fields (a CheckpointError-worthy ValueError names the
        missing one)."""
        if not gen:
            raise ValueError("Whisper needs its generation_config.json (the special tokens' ids)")
        missing = [k for k in ("decoder_start_token_id", "no_timestamps_token_id",
                               "eos_token_id") if gen.get(k) is None]
        if missing:
            raise ValueError(f"generation_config.json has no {', '.join(missing)}")
        eos = gen["eos_token_id"]
        langs = {k.strip("<|>"): int(v) for k, v in (gen.get("lang_to_id") or {}).items()}
        return cls(
            start=int(gen["decoder_start_token_id"]),
            end=int(eos[0] if isinstance(eos, list) else eos),
            no_timestamps=int(gen["no_timestamps_token_id"]),
            multilingual=bool(gen.get("is_multilingual", bool(langs))),
            previous=gen.get("prev_sot_token_id"),
            languages=langs, tasks=dict(gen.get("task_to_id") or {}),
            suppress=tuple(gen.get("suppress_tokens") or ()),
            begin_suppress=tuple(gen.get("begin_suppress_tokens") or ()),
            max_initial_timestamp_index=gen.get("max_initial_timestamp_index"),
            alignment_heads=tuple(tuple(p) for p in gen.get("alignment_heads") or ()))


def decoder_prompt(tokens: WhisperTokens, language: str | None = "en",
                   task: str = "transcribe", timestamps: bool = False,
                   previous: Sequence[int] = ()) -> list[int]:
    """The decoder prompt ids; `language` None on a multilingual model: leave the slot for
    language detection (the prompt then ends at <|startoftranscript|>); `previous`: text ids
    of the prompt or the previous window (after <|startofprev|>)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    ids: list[int] = []
    if previous:
        if tokens.previous is None:
            raise ValueError("this checkpoint names no <|startofprev|> token (prev_sot_token_id)")
        ids += [tokens.previous, *previous]
    ids.append(tokens.start)
    if tokens.multilingual:
        if language is None:
            return ids
        if language not in tokens.languages:
            raise ValueError(f"language {language!r} is not one of the model's "
                             f"({', '.join(sorted(tokens.languages))})")
        ids += [tokens.languages[language], tokens.tasks[task]]
    elif language not in (None, "en") or task != "transcribe":
        raise ValueError("this Whisper model is English-only: it transcribes English "
                         f"(language {language!r}, task {task!r} asked)")
    if not timestamps:
        ids.append(tokens.no_timestamps)
    return ids
