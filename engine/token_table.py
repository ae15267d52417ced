"""A tokenizer's token table read from the tokenizer itself: each token id's bytes as the
tokenizer decodes it in running text, for the structured-output compiler when it cannot read
the tokenizer's decoder from its definition (WordPiece, Unigram without byte fallback, custom
decoders).

A token is decoded after an anchor token (`decode([anchor, id])` less `decode([anchor])`), so
that a decoder that writes a space between words, or strips one at the start of the text,
gives the token's bytes as they appear mid-text. A SentencePiece byte token (`<0xHH>`) that
decodes to an incomplete character stands for its byte. Added tokens are special: their bytes
are marked as llguidance marks them (a 0xFF byte first), so that a grammar names them by id.
Pure Python (the tokenizer's own decode).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

SPECIAL_MARK = b"\xff"  # llguidance's prefix of a special token's bytes
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_REPLACEMENT = "\ufffd"


class TokenTableError(ValueError):
    """The tokenizer's tokens cannot be mapped to bytes; the message says why."""


@dataclass(frozen=True)
class TokenTable:
    """The bytes of every token id (`tokens[id]`; special tokens marked) and the ids of the
    special ones."""

    tokens: tuple[bytes, ...]
    special_ids: tuple[int, ...]

    def encoder(self, encode: Callable[[str], list[int]]) -> Callable[[str], list[int]]:
        """An encoding of text into ids whose bytes in this table spell it: `encode` (the
        tokenizer's) where its ids do (a decoder that writes spaces between words makes them
        differ), else the longest table entries from the left."""
        special = set(self.special_ids)
        by_bytes: dict[bytes, int] = {}
        for i, token in enumerate(self.tokens):
            if token and i not in special:
                by_bytes.setdefault(token, i)
        longest = max(map(len, by_bytes), default=0)

        def spell(text: str) -> list[int]:
            ids = encode(text)
            data = text.encode("utf-8")
            if b"".join(self.tokens[i] for i in ids if i < len(self.tokens)) == data:
                return ids
            out, at = [], 0
            while at < len(data):
                for n in range(min(longest, len(data) - at), 0, -1):
                    token = by_bytes.get(data[at:at + n])
                    if token is not None:
                        out.append(token)
                        at += n
                        break
                else:  # a byte no token spells: the tokenizer's own reading of the rest
                    return out + encode(data[at:].decode("utf-8", errors="replace"))
            return out

        return spell


def read_token_table(tokenizer, vocab_size: int) -> TokenTable:
    """The token table of a transformers tokenizer, `vocab_size` entries (ids the tokenizer
    does not know are empty). TokenTableError when no token decodes to text that the next
    token's text follows (the decoder does not write tokens in order)."""
    size = len(tokenizer)
    special = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if i < vocab_size}
    ordinary = [i for i in range(min(size, vocab_size)) if i not in special]
    if not ordinary:
        raise TokenTableError("it has no tokens besides its special ones")
    try:
        anchor, head = _anchor(tokenizer, ordinary)
        in_context = tokenizer.batch_decode([[anchor, i] for i in ordinary],
                                            skip_special_tokens=False)
        alone = tokenizer.batch_decode([[i] for i in ordinary], skip_special_tokens=False)
        pieces = tokenizer.convert_ids_to_tokens(ordinary)
    except TokenTableError:
        raise
    except Exception as e:  # noqa: BLE001 - a tokenizer that cannot decode its own ids
        raise TokenTableError(f"decoding its tokens failed ({type(e).__name__})") from None
    tokens = [b""] * vocab_size
    for i, text, single, piece in zip(ordinary, in_context, alone, pieces, strict=True):
        text = text[len(head):] if text.startswith(head) else single
        byte = _BYTE_TOKEN.fullmatch(piece or "")
        if byte is not None and (not text or text.endswith(_REPLACEMENT)):
            tokens[i] = bytes([int(byte.group(1), 16)])
        else:
            tokens[i] = text.encode("utf-8")
    for i, content in special.items():
        tokens[i] = SPECIAL_MARK + content.encode("utf-8")
    return TokenTable(tuple(tokens), tuple(sorted(special)))


def _anchor(tokenizer, ordinary: list[int]) -> tuple[int, str]:
    """A token that decodes to plain letters and that a following token's text extends:
    (its id, its text)."""
    for i in ordinary[:4096]:
        text = tokenizer.decode([i], skip_special_tokens=False)
        if text.isascii() and text.isalpha():
            pair = tokenizer.decode([i, i], skip_special_tokens=False)
            if pair.startswith(text) and len(pair) > len(text):
                return i, text
    raise TokenTableError("no token decodes to plain text that the next token's text follows")
