"""BlockManager on its own: allocation, freeing, prefix hits, eviction order, media-aware hashes."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.request import MultiModalFeature, PlaceholderRange, Request
from engine.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], features=()) -> Request:
    return Request(rid, list(tokens), SamplingParams(), frozenset(), 16, mm_features=list(features))


def compute(bm: BlockManager, req: Request, n: int) -> None:
    """Pretend the model computed the next n tokens of req."""
    start = req.num_computed_tokens
    assert bm.allocate(req, start + n)
    req.num_computed_tokens = start + n
    bm.cache_computed_blocks(req, start, start + n)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a, b = make_req("a", range(10)), make_req("b", range(100, 107))
    assert bm.allocate(a, 10) and bm.allocate(b, 7)
    assert len(a.block_ids) == 3 and len(b.block_ids) == 2
    assert bm.num_free_blocks == 3
    bm.check_integrity([a, b])
    bm.free_request(a)
    bm.free_request(b)
    assert bm.num_free_blocks == 8 and a.block_ids == [] and b.block_ids == []
    bm.check_integrity([])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a, b = make_req("a", range(12)), make_req("b", range(12))
    assert bm.allocate(a, 12)
    assert not bm.allocate(b, 8)
    assert b.block_ids == [] and bm.num_free_blocks == 1
    bm.check_integrity([a, b])


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = make_req("a", range(12))
    compute(bm, a, 12)
    b = make_req("b", range(12))  # identical prompt: 3 full blocks, but only 2 may hit
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate(b, 12, hits)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    bm.check_integrity([a, b])


def test_cached_blocks_survive_free_until_evicted_lru():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = make_req("a", range(9))
    compute(bm, a, 9)  # blocks 0,1 full (cached), block 2 partial
    bm.free_request(a)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    # Unhashed blocks are handed out first (a's partial block, the never-used one) ...
    c, d = make_req("c", range(500, 503)), make_req("d", range(600, 603))
    assert bm.allocate(c, 3) and bm.allocate(d, 3)
    assert len(bm.cached) == 2
    # ... then cached ones, the tail of a's prefix before its head.
    e = make_req("e", range(700, 703))
    assert bm.allocate(e, 3)
    head, tail = a.block_hashes[0], a.block_hashes[1]
    assert head in bm.cached and tail not in bm.cached
    again = make_req("again", range(9))
    assert len(bm.find_cached_prefix(again)) == 1
    bm.check_integrity([c, d, e])


def test_hit_on_a_free_cached_block_counts_against_free_space():
    bm = BlockManager(3, 4, enable_prefix_caching=True)
    a = make_req("a", range(9))
    compute(bm, a, 9)
    bm.free_request(a)
    b = make_req("b", list(range(8)) + [99] * 4)  # hits a's 2 blocks, needs 1 new
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    assert bm.allocate(b, 12, hits)
    assert bm.num_free_blocks == 0
    bm.check_integrity([b])


def test_same_tokens_different_media_never_share():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    tokens = [1, 2, 9, 9, 9, 9, 3, 4, 5]
    span = PlaceholderRange(2, 4)
    cat = make_req("cat", tokens, [MultiModalFeature("image", "hash-cat", span)])
    dog = make_req("dog", tokens, [MultiModalFeature("image", "hash-dog", span)])
    cat2 = make_req("cat2", tokens, [MultiModalFeature("image", "hash-cat", span)])
    compute(bm, cat, 9)
    assert bm.find_cached_prefix(dog) == []
    assert bm.find_cached_prefix(cat2) == cat.block_ids[:2]


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_req("a", range(12))
    compute(bm, a, 12)
    assert bm.find_cached_prefix(make_req("b", range(12))) == []
    assert not bm.cached


def test_integrity_check_catches_a_leak():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = make_req("a", range(4))
    assert bm.allocate(a, 4)
    with pytest.raises(AssertionError):
        bm.check_integrity([])  # a still holds a block nobody accounts for


class CopyLog:
    """copy_kv for a BlockManager without a model: records (src, dst, tokens)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, src: int, dst: int, tokens: int) -> None:
        self.calls.append((src, dst, tokens))


def admit(bm: BlockManager, req: Request, n: int | None = None) -> int:
    """Admit req as the scheduler does (whole-block hits, then a tail); returns its start."""
    hits = bm.find_cached_prefix(req)
    tail = bm.find_tail(req, len(hits))
    start = len(hits) * bm.block_size + (tail[1] if tail else 0)
    assert bm.allocate(req, req.num_tokens if n is None else start + n, hits, tail)
    req.num_computed_tokens = start
    return start


def test_a_freed_partial_block_serves_the_tail_of_a_longer_prompt():
    copies = CopyLog()
    bm = BlockManager(8, 4, enable_prefix_caching=True, copy_kv=copies)
    a = make_req("a", range(10))
    compute(bm, a, 10)  # blocks 0, 1 full; block 2 holds tokens 8, 9
    full, partial = a.block_ids[:2], a.block_ids[2]
    bm.free_request(a)
    assert bm.blocks[partial].keys == (8, 9)
    b = make_req("b", list(range(10)) + [50, 51, 52])  # a second turn: a's prompt, then more
    assert admit(bm, b) == 10
    assert copies.calls == [(partial, b.block_ids[2], 2)]
    assert b.block_ids[:2] == full and b.block_ids[2] != partial
    assert bm.stats()["prefix_cache_tail_tokens"] == 2
    bm.check_integrity([b])


