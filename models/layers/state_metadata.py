"""Per-step indices for the layers that carry a recurrent state instead of a KV cache (Gated
DeltaNet), built on the host like the attention metadata.

Every running request owns a state slot (rows of each linear layer's state pools, assigned by
engine.state_cache). A step's chunk either starts its sequence (its slot is zeroed first),
resumes from a prefix-cache snapshot (the snapshot is copied into its slot first), or continues
from what its slot holds. Multi-token chunks are `StatePiece`s, run one by one in the chunked
form, split where a snapshot of the state is to be saved; single-token chunks (decodes) run
together through the one-step recurrence, their states read and written in the pool by slot.

A chunk of draft tokens being verified (speculative decoding) is a `VerifyPiece`: its tokens go
through the one-step forms one after another, as decodes of those tokens would, in `steps`
(step i holds every verification's token i, the first step also the decodes). Its slot's state
is backed up before, and once the engine knows how many of its tokens were accepted, the layer
keeps the state after the last accepted one (`GatedDeltaNet.keep_verified`).
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


@dataclass(frozen=True)
class VerifyPiece:
    """A chunk of draft tokens being verified: its rows and its slot."""

    rows: slice
    slot: int


@dataclass
class StateMetadata:
    """The step's state work (tensors on the model's device)."""

    pieces: list[StatePiece] = field(default_factory=list)
    # One-token steps in order, (rows [B], slots [B]) int64: the decodes and every
    # verification's first token, then each verification's next token, ...
    steps: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    verify: list[VerifyPiece] = field(default_factory=list)
    verify_slots: torch.Tensor | None = None  # [V] int64: the verifications' slots
    resets: list[int] = field(default_factory=list)  # slots zeroed before the step
    restores: list[tuple[int, int]] = field(default_factory=list)  # (slot, snapshot) copies


def build_state_metadata(
    starts: Sequence[int], q_lens: Sequence[int], states: Sequence[ChunkState],
    device: torch.device, decode_chunks: Sequence[bool] | None = None,
) -> StateMetadata:
    """The step's StateMetadata from each chunk's start, length and state plan;
    `decode_chunks`: whether each chunk is a verification of drafts."""
    meta = StateMetadata()
    steps: list[tuple[list[int], list[int]]] = []  # per one-token step: (rows, slots)
    row = 0
    for start, n, plan, verify in zip(starts, q_lens, states,
                                      decode_chunks or [False] * len(starts), strict=True):
        if plan.restore is not None:
            meta.restores.append((plan.slot, plan.restore))
        elif start == 0:
            meta.resets.append(plan.slot)
        if n == 1 or verify:
            if plan.saves:
                raise ValueError("a decode or a verification saves no snapshot")
            while len(steps) < n:
                steps.append(([], []))
            for i in range(n):
                steps[i][0].append(row + i)
                steps[i][1].append(plan.slot)
            if verify:
                meta.verify.append(VerifyPiece(slice(row, row + n), plan.slot))
        else:
            cuts = tuple(c for c, _ in plan.saves)
            if any(not 0 < c <= n for c in cuts) or list(cuts) != sorted(set(cuts)):
                raise ValueError(f"snapshot points {cuts} are not increasing within 1..{n}")
            meta.pieces.append(StatePiece(slice(row, row + n), plan.slot, cuts,
                                          tuple(s for _, s in plan.saves)))
        row += n
    meta.steps = [(to_device(torch.tensor(rows, dtype=torch.int64), device),
                   to_device(torch.tensor(slots, dtype=torch.int64), device))
                  for rows, slots in steps]
    if meta.verify:
        meta.verify_slots = to_device(
            torch.tensor([p.slot for p in meta.verify], dtype=torch.int64), device)
    return meta
