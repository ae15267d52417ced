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
