"""Token sampling for a batch: greedy, temperature, top-k, top-p, min-p, repetition, presence
and frequency penalties, logit bias, grammar masks (structured output), per-request seeds and
log-probabilities, as tensor operations with no host sync.

Token rules (SamplingParams.token_rules, models/token_rules.py) come first of all, then the
grammar masks: both are part of the distribution the returned log-probabilities describe.

The per-row options are gathered on the host into a `SamplingBatch` (tensors moved to the device
once); which operations run at all is decided from Python flags, never from tensor values.
Random rows are drawn with `torch.multinomial` (one uniform per row against the cumulative
distribution; an exponential race over the whole vocabulary measured 5.8 ms per token for
150k entries). A seeded row draws with a generator seeded by (seed, output position), so its
tokens do not depend on what else shares the batch, nor on preemption (completion i > 0 of a
request with n > 1 by (seed, i, output position)).

Grammar masks are filled on the host from each constrained request's matcher (engine.grammar)
while the device runs the forward, moved once, and applied to the constrained rows only: an
unconstrained row, or a batch without constraints, costs nothing. The mask comes first, so
that the log-probabilities returned are those of the constrained distribution (as vLLM's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device import to_device
from engine.request import Request
from engine.rule_batch import RuleBatch
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
    # Presence / frequency penalties: [S] float32 each and [S, L] output ids padded with V.
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    outputs: torch.Tensor | None = None
    # logit_bias as (rows [B], token ids [B], biases [B]).
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Grammar masks: [R, W] int32 for the constrained rows [R] int64.
    bitmask: torch.Tensor | None = None
    mask_rows: torch.Tensor | None = None
    rules: RuleBatch | None = None  # the rows with token rules
    all_greedy: bool = True
    use_top_k: bool = False
    use_top_p: bool = False
    use_min_p: bool = False
    max_logprobs: int | None = None  # largest `logprobs` requested in the batch
    keep_probs: bool = False  # return the distribution random rows were drawn from

    @classmethod
    def from_requests(
        cls, reqs: list[Request], vocab_size: int, device: torch.device,
        drafts: list[tuple[int, ...]] | None = None,
    ) -> SamplingBatch:
        """One row per entry of `reqs` (a request may have several rows). `drafts`: per row,
        the draft tokens that precede it after the request's own (speculative decoding: row i
        of a verification samples the token after its first i drafts, so its penalties,
        grammar mask and seed are those of a request that had them)."""
        params = [r.sampling_params for r in reqs]
        drafts = drafts or [()] * len(reqs)
        penalized = any(p.repetition_penalty != 1.0 for p in params)
        history = None
        if penalized:
            seen = [r.all_token_ids + list(d) for r, d in zip(reqs, drafts, strict=True)]
            longest = max(len(h) for h in seen)
            rows = [h + [vocab_size] * (longest - len(h)) for h in seen]
            history = to_device(torch.tensor(rows, dtype=torch.int64), device)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        batch = cls(
            temperature=to_device(torch.tensor([p.temperature for p in params]), device),
            top_k=to_device(torch.tensor([p.top_k or vocab_size for p in params]), device),
            top_p=to_device(torch.tensor([p.top_p for p in params]), device),
            min_p=to_device(torch.tensor([p.min_p for p in params]), device),
            penalty=to_device(torch.tensor([p.repetition_penalty for p in params]), device),
            history=history,
            seeds=[_step_seed(p.seed, r, len(d))
                   for p, r, d in zip(params, reqs, drafts, strict=True)],
            all_greedy=all(p.greedy for p in params),
            use_top_k=any(0 < p.top_k < vocab_size and not p.greedy for p in params),
            use_top_p=any(p.top_p < 1.0 and not p.greedy for p in params),
            use_min_p=any(p.min_p > 0.0 and not p.greedy for p in params),
            max_logprobs=max(wanted) if wanted else None,
        )
        batch._add_penalties(reqs, drafts, vocab_size, device)
        batch._add_bias(reqs, vocab_size, device)
        batch._add_masks(reqs, drafts, device)
        batch._add_rules(reqs, drafts, device)
        return batch

    def _add_rules(self, reqs: list[Request], drafts: list[tuple[int, ...]], device) -> None:
        masks = [(row, r.sampling_params.token_rules.mask(r.output_token_ids + list(d)))
                 for row, (r, d) in enumerate(zip(reqs, drafts, strict=True))
                 if r.sampling_params.token_rules is not None]
        if masks:
            self.rules = RuleBatch.build(masks, device)

    def _add_penalties(self, reqs: list[Request], drafts: list[tuple[int, ...]],
                       vocab_size: int, device) -> None:
        params = [r.sampling_params for r in reqs]
        if not any(p.penalized for p in params):
            return
        outs = [r.output_token_ids + list(d) for r, d in zip(reqs, drafts, strict=True)]
        longest = max(len(o) for o in outs)
        rows = [o + [vocab_size] * (longest - len(o)) for o in outs]
        self.outputs = to_device(torch.tensor(rows, dtype=torch.int64).view(len(reqs), -1),
                                 device)
        self.presence = to_device(torch.tensor([p.presence_penalty for p in params]), device)
        self.frequency = to_device(torch.tensor([p.frequency_penalty for p in params]), device)

    def _add_bias(self, reqs: list[Request], vocab_size: int, device) -> None:
        entries = [(row, token, value) for row, r in enumerate(reqs)
                   for token, value in r.sampling_params.logit_bias if token < vocab_size]
        if entries:
            rows, tokens, values = zip(*entries, strict=True)
            self.bias = (to_device(torch.tensor(rows, dtype=torch.int64), device),
                         to_device(torch.tensor(tokens, dtype=torch.int64), device),
                         to_device(torch.tensor(values, dtype=torch.float32), device))

    def _add_masks(self, reqs: list[Request], drafts: list[tuple[int, ...]], device) -> None:
        constrained = [(row, r) for row, r in enumerate(reqs) if r.grammar is not None]
        if not constrained:
            return
        words = constrained[0][1].grammar.grammar.mask_words
        bitmask = torch.empty((len(constrained), words), dtype=torch.int32)
        for i, (row, r) in enumerate(constrained):
            r.grammar.fill(bitmask[i], r.output_token_ids, drafts[row])
        self.bitmask = to_device(bitmask, device)
        self.mask_rows = to_device(
            torch.tensor([row for row, _ in constrained], dtype=torch.int64), device)


def _step_seed(seed: int | None, req: Request, ahead: int = 0) -> int | None:
    """The seed of the draw for `req`'s output token `ahead` tokens after its current ones."""
    if seed is None:
        return None
    position = req.num_output_tokens + ahead
    key = (seed, position) if req.index == 0 else (seed, req.index, position)
    return hash(key) & (2**63 - 1)


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None = None  # [S] float32, log p of the sampled token
    # [S, V] float32: the distribution each random row was drawn from (batch.keep_probs; a
    # greedy row's is meaningless)
    probs: torch.Tensor | None = None
    logp: torch.Tensor | None = None  # [S, V] log_softmax of the raw logits (keep_probs)
    top_ids: torch.Tensor | None = None  # [S, k] int64
    top_logprobs: torch.Tensor | None = None  # [S, k] float32


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits [S, V] float32 -> one token per row (and log-probabilities if asked)."""
    if batch.rules is not None:
        batch.rules.apply(logits)
    if batch.bitmask is not None:
        apply_bitmask(logits, batch.bitmask, batch.mask_rows)
    raw = logits
    if batch.history is not None:
        logits = _apply_repetition_penalty(logits, batch.history, batch.penalty)
    if batch.outputs is not None:
        logits = _apply_occurrence_penalties(logits, batch)
    if batch.bias is not None:
        rows, tokens, values = batch.bias
        logits = logits.index_put((rows, tokens), values, accumulate=True)
    greedy = _argmax(logits)
    probs = None
    if batch.all_greedy:
        tokens = greedy
    else:
        drawn, probs = _sample_random(logits, batch)
        tokens = torch.where(batch.temperature == 0, greedy, drawn)
    out = SamplerOutput(tokens=tokens, probs=probs if batch.keep_probs else None)
    if batch.max_logprobs is not None:
        logp = raw.log_softmax(dim=-1)
        out.logprobs = logp.gather(-1, tokens[:, None]).squeeze(-1)
        if batch.keep_probs:
            out.logp = logp
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


def _apply_occurrence_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over the tokens generated so far."""
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, batch.outputs, torch.ones_like(batch.outputs, dtype=logits.dtype))
    counts = counts[:, :vocab]
    return (logits - batch.frequency[:, None] * counts
            - batch.presence[:, None] * (counts > 0).to(logits.dtype))


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution random rows draw from: logits [S, V] (masked, penalised, biased) at
    each row's temperature, filtered by its top-k / top-p / min-p, softmaxed."""
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    logits = logits / temperature[:, None]
    if batch.use_top_k or batch.use_top_p or batch.use_min_p:
        logits = _filter(logits, batch)
    return logits.softmax(dim=-1)


