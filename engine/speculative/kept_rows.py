"""Which rows of a finished step a model drafter reads (the MTP layer, Gemma 4's assistant):
per request drafting with it, its chunk's first row among the step's hidden states and how many
of the chunk's rows were kept (a verification's last token and its accepted drafts; a prefill
or decode chunk's every row). Pure Python."""

from __future__ import annotations

from collections.abc import Iterator

from engine.scheduler import ScheduledChunk, SchedulerOutput


def kept_rows(out: SchedulerOutput, method: str) -> Iterator[tuple[ScheduledChunk, int, int]]:
    """(chunk, its first row in the step, rows kept) for each chunk of `out` whose request
    drafts with `method` and is not finished, in the step's order."""
    offset = 0
    for chunk in out.chunks:
        first = offset
        offset += chunk.num_tokens
        spec = chunk.req.speculation
        if spec is None or spec.method != method or chunk.req.finished:
            continue
        yield chunk, first, 1 + len(chunk.accepted) if chunk.draft else chunk.num_tokens
