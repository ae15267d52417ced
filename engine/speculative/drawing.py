"""How a model drafter turns its logits into draft tokens: at temperature 0 the argmax (the
draft is then verified against the target's argmax); above, a draw from the drafter's own
distribution at the request's temperature and filters, kept with the draft so that speculative
sampling's rule can verify it (engine/draft_verification.py). A seeded request's draws come
from generators seeded by (seed, completion, position): its drafts, and so its output, are the
same run after run."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request
from engine.sampler import SamplingBatch, sampling_probs
from engine.speculation_state import Proposal


def draw(logits: torch.Tensor, reqs: Sequence[Request], positions: Sequence[int],
         vocab_size: int) -> list[tuple[int, torch.Tensor | None]]:
    """logits [R, V] (one row per request, the draft's at the position before `positions[r]`)
    -> per row (draft token, the distribution it was drawn from or None for an argmax)."""
    out: list[tuple[int, torch.Tensor | None]] = [(0, None)] * len(reqs)
    greedy = [i for i, r in enumerate(reqs) if r.sampling_params.greedy]
    random = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
    if greedy:
        picked = logits[greedy, :vocab_size].argmax(dim=-1).tolist()
        for i, token in zip(greedy, picked, strict=True):
            out[i] = (token, None)
    if random:
        batch = SamplingBatch.from_requests([reqs[i] for i in random], vocab_size,
                                            logits.device)
        q = sampling_probs(logits[random, :vocab_size].float(), batch)
        for j, i in enumerate(random):
            seed = reqs[i].sampling_params.seed
            gen = None
            if seed is not None:
                key = hash((seed, reqs[i].index, positions[i], "draft")) & (2**63 - 1)
                gen = torch.Generator(device=q.device).manual_seed(key)
            out[i] = (int(torch.multinomial(q[j], 1, generator=gen)[0]), q[j])
    return out


def proposals(reqs: Sequence[Request], drafts: dict[str, list[int]],
              probs: dict[str, list[torch.Tensor]]) -> list[Proposal | None]:
    """Per request, its drafts (by request id) as a Proposal, with the distributions they were
    drawn from when drawn (None: no draft)."""
    out: list[Proposal | None] = []
    for req in reqs:
        tokens = drafts.get(req.request_id)
        q = probs.get(req.request_id)
        out.append(Proposal(tuple(tokens), torch.stack(q) if q else None) if tokens else None)
    return out