def _sample_random(logits: torch.Tensor,
                   batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(a token [S] drawn per row, the distribution [S, V] it was drawn from)."""
    probs = sampling_probs(logits, batch)
    tokens = torch.multinomial(probs, 1).squeeze(-1)  # [S]
    for row, seed in enumerate(batch.seeds):
        if seed is not None:
            gen = torch.Generator(device=probs.device).manual_seed(seed)
            tokens[row] = torch.multinomial(probs[row], 1, generator=gen)[0]
    return tokens, probs


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




_BIT_BIAS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Rule out, in place, the tokens a grammar forbids: in each row `rows[i]` of logits [S, V],
    every token whose bit is 0 in `bitmask[i]` ([R, W] int32; bit b of word w is token
    32 * w + b) becomes -inf (so do tokens past the mask's 32 * W). Rows not named are not
    touched.

    Branch-free: each mask byte looks up its eight tokens' bounds (+inf allowed, -inf not) and
    the logits are clamped by them; a masked_fill or where over a scattered mask branches per
    token and measured several times slower on the CPU."""
    vocab = logits.shape[-1]
    table = _BIT_BIAS.get(logits.device)
    if table is None:  # [256, 8]: bit k of byte value v -> +inf if set, else -inf
        # Made on the device itself: a host-to-device copy would synchronize.
        byte = torch.arange(256, device=logits.device)
        bits = (byte[:, None] >> torch.arange(8, device=logits.device)) & 1
        table = (bits.to(torch.float32) - 0.5).mul(float("inf"))
        _BIT_BIAS[logits.device] = table
    # int32 words are little-endian on every device torch runs on: byte k of word w holds
    # tokens 32 * w + 8 * k ... + 7.
    index = bitmask.view(torch.uint8).view(-1).long()
    bound = table.index_select(0, index).view(bitmask.shape[0], -1)  # [R, 32W]
    if bound.shape[1] < vocab:
        bound = torch.nn.functional.pad(bound, (0, vocab - bound.shape[1]), value=-float("inf"))
    sub = logits.index_select(0, rows)
    torch.minimum(sub, bound[:, :vocab].to(sub.dtype), out=sub)
    logits.index_copy_(0, rows, sub)
