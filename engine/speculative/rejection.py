"""Speculative sampling's rule (Leviathan et al., 2023; Chen et al., 2023) for drafts drawn from
a draft distribution q: draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in
order, until one is rejected; the token after the accepted ones is drawn from max(p_a - q_a, 0)
renormalised where draft a was rejected, from p_k when all k were accepted. Every token then
has exactly the target's distribution p (the verified rows' distributions, as plain sampling
computes them: masks, penalties, temperature, filters).

Drafts chosen outright (q a point mass) need none of this: verification keeps a draft while it
equals the target's own draw at its row (engine/speculative/verify.py), which is this rule for
that q. A seeded request's draws here come from generators seeded by its row's seed, so it
gives the same tokens run after run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def speculative_sample(p: torch.Tensor, q: torch.Tensor, draft: Sequence[int],
                       seed: int | None = None) -> tuple[int, int]:
    """p [k + 1, V] the target's distributions at a verification's rows, q [k, V] the draft's
    at its k drafts (draft i drawn from q[i]) -> (drafts accepted, the token after them)."""
    k = len(draft)
    gen = None if seed is None else torch.Generator(device=p.device).manual_seed(seed)
    index = torch.tensor(draft, dtype=torch.int64, device=p.device)[:, None]
    ratio = p[:k].gather(1, index)[:, 0] / q.gather(1, index)[:, 0]
    uniform = torch.rand(k, generator=gen, device=p.device)
    accepted = (uniform < ratio).tolist()
    a = accepted.index(False) if False in accepted else k
    if a == k:
        dist = p[k]
    else:
        dist = (p[a] - q[a]).clamp_min(0.0)
        if not dist.sum() > 0:  # p <= q everywhere (p == q up to rounding): p itself
            dist = p[a]
    return a, int(torch.multinomial(dist, 1, generator=gen)[0])


def resample_drafted(chunks: Sequence, sampled, result, batch) -> None:
    """Decide, in `result` (the step's SamplerOutput), the rows of every verification whose
    drafts were drawn from a draft distribution (its chunk's `draft_probs`), at temperature
    above 0: the accepted drafts in their rows, the token after them in the next (which then
    differs from the draft there, so engine.speculative.verify.accepted_count stops at it).
    `sampled`: the step's SampleRows; `batch`: its SamplingBatch (the rows' seeds)."""
    for c, (first, count) in zip(chunks, sampled.spans, strict=True):
        if c.draft_probs is None or c.req.sampling_params.greedy:
            continue
        k = len(c.draft)
        p = result.probs[first : first + count]
        a, token = speculative_sample(p, c.draft_probs[:k].to(p.device), c.draft,
                                      batch.seeds[first])
        for i in range(a):
            result.tokens[first + i] = c.draft[i]
        result.tokens[first + a] = token
        if result.logprobs is not None:
            for i in range(a + 1):
                row = first + i
                result.logprobs[row] = result.logp[row, result.tokens[row]]
