"""Recurrent-state slots and prefix snapshots of hybrid models (Gated DeltaNet layers). Pure
Python: the tensors live in the model runner, this decides which rows they use.

A linear-attention layer keeps one fixed-size state per sequence instead of KV blocks: the
convolution's last inputs and the recurrent state. Every running request holds one **slot**
(the same row of every linear layer's pools), taken at admission and given back when it finishes,
is aborted or preempted (a preempted request starts again from zero or from a snapshot).

A prefix-cache hit must restore that state as it was after the hit prefix, which KV blocks alone
cannot give: the state after token t summarises every token before it. **Snapshots** are copies
of a sequence's state at a block boundary, keyed by the hash of the block that ends there (the
block manager's chained hash: the same tokens and media from the start), kept in an LRU within a
fixed number of entries. A waiting request's hit is the longest prefix whose KV blocks are cached
*and* whose last block has a snapshot; its chunk restores the snapshot into its slot.

Snapshots are taken where a prefix is likely to be asked for again (`save_points`): where each
chat message starts (a system prompt, earlier turns), just after each media item (the same image
with another question), at the end of the prompt (the next turn of the conversation), and at the
point where a request's prompt stopped matching cached KV blocks that had no snapshot (the
branch point of two prompts: the third request sharing it hits). Any point is rounded down to its
block boundary; a boundary is snapshotted once. A snapshot id is reserved when its chunk is
scheduled and published under its block hash only once the step has run (`commit`); a step that
did not run gives its reservations back (`release`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class StateStats:
    snapshots_saved: int = 0
    snapshots_evicted: int = 0
    snapshot_hits: int = 0  # admissions that restored a snapshot
    hit_tokens: int = 0  # prompt tokens those restores skipped


@dataclass
class RequestState:
    """A request's hold on the state cache."""

    slot: int
    restore: int | None = None  # pinned snapshot id its next chunk copies in
    points: set[int] = field(default_factory=set)  # block boundaries to snapshot


