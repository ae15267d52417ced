"""Per-step indices for the layers that carry a recurrent state instead of a KV cache (Gated
DeltaNet), built on the host like the attention metadata.

Every running request owns a state slot (rows of each linear layer's state pools, assigned by
engine.state_cache). A step's chunk either starts its sequence (its slot is zeroed first),
resumes from a prefix-cache snapshot (the snapshot is copied into its slot first), or continues
from what its slot holds. Multi-token chunks are `StatePiece`s, run one by one in the chunked
form, split where a snapshot of the state is to be saved; single-token chunks (decodes) run
together through the one-step recurrence, their states read and written in the pool by slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from models.interfaces import ChunkState
from models.layers.transfer import to_device


@dataclass(frozen=True)
class StatePiece:
    """One multi-token chunk: its rows of the flat batch, its slot, and the points inside it
    (`cuts`, tokens from its start, increasing) whose states go to snapshots `saves`."""

    rows: slice
    slot: int
    cuts: tuple[int, ...] = ()
    saves: tuple[int, ...] = ()


@dataclass
class StateMetadata:
    """The step's state work (tensors on the model's device)."""

    pieces: list[StatePiece] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None  # [B] int64: rows of the single-token chunks
    decode_slots: torch.Tensor | None = None  # [B] int64: their slots
    resets: list[int] = field(default_factory=list)  # slots zeroed before the step
    restores: list[tuple[int, int]] = field(default_factory=list)  # (slot, snapshot) copies

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_rows is None else self.decode_rows.numel()


def build_state_metadata(
    starts: Sequence[int], q_lens: Sequence[int], states: Sequence[ChunkState],
    device: torch.device,
) -> StateMetadata:
    """The step's StateMetadata from each chunk's start, length and state plan."""
    meta = StateMetadata()
    rows, slots = [], []
    row = 0
    for start, n, plan in zip(starts, q_lens, states, strict=True):
        if plan.restore is not None:
            meta.restores.append((plan.slot, plan.restore))
        elif start == 0:
            meta.resets.append(plan.slot)
        if n == 1:
            if plan.saves:
                raise ValueError("a single-token chunk saves no snapshot")
            rows.append(row)
            slots.append(plan.slot)
        else:
            cuts = tuple(c for c, _ in plan.saves)
            if any(not 0 < c <= n for c in cuts) or list(cuts) != sorted(set(cuts)):
                raise ValueError(f"snapshot points {cuts} are not increasing within 1..{n}")
            meta.pieces.append(StatePiece(slice(row, row + n), plan.slot, cuts,
                                          tuple(s for _, s in plan.saves)))
        row += n
    if rows:
        meta.decode_rows = to_device(torch.tensor(rows, dtype=torch.int64), device)
        meta.decode_slots = to_device(torch.tensor(slots, dtype=torch.int64), device)
    return meta
