"""The pixel-shuffle connector (Idefics3, SmolVLM): each s x s block of a tile's patch grid
folded into one token s^2 times as wide, then a linear map into the decoder's width."""

from __future__ import annotations

import torch
from torch import nn

from models.kernels.linear import EncoderLinear


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[B, side^2, D] patches in row-major order -> [B, (side / s)^2, s^2 * D]: token (i, j)
    holds patches (i*s + di, j*s + dj), di outer, dj inner."""
    b, seq, dim = x.shape
    side = int(round(seq**0.5))
    if side * side != seq or side % scale:
        raise ValueError(f"{seq} patches are no square grid divisible by scale factor {scale}")
    n = side // scale
    x = x.view(b, n, scale, n, scale, dim).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, n * n, scale * scale * dim)


class PixelShuffleProjector(nn.Module):
    """pixel_shuffle, then one bias-free linear layer (`modality_projection.proj`)."""

    def __init__(self, width: int, scale: int, out_dim: int) -> None:
        super().__init__()
        self.scale = scale
        self.proj = EncoderLinear(width * scale * scale, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_shuffle(x, self.scale))
