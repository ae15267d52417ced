"""The KV blocks written since the pools were reserved, each zeroed at its first use.

The pools are reserved with torch.empty (engine/memory_plan.py), so their physical pages are
taken as blocks are first written and resident memory follows the conversations, not the
budget. What an unwritten slot holds is then undefined (NaN possible), and the padded gathers of
the SDPA attention paths read whole blocks: the slots past a request's last key in its last
block, and block 0, where the padding of a block table points (models/layers/attention.py).
Their scores are masked, but masked probabilities of 0 times NaN values are NaN. So a block is
zeroed, in every layer's pool, the first time a step writes it (or a prefix-cache tail is
copied into it), and block 0 at start-up; after that it holds keys and values or zeros, and
reuse by another request leaves finite values. Our C decode kernels and flash-attn's varlen
path read exactly the keys of the context and need none of this.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class BlocksInUse:
    """Which of `num_blocks` blocks have been zeroed (first used); the pools are zeroed block
    by block through `first_use`."""

    def __init__(self, num_blocks: int) -> None:
        self.used = bytearray(num_blocks)
        self.count = 0

    def first_use(self, blocks: Iterable[int], pools: list[torch.Tensor]) -> None:
        """Zero those of `blocks` never used before in every pool [2, Hkv, blocks, bs, D]."""
        fresh = []
        for b in blocks:
            if not self.used[b]:
                self.used[b] = 1
                fresh.append(b)
        if not fresh:
            return
        self.count += len(fresh)
        index = torch.tensor(fresh, dtype=torch.int64).to(pools[0].device, non_blocking=True)
        for pool in pools:
            pool.index_fill_(2, index, 0)


def chunk_blocks(chunks, block_size: int) -> list[int]:
    """The blocks a step's chunks write (their positions [start, end) in each request's block
    table)."""
    out: list[int] = []
    for c in chunks:
        if c.end > c.start:
            out.extend(c.req.block_ids[c.start // block_size : (c.end - 1) // block_size + 1])
    return out
