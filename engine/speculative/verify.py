"""The verify side of speculative decoding, in a step's terms: which rows of the step are
sampled (every row of a verification: row i gives the token after its first i drafts), what each
row's sampling sees (the drafts before it count as the request's tokens for penalties, the
grammar and the seed of the draw), and how many drafts are kept.

Drafts chosen outright (n-gram lookup, a greedy draft model) are kept while they equal the
token the target itself produces at their row: its argmax at temperature 0, its own draw above
(the draw a plain decode step would make there, with the same seed). That is speculative
sampling's rule for a draft distribution putting all its mass on the draft d: accept d with
probability min(1, p(d) / 1) = p(d), else draw from p without d renormalised; the event
"the target's draw is d" has probability p(d), and the draw given it is not d has that
distribution. Every kept token is therefore distributed exactly as plain decoding's, and a
seeded request gives the same tokens with speculation as without. Drafts sampled from a draft
distribution q are verified by the general rule (engine/speculative/rejection.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class SampleRows:
    """The step's sampled rows: `rows` of the flat batch, each row's request and the drafts
    before it, and per chunk its first sampled row's index (into `rows`) and their count."""

    rows: list[int] = field(default_factory=list)
    reqs: list[Request] = field(default_factory=list)
    ahead: list[tuple[int, ...]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)


def sample_rows(chunks: Sequence) -> SampleRows:
    """The rows a step samples (engine.scheduler.ScheduledChunk list): a verification's every
    row, a chunk reaching its request's end its last row."""
    out = SampleRows()
    offset = 0
    for c in chunks:
        offset += c.num_tokens
        if c.draft:
            first = offset - c.num_tokens
            out.spans.append((len(out.rows), c.num_tokens))
            for i in range(c.num_tokens):
                out.rows.append(first + i)
                out.reqs.append(c.req)
                out.ahead.append(c.draft[:i])
        elif c.samples:
            out.spans.append((len(out.rows), 1))
            out.rows.append(offset - 1)
            out.reqs.append(c.req)
            out.ahead.append(())
        else:
            out.spans.append((len(out.rows), 0))
    return out


def accepted_count(draft: Sequence[int], target: Sequence[int]) -> int:
    """How many drafts are kept: the leading ones equal to the target's token at their row
    (`target[i]`: the token row i produced, row i coming before draft i)."""
    n = 0
    while n < len(draft) and target[n] == draft[n]:
        n += 1
    return n
