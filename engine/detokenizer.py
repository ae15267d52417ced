"""Incremental detokenization: new text per token, correct across multi-byte characters.

Byte-level BPE splits one character over several tokens, and SentencePiece-style tokenizers
decide a token's leading space from its neighbours, so a token cannot be decoded alone. We keep
two offsets into the output ids: text is decoded from `prefix` (a few tokens of context) and the
part already emitted for [prefix, read) is subtracted. A decode ending in U+FFFD is an
incomplete character: nothing is emitted until the next token completes it.

Stop strings: the text is cut where a stop string begins (the stop string is not part of the
output); while streaming, the last `len(longest stop) - 1` characters are held back, since they
may be the start of a stop string.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special_tokens
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""
        self.emitted = 0  # characters of `text` already streamed

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        self.ids.append(token_id)
        full = self._decode(self.ids[self.prefix :])
        if full.endswith("\ufffd"):
            return None
        before = self._decode(self.ids[self.prefix : self.read])
        new_text = full[len(before) :]
        self.prefix, self.read = max(len(self.ids) - _CONTEXT_TOKENS, 0), len(self.ids)
        if not new_text:
            return None
        start = max(len(self.text) - self.holdback, 0)
        self.text += new_text
        for stop in self.stop:
            cut = self.text.find(stop, start)
            if cut != -1:
                self.text = self.text[:cut]
                return stop
        return None

    def delta(self, finished: bool) -> str:
        """Text not yet streamed (all of it once finished; else all but the hold-back)."""
        end = len(self.text) if finished else max(len(self.text) - self.holdback, self.emitted)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    @property
    def streamed_text(self) -> str:
        return self.text[: self.emitted]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
