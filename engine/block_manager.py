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
unhashed blocks first, then hashed ones in LRU order, tail blocks of a sequence before its head.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from blake3 import blake3

from engine.request import Request


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


class BlockManager:
    """Allocates KV blocks to requests and shares full blocks through the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with ref_count == 0, in eviction order (front leaves first).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

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

    def note_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup in the hit-rate statistics."""
        self.prefix_queried_tokens += queried_tokens
        self.prefix_hit_tokens += hit_tokens

    def cache_computed_blocks(self, req: Request, start: int, end: int) -> None:
        """Register the blocks that became full while tokens [start, end) were computed."""
        if not self.enable_prefix_caching:
            return
        first, last = start // self.block_size, end // self.block_size
        self._extend_hashes(req, last)
        for i in range(first, last):
            block = self.blocks[req.block_ids[i]]
            block_hash = req.block_hashes[i]
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash = block_hash
                self.cached[block_hash] = block.block_id

    def _extend_hashes(self, req: Request, num_blocks: int) -> None:
        bs = self.block_size
        for i in range(len(req.block_hashes), num_blocks):
            parent = req.block_hashes[i - 1] if i else _chain_root(req)
            tokens = array("q", req.all_token_ids[i * bs : (i + 1) * bs])
            h = blake3(parent)
            h.update(tokens.tobytes())
            for feature in req.mm_features:
                ph = feature.placeholder
                if ph.offset < (i + 1) * bs and ph.end > i * bs:
                    h.update(f"|{feature.identifier}@{ph.offset - i * bs}".encode())
            req.block_hashes.append(h.digest(length=16))

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, req: Request, num_tokens: int, cached: list[int] = ()) -> bool:
        """Make `req` hold enough blocks for its first `num_tokens` tokens.

        `cached` are prefix-cache hits adopted ahead of any new block (only for a request holding
        no blocks yet). Returns False, changing nothing, when the free queue cannot cover it.
        """
        assert not cached or not req.block_ids, "cached blocks are adopted only at admission"
        num_new = self.blocks_needed(num_tokens) - len(req.block_ids) - len(cached)
        adopted_from_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if num_new > len(self.free) - adopted_from_free:
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            req.block_ids.append(block_id)
        for _ in range(num_new):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict from the prefix cache
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            req.block_ids.append(block_id)
        return True

    def free_request(self, req: Request) -> None:
        """Drop `req`'s references; unreferenced hashed blocks stay cached until evicted."""
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.block_hash is None:
                    self.free.move_to_end(block_id, last=False)
        req.block_ids = []

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (e.g. after weights change)."""
        for block_id in self.free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None

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

    def stats(self) -> dict[str, float]:
        q = self.prefix_queried_tokens
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_cached": len(self.cached),
            "prefix_cache_queried_tokens": q,
            "prefix_cache_hit_tokens": self.prefix_hit_tokens,
            "prefix_cache_hit_rate": self.prefix_hit_tokens / q if q else 0.0,
        }


def _chain_root(req: Request) -> bytes:
    """What the first block's hash chains from: the request's adapter, if any."""
    return b"" if req.adapter is None else b"lora:" + req.adapter.encode()
