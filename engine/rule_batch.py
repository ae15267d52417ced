"""The step's token rules (models/token_rules.py) as device tensors, applied to the sampled
logits in place: ranges and single tokens set to -inf, then the `force_from` comparison, with no
host sync."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device import to_device
from models.token_rules import VOCAB_END, TokenMask


@dataclass
class RuleBatch:
    """The step's ruled rows, moved to the device once."""

    rows: torch.Tensor  # [R] int64 rows of the sampled logits
    ranges: torch.Tensor  # [R, K, 2] int64, padded with empty (0, 0) ranges
    token_rows: torch.Tensor | None  # [N] int64, index into rows
    token_ids: torch.Tensor | None  # [N] int64
    force_from: torch.Tensor | None  # [R] int64; VOCAB_END: off

    @classmethod
    def build(cls, masks: list[tuple[int, TokenMask]], device: torch.device) -> RuleBatch:
        """`masks`: (row of the logits, its mask) for each ruled row."""
        width = max(1, max(len(m.ranges) for _, m in masks))
        ranges = [list(m.ranges) + [(0, 0)] * (width - len(m.ranges)) for _, m in masks]
        singles = [(i, t) for i, (_, m) in enumerate(masks) for t in m.tokens]
        forced = [m.force_from for _, m in masks]
        return cls(
            rows=to_device(torch.tensor([row for row, _ in masks], dtype=torch.int64), device),
            ranges=to_device(torch.tensor(ranges, dtype=torch.int64).view(len(masks), width, 2),
                             device),
            token_rows=to_device(torch.tensor([i for i, _ in singles], dtype=torch.int64),
                                 device) if singles else None,
            token_ids=to_device(torch.tensor([t for _, t in singles], dtype=torch.int64),
                                device) if singles else None,
            force_from=to_device(torch.tensor([VOCAB_END if f is None else f for f in forced],
                                              dtype=torch.int64), device)
            if any(f is not None for f in forced) else None,
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Rule out, in place, the excluded tokens of the ruled rows of logits [S, V]."""
        vocab = logits.shape[-1]
        ids = torch.arange(vocab, device=logits.device)
        sub = logits.index_select(0, self.rows)  # [R, V]
        lo, hi = self.ranges[..., 0:1], self.ranges[..., 1:2]  # [R, K, 1]
        banned = ((ids >= lo) & (ids < hi)).any(dim=1)  # [R, V]
        if self.token_ids is not None:
            keep = self.token_ids < vocab
            banned[self.token_rows[keep], self.token_ids[keep]] = True
        sub = sub.masked_fill(banned, float("-inf"))
        if self.force_from is not None:
            logp = sub.float().log_softmax(dim=-1)
            above = ids[None, :] >= self.force_from[:, None]  # [R, V]
            summed = logp.masked_fill(~above, float("-inf")).logsumexp(dim=-1)
            best_below = logp.masked_fill(above, float("-inf")).amax(dim=-1)
            sub = sub.masked_fill((summed > best_below)[:, None] & ~above, float("-inf"))
        logits.index_copy_(0, self.rows, sub)