def test_a_full_cached_block_serves_the_common_start_of_a_diverging_one():
    copies = CopyLog()
    bm = BlockManager(8, 4, enable_prefix_caching=True, copy_kv=copies)
    a = make_req("a", range(12))
    compute(bm, a, 12)
    b = make_req("b", [0, 1, 2, 3, 4, 5, 99, 98, 97])  # shares block 0 and 2 tokens of block 1
    assert admit(bm, b) == 6
    assert copies.calls == [(a.block_ids[1], b.block_ids[1], 2)]
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]
    # The same prompt again: everything but its last token (which yields the next token's logits).
    c = make_req("c", range(12))
    assert admit(bm, c) == 11 and copies.calls[-1] == (a.block_ids[2], c.block_ids[2], 3)
    bm.check_integrity([a, b, c])


def test_the_longest_match_wins_and_the_last_token_is_always_computed():
    copies = CopyLog()
    bm = BlockManager(16, 4, enable_prefix_caching=True, copy_kv=copies)
    for rid, tokens in (("x", [7, 1]), ("y", [7, 1, 2]), ("z", [7, 5, 5])):
        r = make_req(rid, tokens + [0])  # computes 3 of 4: the partial block holds `tokens`
        compute(bm, r, len(tokens))
        bm.free_request(r)
    assert len(bm.children[b""]) == 3 and copies.calls == []
    q = make_req("q", [7, 1, 2, 3])
    assert bm.find_tail(q, 0)[1] == 3
    assert bm.find_tail(make_req("short", [7, 1, 2]), 0)[1] == 2  # its last token stays
    assert bm.find_tail(make_req("miss", [8, 1, 2]), 0) is None
    assert bm.find_tail(make_req("one", [7]), 0) is None
    bm.check_integrity([])


def test_a_tail_stops_before_media_and_never_matches_a_placeholder():
    copies = CopyLog()
    bm = BlockManager(16, 4, enable_prefix_caching=True, copy_kv=copies)
    span = PlaceholderRange(2, 2)
    cat = make_req("cat", [1, 2, 9, 9, 3, 4], [MultiModalFeature("image", "hash-cat", span)])
    compute(bm, cat, 6)
    assert bm.blocks[cat.block_ids[0]].keys == (1, 2, -1, -1)
    dog = make_req("dog", [1, 2, 9, 9, 3, 4], [MultiModalFeature("image", "hash-dog", span)])
    assert bm.find_cached_prefix(dog) == [] and bm.find_tail(dog, 0) == (cat.block_ids[0], 2)
    # Text where the cached block had the image's placeholder ids: not the same KV.
    text = make_req("text", [1, 2, 9, 9, 3, 4])
    assert bm.find_tail(text, 0) == (cat.block_ids[0], 2)
    bm.check_integrity([cat])


def test_a_tail_block_survives_its_own_allocation_and_is_evicted_like_a_cached_one():
    copies = CopyLog()
    bm = BlockManager(4, 4, enable_prefix_caching=True, copy_kv=copies)
    a = make_req("a", range(6))
    compute(bm, a, 6)  # block 0 full, block 1 holds 4, 5
    held = list(a.block_ids)
    tail_block = held[1]
    bm.free_request(a)
    assert list(bm.free)[:2] == [2, 3]  # the unused blocks leave first, then the cached ones
    b = make_req("b", list(range(6)) + [60, 61, 62, 63, 64, 65])  # block 0 hit, 2 new
    assert admit(bm, b) == 6
    assert copies.calls == [(tail_block, b.block_ids[1], 2)] and tail_block not in b.block_ids
    bm.check_integrity([b])
    c = make_req("c", range(100, 104))  # takes the last free block: the tail is evicted
    assert bm.allocate(c, 4) and c.block_ids == [tail_block]
    assert bm.blocks[tail_block].parent is None and not bm.children.get(a.block_hashes[0])
    bm.check_integrity([b, c])
    # One free block, and it is the tail's own: the request cannot copy from it.
    bm.free_request(c)
    d = make_req("d", range(100, 104))
    compute(bm, d, 3)
    bm.free_request(d)
    e = make_req("e", [100, 101, 102, 7])
    tail = bm.find_tail(e, 0)
    assert tail == (tail_block, 3) and not bm.allocate(e, 4, [], tail)
    assert e.block_ids == [] and len(copies.calls) == 1
    assert bm.allocate(e, 4)  # without the tail it fits
    bm.check_integrity([b, e])


def test_tails_are_off_without_a_copy_and_forgotten_on_reset():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_req("a", range(6))
    compute(bm, a, 6)
    bm.free_request(a)
    assert bm.find_tail(make_req("b", range(8)), 1) is None and not bm.children
    copies = CopyLog()
    bm = BlockManager(8, 4, enable_prefix_caching=True, copy_kv=copies)
    compute(bm, a := make_req("a", range(6)), 6)
    bm.free_request(a)
    assert bm.children
    bm.reset_prefix_cache()
    assert not bm.children and bm.find_tail(make_req("b", range(8)), 1) is None
    bm.check_integrity([])
