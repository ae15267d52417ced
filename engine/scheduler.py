"""One token budget per step: decode tokens first, prefill chunks with the rest. Pure Python.

There are no separate prefill and decode phases. Each step walks three groups in order:
1. running requests that need one token (decode),
2. running requests part-way through their prompt (chunked prefill),
3. waiting requests, oldest first (admission, with prefix-cache hits: whole blocks, then a
   tail of the next block copied token by token, engine/block_manager.py),
each taking `min(remaining tokens, budget left)` tokens. When a running request cannot get the
KV blocks it needs, the newest running request is preempted (its blocks freed, its progress
reset; it is recomputed later) until the allocation fits. A waiting request never preempts.

Media items add a second budget (`_plan_encoder`): a chunk whose window overlaps an item's span
that is not in the encoder cache needs the item's encoder to run this step, within the per-step
encoder compute budget and the cache space; a chunk that cannot have it is cut to end just before
the span. Encoder-cache space is allocated only once the chunk's KV blocks are. A chunk never
ends inside a bidirectional span (its tokens attend to each other both ways, so the whole span
must be computed together): it ends before the span instead.

Hybrid models (linear-attention layers) also hold a state slot per running request and prefix
snapshots of that state (engine/state_cache.py): a waiting request's prefix hit is cut to the
longest prefix that has both its KV blocks and a snapshot, and each chunk carries its
`ChunkState` (slot, snapshot to restore, snapshots to save).

Speculative decoding: a decoding request with draft tokens (`Request.draft_token_ids`) is
scheduled their verification, its last token and as many drafts as fit (the token budget, the
tokens it may still produce, the KV blocks free without preempting anyone, and `verify_rows`:
the rows of a step's decodes and verifications together, so that they stay within what the
decode kernels take) in one chunk. After the step the request advances by its last token and
the accepted drafts only (`ScheduledChunk.accepted`, set by the engine); the blocks holding
rejected drafts go back, and only blocks of accepted tokens enter the prefix cache.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.encoder_cache import EncoderCacheManager
from engine.request import Request, RequestStatus
from engine.state_cache import StateCacheManager, save_points
from models.interfaces import ChunkState


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `req` starting at token `start`; `samples` if it reaches the end."""

    req: Request
    start: int
    num_tokens: int
    state: ChunkState | None = None  # hybrid models: what the chunk does with its state
    # Speculative decoding: draft tokens verified after the request's last token (counted in
    # num_tokens), and, once the step ran, those accepted (set by the engine).
    draft: tuple[int, ...] = ()
    accepted: tuple[int, ...] = ()
    # the distributions the drafts were drawn from ([k', V] on the model's device, opaque
    # here), or None: chosen outright (engine/speculation_state.py)
    draft_probs: object | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        return self.end - len(self.draft) == self.req.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The chunk's input tokens: the request's, then its drafts."""
        ids = self.req.all_token_ids[self.start : self.end - len(self.draft)]
        return ids + list(self.draft) if self.draft else ids


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
        return sum(r.mm_features[i].encoder_size for r, i in self.encoder_inputs)


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        encoder_cache: EncoderCacheManager,
        state_cache: StateCacheManager | None = None,
        verify_rows: int = 64,
    ) -> None:
        """`verify_rows`: the most rows a step's decodes and draft verifications take
        together (drafts are cut to fit)."""
        self.config = config
        self.blocks = block_manager
        self.encoder_cache = encoder_cache
        self.states = state_cache
        self.verify_rows = verify_rows
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

        rows_left = self.verify_rows - len(decoding)  # rows for drafts beside the decodes
        for i, req in enumerate(decoding + prefilling):
            budget = self.config.max_num_batched_tokens - out.num_tokens
            if budget == 0 or req.status is not RequestStatus.RUNNING:  # preempted this step
                continue
            start = req.num_computed_tokens
            draft = ()
            if i < len(decoding) and req.draft_token_ids:
                # the decodes after this one keep a token of the budget (and a block) each
                later = len(decoding) - i - 1
                draft = self._drafts(req, min(rows_left, budget - later - 1), later)
                rows_left -= len(draft)
            n, items = self._plan_encoder(req, start, len(draft) + _chunk_len(req, start, budget),
                                          out)
            if draft and n <= len(draft):  # cut before its drafts: verify none
                draft, n = (), min(n, 1)
            if n == 0:
                continue
            while not self.blocks.allocate(req, start + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                self._commit(req, n, items, out, draft)

        while self.waiting and len(self.running) < self.config.max_num_seqs:
            budget = self.config.max_num_batched_tokens - out.num_tokens
            if budget == 0:
                break
            req = self.waiting[0]
            hits = self.blocks.find_cached_prefix(req)
            kv_hits, snapshot = len(hits), None
            if self.states is not None:  # the hit needs the state too
                cut, snapshot = self.states.longest_hit(req.block_hashes, kv_hits)
                hits = hits[:cut]
            start = len(hits) * self.blocks.block_size
            # A recurrent state exists only where it was saved: no tail for hybrid models.
            tail = None if self.states is not None else self.blocks.find_tail(req, len(hits))
            if tail is not None:
                start += tail[1]
            n, items = self._plan_encoder(req, start, _chunk_len(req, start, budget), out)
            if n == 0 or not self.blocks.allocate(req, start + n, hits, tail):
                self.encoder_cache.release_request(req)  # undo this step's cache lookups
                break
            if self.states is not None:
                self._admit_state(req, kv_hits, snapshot, start)
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

    def _drafts(self, req: Request, room: int, reserve: int) -> tuple[int, ...]:
        """The drafts of a decoding request verified this step: at most `room` (rows and
        budget), fewer than the tokens it may still produce (a step yields the accepted drafts
        and one more), and only as many as the free KV blocks hold while `reserve` blocks stay
        free for the decodes after it (drafts never preempt anyone)."""
        draft = req.draft_token_ids
        n = max(0, min(len(draft), room, req.max_tokens - req.num_output_tokens - 1))
        start = req.num_computed_tokens
        while n and (self.blocks.blocks_needed(start + 1 + n) - len(req.block_ids)
                     > self.blocks.num_free_blocks - reserve):
            n -= 1
        return draft[:n]

    def _plan_encoder(
        self, req: Request, start: int, n: int, out: SchedulerOutput
    ) -> tuple[int, list[int]]:
        """Cut the window [start, start + n) so that every media item it needs can be encoded
        (an item is needed by its span's tokens, or by the rows that cross-attend to it).

        Returns the (possibly shorter) token count and the indices of the items whose encoder
        must run this step. Items already computed, already planned or in the cache cost nothing.
        A request preempted after its prompt was computed may have lost its entries to eviction
        meanwhile: it kept its encoder inputs, so they are simply encoded again.
        """
        budget = self.config.max_num_encoder_input_tokens - out.num_encoder_embeds
        items: list[int] = []
        planned = 0
        for idx, feature in enumerate(req.mm_features):  # sorted by offset
            first, until = feature.needed_from, feature.needed_until
            if first >= start + n:
                break  # spans, and the rows that cross-attend, start at the items' offsets
            if (until is not None and until <= start) or any(
                    req.mm_features[i].identifier == feature.identifier for i in items):
                continue
            if self.encoder_cache.lookup(req, feature.identifier):
                _note_cache_result(req, idx, hit=True)
                continue
            size = feature.encoder_size
            if not self.encoder_cache.can_allocate(size, budget - planned, planned):
                return max(first - start, 0), items
            items.append(idx)
            planned += size
        return n, items

    def _admit_state(self, req: Request, kv_hits: int, snapshot: int | None, start: int) -> None:
        """Give an admitted request its state slot, the snapshot its first chunk restores (the
        prefix hit) and the boundaries worth snapshotting, among them the end of a longer
        cached KV prefix that had no snapshot (where this prompt branches off another)."""
        points: set[int] = set()
        if self.states.num_snapshots:
            bs = self.blocks.block_size
            points = save_points(
                req.num_prompt_tokens, bs, message_starts=req.message_starts,
                media_ends=[f.placeholder.end for f in req.mm_features])
            if kv_hits * bs > start:
                points.add(kv_hits * bs)
            points = {p for p in points if p > start}
        held = self.states.admit(req.request_id, points)
        if snapshot is not None and start:
            self.states.restore(held, snapshot, start)

    def _commit(self, req: Request, n: int, items: list[int], out: SchedulerOutput,
                draft: tuple[int, ...] = ()) -> None:
        start, state = req.num_computed_tokens, None
        if self.states is not None:
            held = self.states.get(req.request_id)
            saves = self.states.plan_saves(held, start, start + n) if n > 1 and not draft else []
            state = ChunkState(held.slot, held.restore,
                               tuple((point - start, snapshot) for point, snapshot in saves))
        probs = req.speculation.proposal.probs if draft else None
        out.chunks.append(ScheduledChunk(req, start, n, state, draft, draft_probs=probs))
        for idx in items:
            feature = req.mm_features[idx]
            self.encoder_cache.allocate(req, feature.identifier, feature.encoder_size)
            _note_cache_result(req, idx, hit=False)
            out.encoder_inputs.append((req, idx))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Send a running request back to the front of the waiting queue, freeing its blocks.

        Encoder inputs it scheduled this step still run: another request may have hit them.
        """
        self.running.remove(req)
        self._release_saves([c for c in out.chunks if c.req is req])
        out.chunks = [c for c in out.chunks if c.req is not req]
        self.blocks.free_request(req)
        self.encoder_cache.release_request(req)
        if self.states is not None:
            self.states.release_request(req.request_id)
        req.release_grammar()
        req.drop_drafts()
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance every scheduled request by its chunk (a verification: by its last token and
        the accepted drafts) and register newly full blocks."""
        for chunk in out.chunks:
            req = chunk.req
            if chunk.draft:
                end = chunk.end - len(chunk.draft) + len(chunk.accepted)
                req.num_computed_tokens = end
                self.blocks.cache_computed_blocks(req, chunk.start, end, chunk.accepted)
                self.blocks.trim(req, end + 1)  # the rejected drafts' slots go back
            else:
                req.num_computed_tokens = chunk.end
                self.blocks.cache_computed_blocks(req, chunk.start, chunk.end)
            self.encoder_cache.release_consumed(req)
            if chunk.state is not None:
                self._commit_state(chunk)

    def _commit_state(self, chunk: ScheduledChunk) -> None:
        """The chunk ran: its restore is done, its snapshots are published under the hash of
        the block each one ends."""
        held = self.states.get(chunk.req.request_id)
        if chunk.state.restore is not None:
            self.states.restored(held)
        bs = self.blocks.block_size
        for offset, snapshot in chunk.state.saves:
            block = (chunk.start + offset) // bs - 1
            self.states.commit(snapshot, chunk.req.block_hashes[block])

    def abandon(self, out: SchedulerOutput) -> None:
        """The step did not run (its requests stay where they were): give back the snapshots
        it reserved, and keep their points for the chunks scheduled again."""
        self._release_saves(out.chunks)

    def _release_saves(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            if chunk.state is None:
                continue
            held = self.states.get(chunk.req.request_id)
            for offset, snapshot in chunk.state.saves:
                self.states.release(snapshot)
                if held is not None:
                    held.points.add(chunk.start + offset)

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
        if self.states is not None:
            self.states.release_request(req.request_id)
        req.release_grammar()
        req.drop_drafts()

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
        assert not any(r.grammar is not None and r.grammar.held for r in self.waiting), (
            "a waiting request holds a grammar matcher")
        self.blocks.check_integrity(live)
        self.encoder_cache.check_integrity(live)
        if self.states is not None:
            assert not any(self.states.get(r.request_id) for r in self.waiting), (
                "a waiting request holds a state slot")
            self.states.check_integrity(r.request_id for r in self.running)


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
