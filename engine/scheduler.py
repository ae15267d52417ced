"""One token budget per step: decode tokens first, prefill chunks with the rest. Pure Python.

There are no separate prefill and decode phases. Each step walks three groups in order:
1. running requests that need one token (decode),
2. running requests part-way through their prompt (chunked prefill),
3. waiting requests, oldest first (admission, with prefix-cache hits),
each taking `min(remaining tokens, budget left)` tokens. When a running request cannot get the
KV blocks it needs, the newest running request is preempted (its blocks freed, its progress
reset; it is recomputed later) until the allocation fits. A waiting request never preempts.

Media items add a second budget (`_plan_encoder`): a chunk whose window overlaps an item's span
that is not in the encoder cache needs the item's encoder to run this step, within the per-step
encoder compute budget and the cache space; a chunk that cannot have it is cut to end just before
the span. Encoder-cache space is allocated only once the chunk's KV blocks are. A chunk never
ends inside a bidirectional span (its tokens attend to each other both ways, so the whole span
must be computed together): it ends before the span instead.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.encoder_cache import EncoderCacheManager
from engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `req` starting at token `start`; `samples` if it reaches the end."""

    req: Request
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        return self.end == self.req.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # (request, feature index) whose encoder runs this step, in scheduling order.
    encoder_inputs: list[tuple[Request, int]] = field(default_factory=list)
    # Encoder-cache entries evicted this step: the runner drops their tensors.
    freed_encoder_hashes: list[str] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_encoder_embeds(self) -> int:
        return sum(r.mm_features[i].placeholder.num_embeds for r, i in self.encoder_inputs)


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        encoder_cache: EncoderCacheManager,
    ) -> None:
        self.config = config
        self.blocks = block_manager
        self.encoder_cache = encoder_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    # ---- the step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        decoding = [r for r in self.running if not r.is_prefill]
        prefilling = [r for r in self.running if r.is_prefill]

        for req in decoding + prefilling:
            budget = self.config.max_num_batched_tokens - out.num_tokens
            if budget == 0 or req.status is not RequestStatus.RUNNING:  # preempted this step
                continue
            start = req.num_computed_tokens
            n, items = self._plan_encoder(req, start, _chunk_len(req, start, budget), out)
            if n == 0:
                continue
            while not self.blocks.allocate(req, start + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                self._commit(req, n, items, out)

        while self.waiting and len(self.running) < self.config.max_num_seqs:
            budget = self.config.max_num_batched_tokens - out.num_tokens
            if budget == 0:
                break
            req = self.waiting[0]
            hits = self.blocks.find_cached_prefix(req)
            start = len(hits) * self.blocks.block_size
            n, items = self._plan_encoder(req, start, _chunk_len(req, start, budget), out)
            if n == 0 or not self.blocks.allocate(req, start + n, hits):
                self.encoder_cache.release_request(req)  # undo this step's cache lookups
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = start
            self.blocks.note_prefix_lookup(req.num_tokens, start)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = start
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            self._commit(req, n, items, out)

        out.freed_encoder_hashes = self.encoder_cache.drain_freed()
        return out

    def _plan_encoder(
        self, req: Request, start: int, n: int, out: SchedulerOutput
    ) -> tuple[int, list[int]]:
        """Cut the window [start, start + n) so that every media span it reaches can be encoded.

        Returns the (possibly shorter) token count and the indices of the items whose encoder
        must run this step. Items already computed, already planned or in the cache cost nothing.
        A request preempted after its prompt was computed may have lost its entries to eviction
        meanwhile: it kept its encoder inputs, so they are simply encoded again.
        """
        budget = self.config.max_num_encoder_input_tokens - out.num_encoder_embeds
        items: list[int] = []
        planned = 0
        for idx, feature in enumerate(req.mm_features):  # sorted by offset
            span = feature.placeholder
            if span.offset >= start + n:
                break
            if span.end <= start or any(req.mm_features[i].identifier == feature.identifier
                                        for i in items):
                continue
            if self.encoder_cache.lookup(req, feature.identifier):
                _note_cache_result(req, idx, hit=True)
                continue
            size = span.num_embeds
            if not self.encoder_cache.can_allocate(size, budget - planned, planned):
                return max(span.offset - start, 0), items
            items.append(idx)
            planned += size
        return n, items

    def _commit(self, req: Request, n: int, items: list[int], out: SchedulerOutput) -> None:
        out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
        for idx in items:
            feature = req.mm_features[idx]
            self.encoder_cache.allocate(req, feature.identifier, feature.placeholder.num_embeds)
            _note_cache_result(req, idx, hit=False)
            out.encoder_inputs.append((req, idx))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Send a running request back to the front of the waiting queue, freeing its blocks.

        Encoder inputs it scheduled this step still run: another request may have hit them.
        """
        self.running.remove(req)
        out.chunks = [c for c in out.chunks if c.req is not req]
        self.blocks.free_request(req)
        self.encoder_cache.release_request(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance every scheduled request by its chunk and register newly full blocks."""
        for chunk in out.chunks:
            req = chunk.req
            req.num_computed_tokens = chunk.end
            self.blocks.cache_computed_blocks(req, chunk.start, chunk.end)
            self.encoder_cache.release_consumed(req)

    # ---- finishing --------------------------------------------------------------------------

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark `req` finished and release its KV blocks and encoder-cache references."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.blocks.free_request(req)
        self.encoder_cache.release_request(req)

    def find(self, request_id: str) -> Request | None:
        for req in self.running:
            if req.request_id == request_id:
                return req
        for req in self.waiting:
            if req.request_id == request_id:
                return req
        return None

    def check_integrity(self) -> None:
        live = self.running + list(self.waiting)
        assert not any(r.block_ids for r in self.waiting), "a waiting request holds KV blocks"
        self.blocks.check_integrity(live)
        self.encoder_cache.check_integrity(live)


def _chunk_len(req: Request, start: int, budget: int) -> int:
    """Tokens from `start` within `budget`, cut so that no bidirectional span is split."""
    end = min(req.num_tokens, start + budget)
    for feature in req.mm_features:  # sorted by offset
        span = feature.placeholder
        if span.offset >= end:
            break
        if span.bidirectional and span.offset < end < span.end:
            return max(span.offset - start, 0)
    return end - start


def _note_cache_result(req: Request, idx: int, hit: bool) -> None:
    """Record, once per item, whether its embeddings came from the encoder cache."""
    feature = req.mm_features[idx]
    if feature.cache_hit is None:
        feature.cache_hit = hit
        if hit:
            req.metrics.encoder_cache_hits += 1
        else:
            req.metrics.encoder_cache_misses += 1
