"""Scheduler on its own (no torch): budgets, chunking, decode priority, preemption, the encoder
hook, and a randomized soak that checks every invariant after every step."""

from __future__ import annotations

import random

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.encoder_cache import EncoderCacheManager
from engine.request import MultiModalFeature, PlaceholderRange, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput


def make_sched(num_blocks=64, block_size=4, encoder_cache=1000, **opts) -> Scheduler:
    config = EngineConfig(block_size=block_size, **opts)
    bm = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
    return Scheduler(config, bm, EncoderCacheManager(encoder_cache))


def make_req(rid, n_prompt, max_tokens=4, features=(), first_token=0) -> Request:
    tokens = [first_token + i for i in range(n_prompt)]
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, tokens, params, frozenset(), max_tokens, mm_features=list(features))


def run_step(s: Scheduler) -> SchedulerOutput:
    """Schedule, pretend to execute (token = 7), advance, finish at max_tokens."""
    out = s.schedule()
    s.update_after_step(out)
    for chunk in out.chunks:
        if chunk.samples:
            chunk.req.append_token(7)
            if chunk.req.num_output_tokens >= chunk.req.max_tokens:
                s.finish(chunk.req, RequestStatus.FINISHED_LENGTH)
    s.check_integrity()
    return out


def drain(s: Scheduler, limit=10_000) -> int:
    steps = 0
    while s.num_unfinished:
        run_step(s)
        steps += 1
        assert steps < limit, "no progress: deadlock"
    return steps


def test_long_prompt_is_chunked_while_others_decode():
    s = make_sched(max_num_batched_tokens=8)
    a = make_req("a", 3, max_tokens=20)
    s.add(a)
    run_step(s)  # a prefilled, sampled its first token
    b = make_req("b", 30)
    s.add(b)
    sizes = []
    while b.num_computed_tokens < b.num_prompt_tokens:
        out = run_step(s)
        by_req = {c.req.request_id: c.num_tokens for c in out.chunks}
        assert by_req["a"] == 1  # the decode token comes first, every step
        assert out.num_tokens <= 8
        sizes.append(by_req.get("b", 0))
    assert sizes == [7, 7, 7, 7, 2]


def test_decode_tokens_are_scheduled_before_prefill_chunks():
    s = make_sched(max_num_batched_tokens=4)
    decoders = [make_req(f"d{i}", 2, max_tokens=50) for i in range(3)]
    for r in decoders:
        s.add(r)
    run_step(s)
    run_step(s)
    s.add(make_req("p", 20))
    out = run_step(s)
    assert [c.req.request_id for c in out.chunks] == ["d0", "d1", "d2", "p"]
    assert [c.num_tokens for c in out.chunks] == [1, 1, 1, 1]


def test_max_num_seqs_limits_running():
    s = make_sched(max_num_seqs=2)
    for i in range(5):
        s.add(make_req(f"r{i}", 3))
    out = run_step(s)
    assert len(out.chunks) == 2 and len(s.running) == 2 and len(s.waiting) == 3
    drain(s)


def test_preemption_takes_the_newest_and_everything_finishes():
    s = make_sched(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    reqs = [make_req(f"r{i}", 6, max_tokens=10) for i in range(4)]
    for r in reqs:
        s.add(r)
    preempted = []
    while s.num_unfinished:
        out = run_step(s)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] in ("r2", "r3")
    assert all(r.num_output_tokens == 10 for r in reqs)
    assert s.blocks.num_free_blocks == 6


def test_single_request_never_preempts_itself_forever():
    s = make_sched(num_blocks=4, block_size=4)
    r = make_req("r", 5, max_tokens=11)  # needs exactly 4 blocks at the end
    s.add(r)
    drain(s)
    assert r.num_output_tokens == 11


def test_prefix_hit_is_recorded_once_at_admission():
    s = make_sched(block_size=4)
    s.add(make_req("a", 13))
    drain(s)
    b = make_req("b", 13)
    s.add(b)
    out = run_step(s)
    assert b.num_cached_tokens == 12 and out.chunks[0].start == 12 and out.chunks[0].num_tokens == 1


def _image(identifier, offset, length) -> MultiModalFeature:
    # data stands for the encoder inputs the request keeps until it ends
    return MultiModalFeature("image", identifier, PlaceholderRange(offset, length), data={})


