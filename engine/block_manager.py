"""Paged KV-cache block allocator with a prefix cache keyed by chained block hashes. Pure Python.

Every request owns a list of block ids (`Request.block_ids`); block i holds the KV of tokens
[i * block_size, (i + 1) * block_size). A full, computed block gets a hash chained from its
parent's: blake3(parent hash, token ids, extra keys), where the extra keys name the media items
overlapping the block as (content hash, item offset relative to the block start). Identical
placeholder token ids with different pixels therefore never share KV. The first block's chain
starts from the request's LoRA adapter (none: empty): requests computing with different
adapters never share KV either.

Blocks are reference counted. A block whose count drops to zero goes to the free queue but keeps
its hash, so a later request with the same prefix can adopt it (a prefix-cache hit); it is evicted
only when the queue hands it out for new tokens. The free queue's order is the eviction order:
unhashed blocks first, then cached ones in LRU order, tail blocks of a sequence before its head.

Token-granular tails: whole blocks are shared, but a prompt usually diverges from a cached one
inside a block (a second turn extends the first turn's prompt, whose last block was partly
filled; a full block ends in tokens the new prompt does not have). Each cached block is also
indexed under its parent's hash with its token ids, and so is the partly computed last block of
a request when it is freed (kept, unhashed, in LRU order like a cached block). After the whole
blocks a request hits, `find_tail` picks the indexed child of its last hit whose tokens share
the longest start with the request's next ones; `allocate` then copies those tokens' KV into
the request's own fresh block (through `copy_kv`, the runner's; never by sharing, since the
request writes the rest of that block). Media placeholder positions never match (their KV
depends on the pixels, which a token id does not name): a tail stops before the request's first
one. Off without `copy_kv`, and for models with per-request state (a recurrent state exists only
at the boundaries it was saved at).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable

from blake3 import blake3

from engine.request import Request

# A placeholder position's key in an indexed block: no token id equals it.
_MEDIA = -1
# Children of one parent compared per lookup, newest first (a shared system prompt can have many).
_MAX_TAIL_CANDIDATES = 64


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash", "parent", "keys")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        # Indexed for tails: the hash its tokens follow, and their ids (_MEDIA at placeholders).
        self.parent: bytes | None = None
        self.keys: tuple[int, ...] = ()


class BlockManager:
    """Allocates KV blocks to requests and shares full blocks through the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 copy_kv: Callable[[int, int, int], None] | None = None) -> None:
        """`copy_kv(src, dst, tokens)` copies the KV of the first `tokens` slots of block `src`
        into block `dst` (the runner's); without it, tails are not reused."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with ref_count == 0, in eviction order (front leaves first).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.copy_kv = copy_kv if enable_prefix_caching else None
        self.children: dict[bytes, dict[int, None]] = {}  # parent hash -> indexed blocks
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.tail_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix of `req` (a waiting request holding no blocks).

        At least one token is always left to compute, because its logits produce the next token.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        hits: list[int] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def find_tail(self, req: Request, full_blocks: int) -> tuple[int, int] | None:
        """(block id, tokens): the indexed block whose first tokens equal most of `req`'s after
        its `full_blocks` whole-block hits (at least one, never `req`'s last token nor a
        placeholder position), or None."""
        if self.copy_kv is None:
            return None
        bs = self.block_size
        lo = full_blocks * bs
        hi = min(lo + bs, req.num_tokens - 1)
        for feature in req.mm_features:
            ph = feature.placeholder
            if ph.offset < hi and ph.end > lo:
                hi = max(lo, ph.offset)
        if hi <= lo:
            return None
        self._extend_hashes(req, full_blocks)
        parent = req.block_hashes[full_blocks - 1] if full_blocks else _chain_root(req)
        candidates = self.children.get(parent)
        if not candidates:
            return None
        want = req.all_token_ids[lo:hi]
        best, best_len = None, 0
        for i, block_id in enumerate(reversed(candidates)):
            if i == _MAX_TAIL_CANDIDATES:
                break
            keys = self.blocks[block_id].keys
            n = 0
            for a, b in zip(keys, want, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block_id, n
        return None if best is None else (best, best_len)

    def note_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup in the hit-rate statistics."""
        self.prefix_queried_tokens += queried_tokens
        self.prefix_hit_tokens += hit_tokens

    def cache_computed_blocks(self, req: Request, start: int, end: int,
                              pending: tuple[int, ...] = ()) -> None:
        """Register the blocks that became full while tokens [start, end) were computed.
        `pending`: tokens after `req`'s that were computed too (accepted draft tokens the
        engine appends after this call)."""
        if not self.enable_prefix_caching:
            return
        first, last = start // self.block_size, end // self.block_size
        self._extend_hashes(req, last, pending)
        for i in range(first, last):
            block = self.blocks[req.block_ids[i]]
            block_hash = req.block_hashes[i]
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash = block_hash
                self.cached[block_hash] = block.block_id
                if self.copy_kv is not None:
                    parent = req.block_hashes[i - 1] if i else _chain_root(req)
                    self._index(block, parent, _keys(req, i * self.block_size,
                                                     (i + 1) * self.block_size, pending))

    def _extend_hashes(self, req: Request, num_blocks: int,
                       pending: tuple[int, ...] = ()) -> None:
        bs = self.block_size
        ids = req.all_token_ids
        if pending and len(req.block_hashes) < num_blocks:
            ids = ids + list(pending)
        for i in range(len(req.block_hashes), num_blocks):
            parent = req.block_hashes[i - 1] if i else _chain_root(req)
            tokens = array("q", ids[i * bs : (i + 1) * bs])
            h = blake3(parent)
            h.update(tokens.tobytes())
            for feature in req.mm_features:
                ph = feature.placeholder
                if ph.offset < (i + 1) * bs and ph.end > i * bs:
                    h.update(f"|{feature.identifier}@{ph.offset - i * bs}".encode())
            req.block_hashes.append(h.digest(length=16))

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, req: Request, num_tokens: int, cached: list[int] = (),
                 tail: tuple[int, int] | None = None) -> bool:
        """Make `req` hold enough blocks for its first `num_tokens` tokens.

        `cached` are prefix-cache hits adopted ahead of any new block, and `tail` (find_tail's)
        is copied into the first new block (only for a request holding no blocks yet). Returns
        False, changing nothing, when the free queue cannot cover it.
        """
        assert not (cached or tail) or not req.block_ids, "hits are adopted only at admission"
        num_new = self.blocks_needed(num_tokens) - len(req.block_ids) - len(cached)
        adopted_from_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        # The tail's block must survive this allocation: it may be free, next in line.
        source_free = tail is not None and self.blocks[tail[0]].ref_count == 0
        if num_new > len(self.free) - adopted_from_free - source_free:
            return False
        if source_free:
            self.free.move_to_end(tail[0])
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            req.block_ids.append(block_id)
        for _ in range(num_new):
            block_id, _ = self.free.popitem(last=False)
            self._evict(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            req.block_ids.append(block_id)
        if tail is not None:
            assert num_new > 0, "a tail is copied into a new block"
            self.copy_kv(tail[0], req.block_ids[len(cached)], tail[1])
            self.tail_hit_tokens += tail[1]
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back `req`'s blocks past those its first `num_tokens` tokens need (the slots of
        rejected draft tokens: never hashed, they go to the front of the free queue)."""
        keep = self.blocks_needed(num_tokens)
        while len(req.block_ids) > keep:
            block = self.blocks[req.block_ids.pop()]
            assert block.ref_count == 1 and block.block_hash is None, "a trimmed block is shared"
            block.ref_count = 0
            self.free[block.block_id] = None
            self.free.move_to_end(block.block_id, last=False)

    def _evict(self, block: KVBlock) -> None:
        """Forget what a block handed out for new tokens held (prefix cache, tail index)."""
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
        if block.parent is not None:
            siblings = self.children[block.parent]
            del siblings[block.block_id]
            if not siblings:
                del self.children[block.parent]
            block.parent, block.keys = None, ()

    def _index(self, block: KVBlock, parent: bytes, keys: tuple[int, ...]) -> None:
        block.parent, block.keys = parent, keys
        self.children.setdefault(parent, {})[block.block_id] = None

    def free_request(self, req: Request) -> None:
        """Drop `req`'s references; unreferenced hashed blocks stay cached until evicted, and so
        does a partly computed last block, indexed for tails."""
        self._index_tail(req)
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.block_hash is None and block.parent is None:
                    self.free.move_to_end(block_id, last=False)
        req.block_ids = []

    def _index_tail(self, req: Request) -> None:
        bs = self.block_size
        i, filled = divmod(req.num_computed_tokens, bs)
        if self.copy_kv is None or filled == 0 or i >= len(req.block_ids):
            return
        block = self.blocks[req.block_ids[i]]
        if block.ref_count != 1 or block.block_hash is not None or block.parent is not None:
            return
        self._extend_hashes(req, i)
        parent = req.block_hashes[i - 1] if i else _chain_root(req)
        self._index(block, parent, _keys(req, i * bs, i * bs + filled))

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (e.g. after weights change)."""
        for block_id in self.free:
            self._evict(self.blocks[block_id])

    # ---- checks and statistics ----------------------------------------------------------------

    def check_integrity(self, live: list[Request]) -> None:
        """Raise AssertionError if the counts disagree with the requests holding blocks."""
        held = [0] * self.num_blocks
        for req in live:
            assert len(set(req.block_ids)) == len(req.block_ids), f"{req.request_id} repeats"
            for block_id in req.block_ids:
                held[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == held[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, held {held[block.block_id]}"
            )
            in_free = block.block_id in self.free
            assert (block.ref_count == 0) == in_free, (
                f"block {block.block_id}: ref_count {block.ref_count}, in free queue: {in_free}"
            )
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) == block.block_id
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
        indexed = {b for siblings in self.children.values() for b in siblings}
        assert indexed == {b.block_id for b in self.blocks if b.parent is not None}
        for block_id in indexed:
            block = self.blocks[block_id]
            assert block_id in self.children[block.parent] and 0 < len(block.keys)

    def stats(self) -> dict[str, float]:
        q = self.prefix_queried_tokens
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_cached": len(self.cached),
            "prefix_cache_queried_tokens": q,
            "prefix_cache_hit_tokens": self.prefix_hit_tokens,
            "prefix_cache_hit_rate": self.prefix_hit_tokens / q if q else 0.0,
            "prefix_cache_tail_tokens": self.tail_hit_tokens,
        }


def _chain_root(req: Request) -> bytes:
    """What the first block's hash chains from: the request's adapter, if any."""
    return b"" if req.adapter is None else b"lora:" + req.adapter.encode()


def _keys(req: Request, lo: int, hi: int, pending: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Token ids [lo, hi) of `req` (then `pending`), _MEDIA at placeholder positions."""
    ids = req.all_token_ids if not pending else req.all_token_ids + list(pending)
    keys = list(ids[lo:hi])
    for feature in req.mm_features:
        ph = feature.placeholder
        for pos in range(max(lo, ph.offset), min(hi, ph.end)):
            keys[pos - lo] = _MEDIA
    return tuple(keys)
