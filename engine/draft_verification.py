"""Which drafts a verification keeps, in a step's terms: the step's sampled rows (every row of a
verification: row i gives the token after its first i drafts; what each row's sampling sees:
the drafts before it count as the request's tokens for penalties, the grammar and the seed of
the draw), how many drafts chosen outright are kept, and speculative sampling's rule for drafts
drawn from a draft distribution. The model runner samples verified rows with it and the
drafters (engine/speculative/) propose what it verifies: it sits below both.

Drafts chosen outright (n-gram lookup, a greedy draft model) are kept while they equal the
token the target itself produces at their row: its argmax at temperature 0, its own draw above
(the draw a plain decode step would make there, with the same seed). That is speculative
sampling's rule for a draft distribution putting all its mass on the draft d: accept d with
probability min(1, p(d) / 1) = p(d), else draw from p without d renormalised; the event
"the target's draw is d" has probability p(d), and the draw given it is not d has that
distribution. Every kept token is therefore distributed exactly as plain decoding's, and a
seeded request gives the same tokens with speculation as without.

Drafts drawn from a draft distribution q (Leviathan et al., 2023; Chen et al., 2023): draft i
is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order, until one is rejected; the
token after the accepted ones is drawn from max(p_a - q_a, 0) renormalised where draft a was
rejected, from p_k when all k were accepted. Every token then has exactly the target's
distribution p (the verified rows' distributions, as plain sampling computes them: masks,
penalties, temperature, filters). A seeded request's draws here come from generators seeded
by its row's seed, so it gives the same tokens run after run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

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
    differs from the draft there, so accepted_count stops at it).
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