def test_chunk_is_cut_before_an_image_that_does_not_fit_the_encoder_budget():
    s = make_sched(max_num_batched_tokens=100, max_num_encoder_input_tokens=10)
    big = make_req("big", 40, features=[_image("img", 5, 20)])  # 20 embeds > budget 10
    s.add(big)
    out = run_step(s)
    assert out.chunks[0].num_tokens == 5 and not out.encoder_inputs
    out = run_step(s)  # the window now starts inside the item: nothing can be scheduled
    assert not out.chunks


def test_encoder_runs_once_for_two_requests_with_the_same_image():
    s = make_sched(max_num_batched_tokens=100)
    a = make_req("a", 30, features=[_image("same", 4, 16)])
    b = make_req("b", 30, features=[_image("same", 4, 16)], first_token=100)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [(r.request_id, i) for r, i in out.encoder_inputs] == [("a", 0)]
    assert a.mm_features[0].cache_hit is False and b.mm_features[0].cache_hit is True
    # Both windows passed the image in this step: the entry is kept, but nobody references it.
    assert "same" in s.encoder_cache.freeable and s.encoder_cache.cached["same"] == set()
    drain(s)
    assert s.encoder_cache.num_referenced == 0


def test_image_split_across_chunks_is_encoded_once_and_released_after():
    s = make_sched(max_num_batched_tokens=8, max_num_encoder_input_tokens=100)
    r = make_req("r", 40, features=[_image("img", 3, 20)])
    s.add(r)
    encoded = 0
    while r.num_computed_tokens < 40:
        out = run_step(s)
        encoded += len(out.encoder_inputs)
        if r.num_computed_tokens >= 23:
            assert "img" in s.encoder_cache.freeable  # consumed: reference released
        elif r.num_computed_tokens > 3:
            assert s.encoder_cache.cached["img"] == {"r"}
    assert encoded == 1


def test_cache_too_small_for_two_items_at_once_schedules_them_in_turn():
    s = make_sched(max_num_batched_tokens=100, encoder_cache=20)
    r = make_req("r", 50, features=[_image("x", 2, 16), _image("y", 20, 16)])
    s.add(r)
    out = run_step(s)  # x fits; y cannot while x is referenced: cut before y
    assert [i for _, i in out.encoder_inputs] == [0] and out.chunks[0].num_tokens == 20
    out = run_step(s)  # x consumed and released, evicted for y
    assert [i for _, i in out.encoder_inputs] == [1] and out.freed_encoder_hashes == ["x"]
    drain(s)


def test_soak_random_traffic_keeps_every_invariant():
    rng = random.Random(0)
    s = make_sched(num_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
                   encoder_cache=40, max_num_encoder_input_tokens=24)
    live: list[Request] = []
    for step in range(3000):
        if rng.random() < 0.3 and step < 2500:
            n = rng.randint(1, 40)
            features = []
            if rng.random() < 0.5 and n > 12:
                off = rng.randint(0, n - 10)
                length = rng.randint(1, min(20, n - off))
                features = [_image(f"img{rng.randint(0, 5)}", off, length)]
            r = make_req(f"r{step}", n, rng.randint(1, 12), features, first_token=rng.randint(0, 3))
            s.add(r)
            live.append(r)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            if not victim.finished:
                s.finish(victim, RequestStatus.FINISHED_ABORTED)
        run_step(s)
        live = [r for r in live if not r.finished]
    drain(s)
    assert s.blocks.num_used_blocks == 0
    assert s.encoder_cache.num_referenced == 0
    s.check_integrity()


def test_preempted_request_whose_embeddings_were_evicted_encodes_them_again():
    """A request preempted after its prompt was computed, whose embeddings were evicted
    meanwhile (and whose KV is not in the prefix cache either), schedules its encoder again;
    the others keep running."""
    s = make_sched(max_num_batched_tokens=100, enable_prefix_caching=False)
    again = make_req("again", 20, features=[_image("img", 2, 8)])
    other = make_req("other", 5, max_tokens=3, first_token=50)
    s.add(again)
    s.add(other)
    assert [i for _, i in run_step(s).encoder_inputs] == [0]
    s._preempt(again, SchedulerOutput())
    s.encoder_cache.can_allocate(1000, 1000, 0)  # evict everything unreferenced
    assert s.encoder_cache.drain_freed() == ["img"]
    out = run_step(s)
    assert [(r.request_id, i) for r, i in out.encoder_inputs] == [("again", 0)]
    assert {c.req.request_id for c in out.chunks} == {"again", "other"}
    drain(s)