class StateCacheManager:
    """Slots for the running requests' states and an LRU of prefix snapshots."""

    def __init__(self, num_slots: int, num_snapshots: int, block_size: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots must be >= 0, got {num_snapshots}")
        self.num_slots, self.num_snapshots, self.block_size = num_slots, num_snapshots, block_size
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.held: dict[str, RequestState] = {}  # by request id
        # Published snapshots by block hash, least recently used first.
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()
        self.free_snapshots = list(range(num_snapshots - 1, -1, -1))
        self.pins: dict[int, int] = {}  # snapshot id -> pending restores
        self.reserved: set[int] = set()
        self.stats = StateStats()

    # ---- slots ---------------------------------------------------------------------------------

    def admit(self, request_id: str, points: Iterable[int]) -> RequestState:
        """Give a request a slot (one is always free: at most `num_slots` requests run) and the
        block boundaries it should snapshot."""
        if request_id in self.held:
            raise ValueError(f"request {request_id} already holds state slot "
                             f"{self.held[request_id].slot}")
        if not self.free_slots:
            raise RuntimeError("no free state slot: more running requests than slots")
        held = RequestState(self.free_slots.pop(), points=set(points))
        self.held[request_id] = held
        return held

    def release_request(self, request_id: str) -> None:
        """A finished, aborted or preempted request gives its slot and pin back."""
        held = self.held.pop(request_id, None)
        if held is None:
            return
        self._unpin(held.restore)
        self.free_slots.append(held.slot)

    def get(self, request_id: str) -> RequestState | None:
        return self.held.get(request_id)

    # ---- prefix hits ---------------------------------------------------------------------------

    def longest_hit(self, block_hashes: list[bytes], cached_blocks: int) -> tuple[int, int | None]:
        """Of a prompt whose first `cached_blocks` blocks have cached KV, the most blocks whose
        state is also snapshotted, and that snapshot's id (0 and None: no hit)."""
        for n in range(min(cached_blocks, len(block_hashes)), 0, -1):
            snapshot = self.snapshots.get(block_hashes[n - 1])
            if snapshot is not None:
                return n, snapshot
        return 0, None

    def restore(self, held: RequestState, snapshot: int, tokens: int) -> None:
        """The request's first chunk copies `snapshot` in (pinned until `restored`)."""
        self.pins[snapshot] = self.pins.get(snapshot, 0) + 1
        held.restore = snapshot
        self.stats.snapshot_hits += 1
        self.stats.hit_tokens += tokens
        self._touch(snapshot)

    def restored(self, held: RequestState) -> None:
        """The chunk that copied the snapshot in has run."""
        self._unpin(held.restore)
        held.restore = None

    # ---- saving --------------------------------------------------------------------------------

    def plan_saves(self, held: RequestState, start: int, end: int) -> list[tuple[int, int]]:
        """(boundary, reserved snapshot id) for the request's points in (start, end], as many
        as can be reserved; the points planned are dropped from the request's list."""
        saves = []
        for point in sorted(p for p in held.points if start < p <= end):
            snapshot = self._reserve()
            if snapshot is None:
                break
            saves.append((point, snapshot))
            held.points.discard(point)
        return saves

    def commit(self, snapshot: int, block_hash: bytes) -> None:
        """The step that wrote `snapshot` ran: publish it as the state after `block_hash`'s
        block (a boundary already published keeps its entry, and this one is freed)."""
        self.reserved.discard(snapshot)
        if block_hash in self.snapshots:
            self.free_snapshots.append(snapshot)
            self.snapshots.move_to_end(block_hash)
            return
        self.snapshots[block_hash] = snapshot
        self.stats.snapshots_saved += 1

    def release(self, snapshot: int) -> None:
        """A reservation whose step did not run goes back."""
        self.reserved.discard(snapshot)
        self.free_snapshots.append(snapshot)

    def _reserve(self) -> int | None:
        if self.free_snapshots:
            snapshot = self.free_snapshots.pop()
        else:  # evict the least recently used snapshot that no request is about to restore
            victim = next((h for h, s in self.snapshots.items() if not self.pins.get(s)), None)
            if victim is None:
                return None
            snapshot = self.snapshots.pop(victim)
            self.stats.snapshots_evicted += 1
        self.reserved.add(snapshot)
        return snapshot

    def _touch(self, snapshot: int) -> None:
        for block_hash, s in self.snapshots.items():
            if s == snapshot:
                self.snapshots.move_to_end(block_hash)
                return

    def _unpin(self, snapshot: int | None) -> None:
        if snapshot is None:
            return
        self.pins[snapshot] -= 1
        if not self.pins[snapshot]:
            del self.pins[snapshot]

    # ---- checks and statistics -----------------------------------------------------------------

    def check_integrity(self, live_ids: Iterable[str]) -> None:
        """Raise AssertionError unless every slot and snapshot id is accounted for once."""
        live = set(live_ids)
        assert set(self.held) <= live, f"finished requests hold state: {set(self.held) - live}"
        slots = [h.slot for h in self.held.values()] + self.free_slots
        assert sorted(slots) == list(range(self.num_slots)), f"slots lost or shared: {slots}"
        ids = list(self.snapshots.values()) + self.free_snapshots + sorted(self.reserved)
        assert sorted(ids) == list(range(self.num_snapshots)), f"snapshots lost: {ids}"
        pinned = {h.restore for h in self.held.values() if h.restore is not None}
        assert set(self.pins) == pinned, f"pins {self.pins} vs pending restores {pinned}"

    def snapshot_stats(self) -> dict[str, int]:
        return {
            "state_slots_total": self.num_slots,
            "state_slots_used": len(self.held),
            "state_snapshots_total": self.num_snapshots,
            "state_snapshots_used": len(self.snapshots),
            "state_snapshot_hits": self.stats.snapshot_hits,
            "state_snapshot_hit_tokens": self.stats.hit_tokens,
            "state_snapshots_saved": self.stats.snapshots_saved,
            "state_snapshots_evicted": self.stats.snapshots_evicted,
        }


def save_points(num_prompt_tokens: int, block_size: int, *, message_starts: Iterable[int] = (),
                media_ends: Iterable[int] = ()) -> set[int]:
    """The block boundaries of a prompt worth a snapshot: each chat message's start, each media
    item's end and the prompt's end, each rounded down to a block boundary (boundary 0 holds
    nothing). The prompt's end counts twice: the same prompt again hits before its last token
    (one is always computed), a longer one (the conversation's next turn) at its last token."""
    points = {num_prompt_tokens - 1, num_prompt_tokens, *message_starts, *media_ends}
    return {p // block_size * block_size for p in points
            if block_size <= p <= num_prompt_tokens}
