"""Projectors from an encoder's width into the language model's: what sits between a tower and
the decoder. LLaVA's two-layer MLP; the Qwen-VL patch merger (each m x m block of patches
concatenated, normed, then an MLP)."""

from __future__ import annotations

import torch
from torch import nn

from models.kernels.linear import EncoderLinear
from models.layers.mlp import ACTIVATIONS
from models.layers.norm import RMSNorm


class MLPProjector(nn.Module):
    """linear_2(act(linear_1(x))) (LLaVA's `multi_modal_projector`)."""

    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool = True) -> None:
        super().__init__()
        self.linear_1 = EncoderLinear(in_dim, out_dim, bias=bias)
        self.linear_2 = EncoderLinear(out_dim, out_dim, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class PatchMerger(nn.Module):
    """[N, width] patches in block-major order -> [N / merge^2, out_dim]: each block of merge^2
    patches concatenated and sent through Linear-GELU-Linear (Qwen-VL's merger), normed per
    patch before the concatenation, or over the concatenation with `postshuffle_norm`."""

    def __init__(self, width: int, merge: int, out_dim: int, rms_norm: bool,
                 postshuffle_norm: bool = False) -> None:
        super().__init__()
        self.merged = width * merge**2
        self.postshuffle = postshuffle_norm
        normed = self.merged if postshuffle_norm else width
        self.ln_q = RMSNorm(normed, 1e-6) if rms_norm else nn.LayerNorm(normed, 1e-6)
        self.mlp = nn.Sequential(
            EncoderLinear(self.merged, self.merged), nn.GELU(), EncoderLinear(self.merged, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            return self.mlp(self.ln_q(x.view(-1, self.merged)))
        return self.mlp(self.ln_q(x).view(-1, self.merged))
