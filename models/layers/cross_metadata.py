"""Per-step plan of the cross-attention layers, built on the host like the attention metadata:
which rows of the flat batch attend to which media items' keys and values.

A cross-attention item (models.interfaces.CrossRows) is attended by a range of its
request's rows. Within a chunk, the rows split where an item's range starts or ends; rows that
see the same items, from any chunk of the step, form one `CrossSegment` (several items where
images follow each other, as Mllama groups them; one item for the decodes of several requests
about the same image, which then attend in one call). Rows that attend to no item (text-only
requests, text before a request's first image) are in no segment: the cross-attention layers
leave them unchanged, as Meta's Llama 3.2 Vision does (their attention output is zeroed, and so
is their MLP's). A step in which no row attends to anything has no metadata at all, and the
layers are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.layers.transfer import to_device

# One item of a chunk: (first row attending, end row or None for "to the end of the sequence",
# its keys and values [L, 2, Hkv, n, D] for the model's L cross-attention layers).
CrossItem = tuple[int, int | None, torch.Tensor]


@dataclass(frozen=True)
class CrossSegment:
    """Rows [lo, hi) of the attending rows (`CrossAttentionMetadata.rows` order) and the keys
    and values they attend to, in prompt order."""

    lo: int
    hi: int
    states: tuple[torch.Tensor, ...]


@dataclass
class CrossAttentionMetadata:
    """The attending rows of the step (`rows` [R] int64 into the flat batch; None: every row, in
    order) and their segments."""

    rows: torch.Tensor | None
    segments: list[CrossSegment]


def build_cross_metadata(
    starts: Sequence[int], q_lens: Sequence[int], items: Sequence[Sequence[CrossItem]],
    device: torch.device,
) -> CrossAttentionMetadata | None:
    """The step's plan from each chunk's start, length and cross-attention items (None: no row
    of the step attends to any item). Rows that see the same items (the same tensors), in any
    chunk, form one segment: requests about one image attend together."""
    groups: dict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], list[int]]] = {}
    offset = 0
    for start, n, chunk_items in zip(starts, q_lens, items, strict=True):
        end = start + n
        cuts = {start, end}
        for lo, hi, _ in chunk_items:
            cuts.update(p for p in (lo, hi) if p is not None and start < p < end)
        bounds = sorted(cuts)
        for a, b in zip(bounds, bounds[1:], strict=False):
            seen = tuple(s for lo, hi, s in chunk_items if lo <= a and (hi is None or b <= hi))
            if seen:
                key = tuple(id(s) for s in seen)
                groups.setdefault(key, (seen, []))[1].extend(
                    range(offset + a - start, offset + b - start))
        offset += n
    if not groups:
        return None
    rows: list[int] = []
    segments = []
    for seen, members in groups.values():
        segments.append(CrossSegment(len(rows), len(rows) + len(members), seen))
        rows += members
    if rows == list(range(offset)):
        return CrossAttentionMetadata(None, segments)
    index = to_device(torch.tensor(rows, dtype=torch.int64), device)
    return CrossAttentionMetadata(index, segments)
