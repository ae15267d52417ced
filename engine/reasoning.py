"""Reasoning: the thinking of models that think kept apart from the answer, as it streams.
Two forms: `<think>` ... `</think>` (Qwen3's and Qwen3.5's, and DeepSeek-R1's), and Gemma 4's
thought channel, `<|channel>thought\n` ... `<channel|>` (the model opens it itself when its
system turn holds `<|think|>`, i.e. with `enable_thinking`).

A chat template that renders `</think>` (or Gemma 4's `<channel|>`) marks a thinking model.
Whether a reply starts inside its thinking is read from the rendered prompt (Qwen3.5 and the
Qwen3 "thinking" checkpoints open `<think>` in the generation prompt; with `enable_thinking:
false` Qwen3 closes an empty block there instead, as Gemma 4's larger checkpoints close an empty
thought channel). The splitter then routes the generated text: before the end marker, to the
reasoning; after it, to the answer. A start marker the model writes itself opens the reasoning
only at the very start of the reply. The tail that may be the start of a marker is held back
until the next text settles it. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
# Gemma 4: the channel's markers are special tokens; "thought" names the channel.
CHANNEL_START, CHANNEL_END = "<|channel>thought\n", "<channel|>"


@dataclass(frozen=True)
class ThinkingFormat:
    """The markers of a thinking model's reasoning block."""

    start: str = START
    end: str = END

    @classmethod
    def of_template(cls, template: str | None) -> ThinkingFormat | None:
        """The format a chat template renders, or None for a model that does not think."""
        if not template:
            return None
        if END in template:
            return cls()
        if CHANNEL_END in template and "<|channel>" in template:
            return cls(CHANNEL_START, CHANNEL_END)
        return None

    def uses_any(self, tokens: set[str]) -> bool:
        """Whether a marker holds one of `tokens` (a tokenizer's special tokens: a reply must
        then be decoded with them for the splitter to see its markers)."""
        return any(t and (t in self.start or t in self.end) for t in tokens)

    def opened_by(self, prompt: str) -> bool:
        """Whether the rendered prompt leaves the reply inside a thinking block."""
        tail = prompt.rstrip()
        return tail.endswith(self.start)


class ReasoningSplitter:
    """Splits one reply's text, fed in pieces, into reasoning and answer."""

    def __init__(self, fmt: ThinkingFormat, in_reasoning: bool) -> None:
        self.fmt = fmt
        self.in_reasoning = in_reasoning
        self.at_start = True  # nothing but whitespace seen yet
        self._after_end = False  # newlines right after the end marker are dropped
        self.reasoning = ""
        self.content = ""
        self._pending = ""

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        """Add `text`; returns the (reasoning, answer) text settled by it (all of it once
        `finished`)."""
        buf = self._pending + text
        self._pending = ""
        reasoning, content = [], []
        while buf:
            if self.at_start and not self.in_reasoning:
                stripped = buf.lstrip()
                if not stripped:
                    if finished:
                        content.append(buf)
                        buf = ""
                    break
                if stripped.startswith(self.fmt.start):
                    self.in_reasoning, self.at_start = True, False
                    buf = stripped[len(self.fmt.start):]
                    continue
                if self.fmt.start.startswith(stripped) and not finished:
                    break  # may be the start of "<think>"
                self.at_start = False
            if not self.in_reasoning:
                if self._after_end:
                    buf = buf.lstrip("\n")
                    self._after_end = not buf
                content.append(buf)
                buf = ""
                break
            marker = self.fmt.end
            out = reasoning
            cut = buf.find(marker)
            if cut != -1:
                out.append(buf[:cut])
                buf = buf[cut + len(marker):]
                self.in_reasoning, self.at_start, self._after_end = False, False, True
                continue
            keep = 0 if finished else _partial_suffix(buf, marker)
            out.append(buf[: len(buf) - keep])
            buf = buf[len(buf) - keep:]
            break
        self._pending = buf
        r, c = "".join(reasoning), "".join(content)
        self.reasoning += r
        self.content += c
        return r, c


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
