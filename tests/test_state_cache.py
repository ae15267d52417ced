"""The recurrent-state cache of hybrid models on its own and inside the scheduler (no torch):
slots taken and given back on finish, abort and preemption; snapshots reserved, published only
after their step ran, evicted least recently used but never while a restore is pending; prefix
hits cut to the longest prefix with both KV blocks and a snapshot; the points worth a snapshot;
and a randomized soak with every invariant checked after every step."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.encoder_cache import EncoderCacheManager
from engine.request import MultiModalFeature, PlaceholderRange, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.state_cache import StateCacheManager, save_points


def test_the_bookkeeping_never_imports_torch():
    code = ("import sys; sys.modules['torch'] = None\n"  # importing torch would fail
            "import engine.scheduler, engine.state_cache")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the manager alone ----------------------------------------------------------------------


def test_slots_are_taken_and_given_back():
    states = StateCacheManager(num_slots=2, num_snapshots=0, block_size=4)
    a, b = states.admit("a", ()), states.admit("b", ())
    assert {a.slot, b.slot} == {0, 1}
    with pytest.raises(RuntimeError, match="no free state slot"):
        states.admit("c", ())
    with pytest.raises(ValueError, match="already holds"):
        states.admit("a", ())
    states.release_request("a")
    states.release_request("a")  # twice is harmless
    assert states.admit("c", ()).slot == a.slot
    states.check_integrity(["b", "c"])


def test_snapshots_publish_only_when_committed_and_evict_lru_unpinned():
    states = StateCacheManager(num_slots=2, num_snapshots=2, block_size=4)
    held = states.admit("a", {4, 8, 12})
    saves = states.plan_saves(held, 0, 12)
    assert [p for p, _ in saves] == [4, 8]  # two ids only; 12 stays a point
    assert held.points == {12}
    assert states.longest_hit([b"h1", b"h2"], 2) == (0, None)  # reserved, not published
    states.commit(saves[0][1], b"h1")
    states.commit(saves[1][1], b"h2")
    assert states.longest_hit([b"h1", b"h2", b"h3"], 3) == (2, saves[1][1])
    assert states.longest_hit([b"h1", b"h2", b"h3"], 1) == (1, saves[0][1])  # KV decides too
    # A pending restore pins its snapshot: the other one is evicted for a new save.
    other = states.admit("b", {4})
    states.restore(other, saves[0][1], 4)
    (point, snapshot), = states.plan_saves(held, 8, 12)
    assert snapshot == saves[1][1] and states.stats.snapshots_evicted == 1
    assert states.longest_hit([b"h1", b"h2"], 2) == (1, saves[0][1])
    assert states.plan_saves(other, 0, 4) == []  # nothing left to evict: the save is skipped
    states.release(snapshot)
    states.restored(other)
    states.check_integrity(["a", "b"])


def test_a_boundary_published_twice_keeps_one_entry():
    states = StateCacheManager(num_slots=2, num_snapshots=4, block_size=4)
    for rid in ("a", "b"):
        held = states.admit(rid, {4})
        (_, snapshot), = states.plan_saves(held, 0, 6)
        states.commit(snapshot, b"same")
    assert len(states.snapshots) == 1 and len(states.free_snapshots) == 3
    states.check_integrity(["a", "b"])


def test_save_points_round_down_to_blocks():
    points = save_points(37, 8, message_starts=[0, 3, 21], media_ends=[30, 37])
    assert points == {16, 24, 32}  # 21 -> 16, 30 -> 24, the prompt's end 37 -> 32; 0, 3 none
    # A prompt ending on a boundary: the same prompt again hits one block earlier.
    assert save_points(32, 8) == {24, 32}


# ---- inside the scheduler -------------------------------------------------------------------


def make_sched(num_blocks=64, block_size=4, slots=8, snapshots=8, **opts) -> Scheduler:
    config = EngineConfig(block_size=block_size, max_num_seqs=slots, **opts)
    bm = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
    states = StateCacheManager(slots, snapshots, block_size)
    return Scheduler(config, bm, EncoderCacheManager(1000), states)


def make_req(rid, tokens, max_tokens=2, starts=(), features=()) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(tokens), params, frozenset(), max_tokens, message_starts=starts,
                   mm_features=list(features))


def run_step(s: Scheduler, out: SchedulerOutput | None = None) -> SchedulerOutput:
    """Schedule (unless `out` is given), pretend to execute (token = 7), advance."""
    out = s.schedule() if out is None else out
    s.update_after_step(out)
    for chunk in out.chunks:
        if chunk.samples:
            chunk.req.append_token(7)
            if chunk.req.num_output_tokens >= chunk.req.max_tokens:
                s.finish(chunk.req, RequestStatus.FINISHED_LENGTH)
    s.check_integrity()
    return out


def drain(s: Scheduler) -> None:
    for _ in range(1000):
        if not s.num_unfinished:
            return
        run_step(s)
    raise AssertionError("no progress")


SYSTEM = list(range(100, 123))  # 23 tokens: a message starts after it


def test_a_shared_system_prompt_hits_from_the_second_request():
    s = make_sched()
    first = make_req("a", SYSTEM + [1, 2, 3], starts=(23,))
    s.add(first)
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.state.restore is None
    # Message start 23 -> boundary 20; prompt end 26 -> 24.
    assert [c for c, _ in chunk.state.saves] == [20, 24]
    run_step(s, out)
    drain(s)
    second = make_req("b", SYSTEM + [9, 9, 9, 9], starts=(23,))
    s.add(second)
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.start == 20 and chunk.state.restore is not None
    assert second.num_cached_tokens == 20
    drain(s)
    assert s.states.stats.snapshot_hits == 1 and s.states.stats.hit_tokens == 20
    assert not s.states.held and not s.states.pins


def test_without_a_snapshot_the_kv_hit_is_dropped_and_the_branch_point_saved():
    s = make_sched()
    a = make_req("a", SYSTEM + [1, 2, 3])  # no message starts: saves at its end only (24)
    s.add(a)
    drain(s)
    b = make_req("b", SYSTEM + [5, 5, 5, 5, 5])  # shares 20 tokens' blocks, no snapshot there
    s.add(b)
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.start == 0 and chunk.state.restore is None
    assert 20 in [c for c, _ in chunk.state.saves]  # the branch point
    run_step(s, out)
    drain(s)
    c = make_req("c", SYSTEM + [6, 6, 6, 6])
    s.add(c)
    out = s.schedule()
    assert out.chunks[0].start == 20 and out.chunks[0].state.restore is not None


def test_chunks_carry_their_slot_and_saves_in_chunk_offsets():
    s = make_sched(max_num_batched_tokens=7)
    req = make_req("a", range(30), starts=(10, 22))
    s.add(req)
    seen = []
    while req.num_computed_tokens < 30:
        out = run_step(s)
        (chunk,) = out.chunks
        seen += [chunk.start + c for c, _ in chunk.state.saves]
        assert all(0 < c <= chunk.num_tokens for c, _ in chunk.state.saves)
    assert seen == [8, 20, 28]


def test_media_ends_are_save_points():
    span = PlaceholderRange(5, 10)
    feature = MultiModalFeature("image", "img-hash", span)
    s = make_sched()
    s.add(make_req("a", range(20), features=[feature]))
    out = s.schedule()
    # 15 -> 12; the end, 20 (and 19 -> 16: the same prompt again)
    assert [c for c, _ in out.chunks[0].state.saves] == [12, 16, 20]


def test_preemption_and_abandoned_steps_give_everything_back():
    s = make_sched(num_blocks=12, max_num_batched_tokens=64)
    a, b = make_req("a", range(12), max_tokens=30), make_req("b", range(50, 62), max_tokens=30)
    s.add(a)
    s.add(b)
    out = s.schedule()
    s.abandon(out)  # the step failed: reservations back, points kept
    s.check_integrity()
    assert all(s.states.get(r.request_id).points for r in (a, b))
    for _ in range(40):  # decoding both outgrows 12 blocks: preemptions
        run_step(s)
    assert a.metrics.num_preemptions + b.metrics.num_preemptions > 0
    drain(s)
    assert not s.states.held and len(s.states.free_slots) == 8


def test_soak_with_random_prompts_aborts_and_failed_steps():
    rng = random.Random(0)
    s = make_sched(num_blocks=40, block_size=4, slots=4, snapshots=5, max_num_batched_tokens=16)
    prefixes = [list(range(200, 200 + rng.randint(4, 14))) for _ in range(3)]
    for i in range(150):
        if rng.random() < 0.5:
            tokens = rng.choice(prefixes) + [rng.randint(0, 50) for _ in range(rng.randint(1, 9))]
            s.add(make_req(f"r{i}", tokens, max_tokens=rng.randint(1, 5),
                           starts=(len(tokens) - 3,)))
        live = s.running + list(s.waiting)
        if live and rng.random() < 0.1:
            s.finish(rng.choice(live), RequestStatus.FINISHED_ABORTED)
        if rng.random() < 0.1:
            s.abandon(s.schedule())
            s.check_integrity()
            continue
        run_step(s)
    drain(s)
    assert not s.states.held and not s.states.pins and not s.states.reserved
    assert s.states.stats.snapshot_hits > 0
