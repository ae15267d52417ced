"""Projectors from an encoder's width into the language model's: what sits between a tower and
the decoder. LLaVA's two-layer MLP; the Qwen-VL patch merger (each m x m block of patches
concatenated, normed, then an MLP)."""

from __future__ import annotations

import torch
from torch import nn

from models.layers import ACTIVATIONS, RMSNorm


class MLPProjector(nn.Module):
    """linear_2(act(linear_1(x))) (LLaVA's `multi_modal_projector`)."""

    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool = True) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class PatchMerger(nn.Module):
    """[N, width] patches in block-major order -> [N / merge^2, out_dim]: each block of merge^2
    patches normed, concatenated, and sent through Linear-GELU-Linear (Qwen-VL's merger)."""

    def __init__(self, width: int, merge: int, out_dim: int, rms_norm: bool) -> None:
        super().__init__()
        self.merged = width * merge**2
        self.ln_q = RMSNorm(width, 1e-6) if rms_norm else nn.LayerNorm(width, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))
