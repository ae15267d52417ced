"""N-gram lookup (prompt lookup decoding): the continuation of an earlier occurrence of the
sequence's last tokens, looked up in the prompt and the output so far. No weights, any family;
strong where the answer copies (code edits, corrections, OCR, transcription, summaries).

Each request keeps an index from every n-gram (n = MIN_N .. MAX_N) to the positions after its
occurrences, extended as tokens arrive, so a lookup is a dictionary read per n, longest first.
Of the occurrences of the longest suffix found, the draft copies the one nearest the copy
position: where the previous draft's source would have reached by now (its position, plus the
tokens that arrived since), its exact continuation when the copy held; the latest before any
draft. Copying an answer that follows its source with edits, a common short suffix (a space, a
bracket, a line's indent) then resumes at the source's place rather than at its latest
occurrence elsewhere, and after an edit the copy picks up where it was. Media placeholder
positions are never indexed (an image's run of placeholder ids says nothing of the text after
it). Pure Python.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.request import Request
from engine.speculation_state import Proposal

MIN_N, MAX_N = 1, 4


@dataclass
class NgramIndex:
    """Where each n-gram of a sequence's indexed tokens ended, and where the last draft was
    copied from."""

    indexed: int = 0  # tokens [0, indexed) are indexed
    # n -> n-gram -> the positions after its occurrences, ascending
    after: list[dict[tuple[int, ...], list[int]]] = field(
        default_factory=lambda: [{} for _ in range(MAX_N + 1)])
    blocked: list[tuple[int, int]] = field(default_factory=list)  # [lo, hi) never indexed
    # (the position the last draft was copied from, the sequence's length then)
    source: tuple[int, int] | None = None

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index the n-grams ending before position `upto` (the sequence's last token is
        left out: an n-gram that ends there has no continuation yet)."""
        for end in range(self.indexed + 1, upto + 1):  # n-grams tokens[end - n : end]
            for n in range(MIN_N, MAX_N + 1):
                lo = end - n
                if lo < 0:
                    break
                if any(b_lo < end and b_hi > lo for b_lo, b_hi in self.blocked):
                    break
                self.after[n].setdefault(tuple(tokens[lo:end]), []).append(end)
        self.indexed = max(self.indexed, upto)

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to k tokens following the occurrence of the longest suffix found nearest the
        copy position (see the module docstring)."""
        expected = None
        if self.source is not None:
            expected = self.source[0] + len(tokens) - self.source[1]
        for n in range(min(MAX_N, len(tokens) - 1), MIN_N - 1, -1):
            ends = self.after[n].get(tuple(tokens[-n:]))
            if ends:
                end = ends[-1] if expected is None else _nearest(ends, expected)
                self.source = (end, len(tokens))
                return tuple(tokens[end : end + k])
        return ()


def _nearest(ends: list[int], position: int) -> int:
    """The element of ascending `ends` nearest `position` (the later one on a tie)."""
    i = bisect_left(ends, position)
    if i == len(ends):
        return ends[-1]
    if i == 0 or ends[i] - position <= position - ends[i - 1]:
        return ends[i]
    return ends[i - 1]


class NgramProposer:
    """Drafts by n-gram lookup, per request."""

    name = "ngram"
    cost_per_token = 0.0  # in plain decode steps: a dictionary read

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for req, k in zip(reqs, ks, strict=True):
            index = _index(req)
            tokens = req.all_token_ids
            index.extend(tokens, len(tokens) - 1)
            draft = index.lookup(tokens, k) if k else ()
            out.append(Proposal(draft) if draft else None)
        return out

    def forget(self, req: Request) -> None:
        """Nothing to free: the index lives with the request."""

    def observe(self, out: object, result: object) -> None:
        """Nothing to catch up on: the index extends itself at the next lookup."""


def _index(req: Request) -> NgramIndex:
    state = req.speculation
    if not isinstance(state.drafter, NgramIndex):
        state.drafter = NgramIndex(blocked=[(f.placeholder.offset, f.placeholder.end)
                                            for f in req.mm_features])
    return state.drafter
