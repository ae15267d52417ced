"""bench.flops' counts, which every media-turn table's "of the GEMM peak" column divides by:
a tower's linears and its attention within each segment."""

import torch
from torch import nn

from bench.flops import LinearFlops
from models.layers.vit import Segments, ViTAttention, ViTConfig


def test_tower_counts_linears_and_attention_per_segment():
    cfg = ViTConfig(width=16, depth=1, num_heads=2, mlp_hidden=32, act="gelu")
    model = nn.ModuleDict({"vision": ViTAttention(cfg), "head": nn.Linear(16, 8)})
    x = torch.randn(8, 16)
    with LinearFlops(model) as flops:
        model["vision"](x, Segments([3, 5]))
        model["head"](x)
    linears = 2 * 8 * 16 * (3 * 16) + 2 * 8 * 16 * 16  # qkv, then the output projection
    attention = 4 * (3 * 3 + 5 * 5) * 16  # QK^T and PV, each segment over itself
    assert flops.counts == {"tower": linears + attention, "decoder": 2 * 8 * 16 * 8}
    model["vision"](x, Segments([8]))  # hooks removed on exit
    assert flops.counts["tower"] == linears + attention
