"""The keys and values of a model's cross-attention layers (Llama 3.2 Vision): how much memory
they may take, and which of them each chunk of a step attends to.

For such a model the encoder cache (engine/encoder_cache.py) holds, per media item, every
cross-attention layer's keys and values computed from it ([L, 2, Hkv, n, D], the model's
`encode` output), keyed by the item's content hash: a request holds its items while rows that
attend to them remain to be computed (the last image to the end of the request), releases them
when it finishes, is aborted, fails or is preempted (a resumed request looks them up again, and
encodes what was evicted meanwhile), and another request about the same image finds them there.
Its capacity is counted in key positions, from a byte budget (`cross_attention_cache_bytes`,
automatically half of the automatic KV-cache budget, which is smaller by as much).

Why the keys and values rather than the vision features: a running request needs every layer's
keys and values at each step, so holding them is the least any request about an image costs;
caching features instead would add the features to that, and recompute the projections of all
layers for each new request. At Llama 3.2 11B's shapes the keys and values are 4x the projected
features (8 layers x 2 x 8 heads x 128 against a 4096-wide feature); docs/architecture.md has
the figure for a 1120-pixel image.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from models.interfaces import LanguageModel
from models.layers.cross_metadata import CrossItem


@dataclass(frozen=True)
class CrossLayout:
    """The cross-attention states' budget: `num_keys` key positions of `bytes_per_key` (every
    cross-attention layer's key and value of one position)."""

    num_layers: int
    bytes_per_key: int
    num_keys: int

    @property
    def nbytes(self) -> int:
        return self.num_keys * self.bytes_per_key


def plan_cross_states(model: LanguageModel, config: EngineConfig, dtype: torch.dtype,
                      automatic_kv_bytes: int) -> CrossLayout | None:
    """The budget for `model`'s cross-attention states (None: it has no such layers)."""
    layers = model.cross_attention_layers()
    if not layers:
        return None
    cfg = model.cfg
    per_key = len(layers) * 2 * cfg.num_kv_heads * cfg.head_dim * (torch.finfo(dtype).bits // 8)
    budget = config.cross_attention_cache_bytes or automatic_kv_bytes // 2
    return CrossLayout(len(layers), per_key, budget // per_key)


def cross_items(chunks: Sequence, outputs: Mapping[str, torch.Tensor]) -> list[list[CrossItem]]:
    """Per chunk (engine.scheduler.ScheduledChunk), the cross-attention items whose rows it
    reaches: (first row, end row or None, keys and values)."""
    plan = []
    for c in chunks:
        items = []
        for f in c.req.mm_features:
            rows = f.cross
            if rows is None or rows.start >= c.end or (rows.end is not None
                                                       and rows.end <= c.start):
                continue
            states = outputs.get(f.identifier)
            if states is None:
                raise RuntimeError(f"{f.modality} {f.identifier[:12]}: no cross-attention states")
            items.append((rows.start, rows.end, states))
        plan.append(items)
    return plan
