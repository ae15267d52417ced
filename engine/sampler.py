"""Token sampling for a batch: greedy, temperature, top-k, top-p, min-p, repetition penalty,
per-request seeds and log-probabilities, as tensor operations with no host sync.

The per-row options are gathered on the host into a `SamplingBatch` (tensors moved to the device
once); which operations run at all is decided from Python flags, never from tensor values.
Random rows are drawn with `torch.multinomial` (one uniform per row against the cumulative
distribution; an exponential race over the whole vocabulary measured 5.8 ms per token for
150k entries). A seeded row draws with a generator seeded by (seed, output position), so its
tokens do not depend on what else shares the batch, nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device import to_device
from engine.request import Request
from models.kernels import native


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int64, vocab size = off
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    penalty: torch.Tensor  # [S] float32
    history: torch.Tensor | None  # [S, L] int64 token ids seen, padded with vocab size
    seeds: list[int | None]  # per row: a generator seed for this step, or None
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    max_logprobs: int | None  # largest `logprobs` requested in the batch

    @classmethod
    def from_requests(
        cls, reqs: list[Request], vocab_size: int, device: torch.device
    ) -> SamplingBatch:
        params = [r.sampling_params for r in reqs]
        penalized = any(p.repetition_penalty != 1.0 for p in params)
        history = None
        if penalized:
            longest = max(r.num_tokens for r in reqs)
            rows = [r.all_token_ids + [vocab_size] * (longest - r.num_tokens) for r in reqs]
            history = to_device(torch.tensor(rows, dtype=torch.int64), device)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=to_device(torch.tensor([p.temperature for p in params]), device),
            top_k=to_device(torch.tensor([p.top_k or vocab_size for p in params]), device),
            top_p=to_device(torch.tensor([p.top_p for p in params]), device),
            min_p=to_device(torch.tensor([p.min_p for p in params]), device),
            penalty=to_device(torch.tensor([p.repetition_penalty for p in params]), device),
            history=history,
            seeds=[
                None if p.seed is None else hash((p.seed, r.num_output_tokens)) & (2**63 - 1)
                for p, r in zip(params, reqs, strict=True)
            ],
            all_greedy=all(p.greedy for p in params),
            use_top_k=any(0 < p.top_k < vocab_size and not p.greedy for p in params),
            use_top_p=any(p.top_p < 1.0 and not p.greedy for p in params),
            use_min_p=any(p.min_p > 0.0 and not p.greedy for p in params),
            max_logprobs=max(wanted) if wanted else None,
        )


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None = None  # [S] float32, log p of the sampled token
    top_ids: torch.Tensor | None = None  # [S, k] int64
    top_logprobs: torch.Tensor | None = None  # [S, k] float32


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits [S, V] float32 -> one token per row (and log-probabilities if asked)."""
    raw = logits
    if batch.history is not None:
        logits = _apply_repetition_penalty(logits, batch.history, batch.penalty)
    greedy = _argmax(logits)
    if batch.all_greedy:
        tokens = greedy
    else:
        tokens = torch.where(batch.temperature == 0, greedy, _sample_random(logits, batch))
    out = SamplerOutput(tokens=tokens)
    if batch.max_logprobs is not None:
        logp = raw.log_softmax(dim=-1)
        out.logprobs = logp.gather(-1, tokens[:, None]).squeeze(-1)
        if batch.max_logprobs > 0:
            out.top_logprobs, out.top_ids = logp.topk(batch.max_logprobs, dim=-1)
    return out


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1); on the CPU through our kernel where it builds (PyTorch's argmax
    does not vectorize: over a 150k vocabulary it is a visible part of a decode step)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        kernels = native.load()
        if kernels is not None:
            return kernels.argmax(logits)
    return logits.argmax(dim=-1)


def _apply_repetition_penalty(logits, history, penalty) -> torch.Tensor:
    """Divide positive (multiply negative) logits of every token already seen by the penalty."""
    rows, vocab = logits.shape
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, history, True)
    seen = seen[:, :vocab]
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    logits = logits / temperature[:, None]
    if batch.use_top_k or batch.use_top_p or batch.use_min_p:
        logits = _filter(logits, batch)
    probs = logits.softmax(dim=-1)
    tokens = torch.multinomial(probs, 1).squeeze(-1)  # [S]
    for row, seed in enumerate(batch.seeds):
        if seed is not None:
            gen = torch.Generator(device=probs.device).manual_seed(seed)
            tokens[row] = torch.multinomial(probs[row], 1, generator=gen)[0]
    return tokens


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask tokens outside top-k, outside the top-p nucleus, or below min_p * max prob."""
    ordered, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(ordered, dtype=torch.bool)
    if batch.use_top_k:
        rank = torch.arange(ordered.shape[-1], device=logits.device)
        drop |= rank[None, :] >= batch.top_k[:, None]
        ordered = ordered.masked_fill(drop, float("-inf"))
    probs = ordered.softmax(dim=-1)
    if batch.use_top_p:
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop |= before >= batch.top_p[:, None]
    if batch.use_min_p:
        drop |= probs < batch.min_p[:, None] * probs[:, :1]
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)

