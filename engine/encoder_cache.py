"""EncoderCacheManager: which media items' encoder outputs are kept, for whom. Bookkeeping only.

The runner holds the tensors (hash -> embeddings); this class decides what they may occupy.
Capacity is counted in embeddings, not bytes: an item costs `MultiModalFeature.encoder_size`
times `vectors_per_embed` (1, or 1 + K for a DeepStack model, whose items also hold K per-layer
residuals of the same shape). For a model with cross-attention layers the entries are those
layers' keys and values per item, counted in key positions (the engine sizes the capacity from
`cross_attention_cache_bytes`).

State:
- `free`: capacity not held by any entry; `reclaimable`: `free` plus the unreferenced entries.
- `cached`: hash -> ids of the requests that still need the entry. An entry whose set becomes
  empty is not dropped: it moves to the end of `freeable` (LRU order), still a hit for later
  requests, and is evicted only when a new item needs its space.
- `freed`: hashes evicted since the runner last asked; the runner drops those tensors.

A request holds one reference per distinct item hash. It gives the reference back as soon as its
computed tokens pass the last token that needs the item (`MultiModalFeature.needed_until`: the
end of its span, or of the rows that cross-attend to it; the KV holds what the item gave from
then on; an item attended to the end of the sequence is held while the request runs), when it
finishes, is aborted, or is preempted.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.request import Request


class EncoderCacheManager:
    """Ref-counted, LRU-evicting bookkeeping of encoder outputs keyed by content hash."""

    def __init__(self, capacity: int, vectors_per_embed: int = 1) -> None:
        self.capacity = capacity
        self.vectors_per_embed = vectors_per_embed
        self.free = capacity
        self.reclaimable = capacity
        self.cached: dict[str, set[str]] = {}
        self.sizes: dict[str, int] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freed: list[str] = []
        self.hits = 0
        self.misses = 0

    def lookup(self, req: Request, identifier: str) -> bool:
        """True on a hit; the request then holds a reference to the entry."""
        refs = self.cached.get(identifier)
        if refs is None:
            return False
        if req.request_id in refs:  # a later chunk of the same request
            return True
        if not refs:
            self.reclaimable -= self.freeable.pop(identifier)
        refs.add(req.request_id)
        self.hits += 1
        return True

    def can_allocate(self, num_embeds: int, compute_budget: int, planned: int) -> bool:
        """Whether an item of `num_embeds` fits this step, evicting unreferenced entries if needed.

        `compute_budget` bounds the encoder's work (embeddings); `planned` counts the embeddings
        already planned (not yet allocated) this step.
        """
        if num_embeds > compute_budget:
            return False
        needed = (num_embeds + planned) * self.vectors_per_embed
        if needed <= self.free:
            return True
        if needed > self.reclaimable:
            return False
        while needed > self.free:
            identifier, size = self.freeable.popitem(last=False)
            del self.cached[identifier]
            del self.sizes[identifier]
            self.freed.append(identifier)
            self.free += size
        return True

    def allocate(self, req: Request, identifier: str, num_embeds: int) -> None:
        """Reserve space for an item whose encoder runs this step, referenced by `req`."""
        assert identifier not in self.cached, f"{identifier} allocated twice"
        size = num_embeds * self.vectors_per_embed
        self.cached[identifier] = {req.request_id}
        self.sizes[identifier] = size
        self.free -= size
        self.reclaimable -= size
        self.misses += 1

    def release(self, req: Request, identifier: str) -> None:
        """Drop `req`'s reference; an entry nobody references becomes the newest evictable one."""
        refs = self.cached.get(identifier)
        if refs is None or req.request_id not in refs:
            return
        refs.discard(req.request_id)
        if not refs:
            self.freeable[identifier] = self.sizes[identifier]
            self.reclaimable += self.sizes[identifier]

    def discard(self, identifier: str) -> None:
        """Forget an entry whose encoder output was never stored (its encoder failed), so that
        no later lookup hits it: the item is encoded again by whoever needs it next. Requests
        still referencing it lose the reference."""
        refs = self.cached.pop(identifier, None)
        if refs is None:
            return
        size = self.sizes.pop(identifier)
        self.free += size
        if refs:
            self.reclaimable += size
        else:
            del self.freeable[identifier]

    def release_consumed(self, req: Request) -> None:
        """Release the items no token from `req.num_computed_tokens` on needs."""
        if not req.mm_features:
            return
        done = req.num_computed_tokens
        still_needed = {f.identifier for f in req.mm_features
                        if f.needed_until is None or f.needed_until > done}
        for f in req.mm_features:
            if f.identifier not in still_needed:
                self.release(req, f.identifier)

    def release_request(self, req: Request) -> None:
        for f in req.mm_features:
            self.release(req, f.identifier)

    def drain_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def check_integrity(self, live: list[Request]) -> None:
        """Raise AssertionError if references or space disagree with the live requests."""
        live_ids = {r.request_id for r in live}
        for identifier, refs in self.cached.items():
            assert refs <= live_ids, f"{identifier} referenced by finished {refs - live_ids}"
            assert (not refs) == (identifier in self.freeable), f"{identifier} freeable mismatch"
        used = sum(self.sizes.values())
        assert self.free == self.capacity - used, (self.free, self.capacity, used)
        assert self.reclaimable == self.free + sum(self.freeable.values())

    @property
    def num_referenced(self) -> int:
        return sum(1 for refs in self.cached.values() if refs)

    def stats(self) -> dict[str, float]:
        lookups = self.hits + self.misses
        return {
            "encoder_cache_capacity": self.capacity,
            "encoder_cache_used": self.capacity - self.free,
            "encoder_cache_entries": len(self.cached),
            "encoder_cache_referenced": self.num_referenced,
            "encoder_cache_hits": self.hits,
            "encoder_cache_misses": self.misses,
            "encoder_cache_hit_rate": self.hits / lookups if lookups else 0.0,
        }
