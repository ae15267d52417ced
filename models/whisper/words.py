"""A window's text tokens grouped into words, as openai-whisper's `timing.py` and transformers'
Whisper tokenizer (`_combine_tokens_into_words`) group them:

- first into pieces that decode to whole characters (a multi-byte character split over tokens
  stays in one piece: a piece ends where its decoding holds no U+FFFD that the whole text does
  not also hold);
- in languages written without spaces (Chinese, Japanese, Thai, Lao, Burmese, Cantonese) each
  piece is a word; elsewhere a piece starting with a space, or that is punctuation, starts a new
  word and any other piece continues the word before it;
- then punctuation is merged into its neighbour: opening marks (`"'“¡¿([{-`, with their space)
  into the word after them, closing marks (`"'.。,，!！?？:：”)]}、`) into the word before them
  when that word does not end with a space.

Each word keeps the indices of its tokens (into the list given), from which its times are read
(models/whisper/timing.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

PREPENDED = "\"'“¡¿([{-"
APPENDED = "\"'.。,，!！?？:：”)]}、"
PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
UNSPACED = frozenset({"zh", "ja", "th", "lo", "my", "yue"})  # language codes
REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


@dataclass
class WordTokens:
    """A word's text (its leading space kept) and the indices of its tokens."""

    text: str
    indices: list[int]


def split_on_characters(tokens: Sequence[int], decode: Decode) -> list[WordTokens]:
    """Pieces of consecutive tokens that each decode to whole characters."""
    whole = decode(tokens)
    pieces: list[WordTokens] = []
    current: list[int] = []
    offset = 0
    for index in range(len(tokens)):
        current.append(index)
        text = decode([tokens[i] for i in current])
        bad = text.find(REPLACEMENT)
        if bad < 0 or offset + bad >= len(whole) or whole[offset + bad] == REPLACEMENT:
            pieces.append(WordTokens(text, current))
            current = []
            offset += len(text)
    return pieces


def split_on_spaces(tokens: Sequence[int], decode: Decode) -> list[WordTokens]:
    """Words: a piece that starts with a space or is punctuation starts one."""
    words: list[WordTokens] = []
    for piece in split_on_characters(tokens, decode):
        # `in` a string: "" and runs such as "()" count as punctuation, as in the references
        starts = piece.text.startswith(" ") or piece.text.strip() in PUNCTUATION
        if starts or not words:
            words.append(piece)
        else:
            words[-1].text += piece.text
            words[-1].indices += piece.indices
    return words


def merge_punctuations(words: list[WordTokens], prepended: str = PREPENDED,
                       appended: str = APPENDED) -> list[WordTokens]:
    """Opening marks joined to the word after them, closing marks to the word before them."""
    words = [WordTokens(w.text, list(w.indices)) for w in words]
    j = len(words) - 1
    for i in range(len(words) - 2, -1, -1):
        if words[i].text.startswith(" ") and words[i].text.strip() in prepended:
            words[j].text = words[i].text + words[j].text
            words[j].indices = words[i].indices + words[j].indices
            words[i] = WordTokens("", [])
        else:
            j = i
    i = 0
    for j in range(1, len(words)):
        if not words[i].text.endswith(" ") and words[j].text in appended:
            words[i].text += words[j].text
            words[i].indices += words[j].indices
            words[j] = WordTokens("", [])
        else:
            i = j
    return [w for w in words if w.text]


def group_words(tokens: Sequence[int], decode: Decode, language: str | None) -> list[WordTokens]:
    """Text tokens (no special or timestamp token) -> their words, for `language` (a code;
    None: English's rules)."""
    if language in UNSPACED:
        words = split_on_characters(tokens, decode)
    else:
        words = split_on_spaces(tokens, decode)
    return merge_punctuations(words)
