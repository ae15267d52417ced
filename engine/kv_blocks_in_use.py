"""The KV blocks written since the pools were reserved, counted for the resident-memory report.

The pools are reserved with torch.empty (engine/kv_pool.py), so their physical pages are taken
as blocks are first written and resident memory follows the conversations, not the budget.
Nothing is zero-filled: a slot never written holds anything, NaN included, and every reader
keeps such slots out by masking. Our C decode kernels and flash-attn's varlen path read exactly
the keys of the context; the padded gathers of the SDPA paths zero the gathered rows past each
request's last key and in padding blocks (`KeyView.unwritten`, models/layers/attention_metadata.py).
Where the platform cannot say which pages are resident (engine/host_memory.py), the blocks
counted here times a block's bytes stand for them.
"""

from __future__ import annotations

from collections.abc import Iterable


class BlocksInUse:
    """Which of `num_blocks` blocks a step (or a prefix-cache copy) has written."""

    def __init__(self, num_blocks: int) -> None:
        self.used = bytearray(num_blocks)
        self.count = 0

    def mark(self, blocks: Iterable[int]) -> None:
        """Count those of `blocks` not written before."""
        for b in blocks:
            if not self.used[b]:
                self.used[b] = 1
                self.count += 1


def chunk_blocks(chunks, block_size: int) -> list[int]:
    """The blocks a step's chunks write (their positions [start, end) in each request's block
    table)."""
    out: list[int] = []
    for c in chunks:
        if c.end > c.start:
            out.extend(c.req.block_ids[c.start // block_size : (c.end - 1) // block_size + 1])
    return out
