"""A small draft model of the same tokenizer, run by the engine's own ModelRunner (its kernels,
plan and paged attention) with its own KV cache: as many blocks as the target's, indexed by the
target requests' block ids, so it needs no block manager of its own (the target's allocates,
frees and preempts for both; a block's draft keys and values are those of the same tokens).

Per request the drafter keeps a shadow Request (the target's tokens, its block ids) and how many
of its positions hold the draft's keys and values. A proposal first catches up on the tokens
the draft has not seen (the whole prompt at first, then the tokens the last step accepted: one
forward over every request), whose last row gives the first draft, then runs one decode step
per further draft. Drafts beyond the target's allocated blocks need their slots: the proposal
reserves them in the target's block manager (the verify step needs them anyway; what is
rejected is given back after it). At temperature 0 the draft is its argmax; above, a draw from
its own distribution at the request's temperature and filters, verified by speculative
sampling's rule (engine/draft_verification.py).

Loaded at start-up: the checkpoint's tokenizer must be the target's (every token string and
id the same, checked here, refused by name otherwise), and it must be a text-only decoder of
full or sliding-window attention (no media tower, no recurrent state, no cross-attention, one
row of positions).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.checkpoint_setup import CheckpointSetup
from engine.config import EngineConfig
from engine.hub import resolve_model
from engine.memory_plan import context_length
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.speculation_state import Proposal
from engine.speculative.drawing import draw

log = logging.getLogger(__name__)

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


class DraftModelError(ValueError):
    """A draft checkpoint that cannot draft for this target; the message says why."""


@dataclass
class DraftSequence:
    """One request's side of the draft model: a shadow request and the positions whose draft
    keys and values are computed (those of the request's own tokens)."""

    shadow: Request
    computed: int = 0


def check_tokenizer(target, draft, name: str) -> None:
    """DraftModelError unless `draft` maps every token string to the id `target` does."""
    want, got = target.get_vocab(), draft.get_vocab()
    if want == got:
        return
    missing = sorted(set(want) - set(got), key=want.get)
    extra = sorted(set(got) - set(want), key=got.get)
    moved = sorted((t for t in set(want) & set(got) if want[t] != got[t]), key=want.get)
    if moved:
        t = moved[0]
        detail = f"token {t!r} is id {got[t]} in the draft and {want[t]} in the target"
    elif missing:
        detail = f"the draft has no token {missing[0]!r} (target id {want[missing[0]]})"
    else:
        detail = f"the draft has token {extra[0]!r} (id {got[extra[0]]}) the target lacks"
    raise DraftModelError(
        f"draft model {name} does not share the target's tokenizer ({len(got)} against "
        f"{len(want)} tokens; {detail}): a draft model must have the target's vocabulary")


class DraftModelProposer:
    """Drafts with a small model of the target's tokenizer."""

    name = "draft"

    def __init__(self, runner: ModelRunner, blocks: BlockManager, budget: int,
                 max_model_len: int, cost_per_token: float, target_vocab: int) -> None:
        self.runner, self.blocks = runner, blocks
        self.budget = budget  # tokens per catch-up forward
        self.max_model_len = max_model_len
        self.embedding_rows = runner.embedding_rows
        self.vocab_size = min(runner.vocab_size, target_vocab)
        self.cost_per_token = cost_per_token
        self.seqs: dict[str, DraftSequence] = {}

    @classmethod
    def load(cls, source: str, target: ModelRunner, config: EngineConfig, tokenizer,
             blocks: BlockManager) -> DraftModelProposer:
        """The draft checkpoint at `source` (a directory, a GGUF file or a Hub id), checked
        against the target and loaded in the target's device and dtype, with the target's
        quantization options."""
        path = resolve_model(source)
        setup = CheckpointSetup.load(path)
        check_tokenizer(tokenizer, setup.tokenizer, source)
        if setup.spec.processor is not None:
            raise DraftModelError(f"draft model {source} ({setup.architecture}) takes media: "
                                  "a draft model is a text-only decoder")
        max_len = min(target.layout.max_model_len, context_length(setup.hf_config)[0])
        draft_config = EngineConfig(
            block_size=config.block_size, max_model_len=max_len, max_num_seqs=1,
            enable_prefix_caching=False, quantization=config.quantization,
            quantization_group_size=config.quantization_group_size,
            dequantize_gguf=config.dequantize_gguf,
            gguf_activation_digits=config.gguf_activation_digits,
            # its cache holds the target's block count: quantized as the target's is
            kv_cache_dtype=config.kv_cache_dtype)
        runner = ModelRunner(path, setup.hf_config, setup.spec.model, draft_config, target.device,
                             target.dtype)
        refused = ("linear-attention layers (a recurrent state)" if runner.state_layout else
                   "cross-attention layers" if runner.cross_layout else
                   "multi-row positions" if runner.position_rows != 1 else None)
        if refused:
            raise DraftModelError(f"draft model {source} ({setup.architecture}) has {refused}; "
                                  "a draft model is a plain text decoder")
        runner.resize_kv_cache(target.layout.num_blocks)
        # Drafting a token costs about the draft's weights against the target's, per step.
        cost = runner.weight_bytes() / max(target.weight_bytes(), 1)
        log.info("draft model %s (%s) loaded: %.0f%% of the target's weight bytes, KV cache of "
                 "%d blocks", source, setup.architecture, 100 * cost, runner.layout.num_blocks)
        return cls(runner, blocks, config.max_num_batched_tokens, max_len, cost,
                   target.vocab_size)

    # ---- proposing --------------------------------------------------------------------------

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal | None]:
        ks = [self._room(req, k) for req, k in zip(reqs, ks, strict=True)]
        active = [(req, k) for req, k in zip(reqs, ks, strict=True) if k]
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _ in active}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _ in active}
        if active:
            self._catch_up([req for req, _ in active], drafts, probs)
            longest = max(k for _, k in active)
            for step in range(1, longest):
                going = [req for req, k in active if k > step]
                self._decode(going, drafts, probs)
        out: list[Proposal | None] = []
        for req, k in zip(reqs, ks, strict=True):
            if not k:
                out.append(None)
                continue
            seq = self.seqs[req.request_id]
            del seq.shadow.all_token_ids[req.num_tokens:]  # the drafts leave the shadow
            tokens = tuple(drafts[req.request_id])
            q = probs[req.request_id]
            out.append(Proposal(tokens, torch.stack(q) if q else None))
        return out

    def _room(self, req: Request, k: int) -> int:
        """How many drafts `req` can have: within the draft's context, and with slots for
        their keys and values in the target's blocks (reserved now, leaving a block free per
        running request for the decodes that need one)."""
        k = min(k, self.max_model_len - req.num_tokens)
        while k > 0:
            need = self.blocks.blocks_needed(req.num_tokens + k - 1) - len(req.block_ids)
            if need <= 0 or (need <= self.blocks.num_free_blocks - 1
                             and self.blocks.allocate(req, req.num_tokens + k - 1)):
                return k
            k -= 1
        return 0

    def _seq(self, req: Request) -> DraftSequence:
        seq = self.seqs.get(req.request_id)
        if seq is None:
            shadow = Request(f"draft:{req.request_id}", [], GREEDY, frozenset(), 1)
            seq = self.seqs[req.request_id] = DraftSequence(shadow)
        seq.shadow.all_token_ids = [t if t < self.embedding_rows else 0
                                    for t in req.all_token_ids]
        seq.shadow.block_ids = req.block_ids
        return seq

    def _catch_up(self, reqs: list[Request], drafts, probs) -> None:
        """Run each request's unseen tokens through the draft (budget-sized forwards); the
        last row of each gives its first draft."""
        pending = [(req, self._seq(req)) for req in reqs]
        for _, seq in pending:
            seq.computed = min(seq.computed, len(seq.shadow.all_token_ids) - 1)
        while pending:
            chunks, budget = [], self.budget
            for req, seq in pending:
                n = min(len(seq.shadow.all_token_ids) - seq.computed, budget)
                if n > 0:
                    budget -= n
                    chunks.append((req, seq, n))
            self._run([(req, seq, seq.computed, n) for req, seq, n in chunks], drafts, probs)
            pending = [(req, seq) for req, seq in pending
                       if seq.computed < len(seq.shadow.all_token_ids)]

    def _decode(self, reqs: list[Request], drafts, probs) -> None:
        """One decode step of the draft for each request: its last draft in, the next out."""
        items = []
        for req in reqs:
            seq = self.seqs[req.request_id]
            seq.shadow.all_token_ids.append(drafts[req.request_id][-1])
            items.append((req, seq, len(seq.shadow.all_token_ids) - 1, 1))
        self._run(items, drafts, probs)

    def _run(self, items, drafts, probs) -> None:
        """One forward of the draft runner over (request, sequence, start, tokens) chunks; a
        chunk reaching its shadow's end gives that request its next draft."""
        out = SchedulerOutput([ScheduledChunk(seq.shadow, start, n) for _, seq, start, n in items])
        result = self.runner.execute(out, keep_logits=True)
        for (_, seq, start, n) in items:
            seq.computed = start + n
        sampling = [(req, seq) for (req, seq, start, n) in items
                    if start + n == len(seq.shadow.all_token_ids)]
        picked = draw(result.logits, [req for req, _ in sampling],
                      [len(seq.shadow.all_token_ids) for _, seq in sampling], self.vocab_size)
        for (req, _), (token, q) in zip(sampling, picked, strict=True):
            drafts[req.request_id].append(token)
            if q is not None:
                probs[req.request_id].append(q)

    # ---- bookkeeping ------------------------------------------------------------------------

    def observe(self, out: SchedulerOutput, result) -> None:
        """After a step: each request's draft positions stay valid only up to the tokens the
        step kept (a verification: its last token and the accepted drafts; the draft's keys
        and values past them were of rejected drafts)."""
        for chunk in out.chunks:
            seq = self.seqs.get(chunk.req.request_id)
            if seq is None:
                continue
            kept = chunk.start + 1 + len(chunk.accepted) if chunk.draft else chunk.end
            seq.computed = min(seq.computed, kept)

    def forget(self, req: Request) -> None:
        self.seqs.pop(req.request_id, None)
