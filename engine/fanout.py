"""n > 1: one request per completion, one prefill of the shared prompt. Pure Python.

A request asking for n completions becomes n child requests that share the processed prompt
(its token ids, media items and their encoder inputs). Only the first child is scheduled at
once; the others wait here until it has sampled its first token, by which time its prompt's
full KV blocks are in the prefix cache and its media embeddings in the encoder cache: each
sibling then starts with a prefix hit over every full block and recomputes at most the last
partial block (with prefix caching off, each prefills alone, still correct). Forking the first
child's blocks copy-on-write would save that partial block too, at the price of shared, partly
written blocks in the block manager; the prefix cache already owns sharing, so we reuse it.

Outputs are merged: every RequestOutput of the parent carries all n CompletionOutputs (their
text so far), with deltas only on the completion that advanced, and is finished once all are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request


@dataclass
class Family:
    """The children of one parent request, by completion index."""

    parent_id: str
    children: list[Request]
    pending: list[Request] = field(default_factory=list)  # not yet handed to the scheduler
    last: dict[int, CompletionOutput] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class FanOut:
    """Families of requests with n > 1, by parent id."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}

    def split(self, req: Request, clone: Callable[[Request, int], Request]) -> Request:
        """Turn `req` (n > 1) into its children; returns the first, to schedule now."""
        n = req.sampling_params.n
        children = [clone(req, i) for i in range(n)]
        self.families[req.request_id] = Family(req.request_id, children, children[1:])
        return children[0]

    def family(self, parent_id: str) -> Family | None:
        return self.families.get(parent_id)

    def ready(self, req: Request) -> list[Request]:
        """The siblings to schedule now that `req` sampled a token (its prompt is computed)."""
        family = self.families.get(req.parent_id) if req.parent_id else None
        if family is None or req.index != 0 or not family.pending:
            return []
        pending, family.pending = family.pending, []
        return pending

    def unstarted(self, req: Request) -> list[Request]:
        """Siblings that never started, when the first child ends before its first token:
        they share its fate (an error in the prompt's prefill, an abort)."""
        family = self.families.get(req.parent_id) if req.parent_id else None
        if family is None or req.index != 0:
            return []
        pending, family.pending = family.pending, []
        return pending

    def merge(self, req: Request, single: RequestOutput) -> RequestOutput:
        """The parent's output after `single`, the newest output of child `req`."""
        family = self.families[req.parent_id]
        family.last[req.index] = replace(single.outputs[0], index=req.index)
        outputs = []
        for child in family.children:
            last = family.last.get(child.index)
            if last is None:
                last = CompletionOutput(index=child.index, text="", token_ids=[])
            elif child is not req:
                last = replace(last, delta_text="", delta_token_ids=[],
                               delta_reasoning_content="")
            if child.finished and last.finish_reason is None:  # ended without running
                last = replace(last, finish_reason=child.status.value)
            outputs.append(last)
        finished = family.finished
        if finished:
            del self.families[req.parent_id]
        first = family.children[0]
        return replace(
            single, request_id=family.parent_id, outputs=outputs, finished=finished,
            error=next((c.error for c in family.children if c.error), None),
            num_cached_tokens=max(first.num_cached_tokens, 0),
        )
