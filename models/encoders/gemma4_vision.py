"""Gemma 4's vision tower: images (and video frames) at their own resolution as packed patch
sequences, one segment per item.

Patches [N, 3 p^2] (pixels in [0, 1], made [-1, 1] here) are projected and given learned
position embeddings per axis (a row of a table for the patch's column, one for its row). Each
block: RMSNorms before and after attention and MLP (weights applied in float32), attention with
q / k norms and unscaled values normed without a weight, 2-D rotary angles (the first half of
each head rotated by the patch's column, the second half by its row), unscaled scores, a gated
MLP; every linear optionally clamps its input and output to bounds the checkpoint holds
(`use_clipped_linears`). Each item's final states are average-pooled over k x k patch blocks
(row-major over the pooled grid), scaled by sqrt(width) and optionally standardized, in float32;
the caller projects them (`MultimodalEmbedder`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels.linear import EncoderLinear
from models.layers.mlp import ACTIVATIONS
from models.layers.norm import RMSNorm, rms_norm_unscaled
from models.layers.rotary import apply_rotary
from models.layers.transfer import to_device
from models.layers.vit import Segments, segment_attention


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """The tower's shape, read from a Gemma4VisionConfig."""

    width: int
    depth: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_hidden: int
    act: str
    eps: float
    patch_size: int
    pooling: int
    positions: int  # rows of each axis's position table
    rope_theta: float
    clipped: bool
    standardize: bool

    @classmethod
    def from_hf(cls, vc) -> Gemma4VisionConfig:
        rope = dict(vc.rope_parameters or {})
        if rope.get("rope_type", "axial") != "axial":
            raise NotImplementedError(f"vision rope_type {rope['rope_type']!r} (axial only)")
        head_dim = getattr(vc, "head_dim", None) or vc.hidden_size // vc.num_attention_heads
        return cls(vc.hidden_size, vc.num_hidden_layers, vc.num_attention_heads,
                   vc.num_key_value_heads, head_dim, vc.intermediate_size,
                   vc.hidden_activation, vc.rms_norm_eps, vc.patch_size,
                   vc.pooling_kernel_size, vc.position_embedding_size,
                   float(rope.get("rope_theta", vc.default_theta)), bool(vc.use_clipped_linears),
                   bool(vc.standardize))


class ClippedLinear(nn.Module):
    """A linear without bias whose input and output are clamped to the checkpoint's scalar
    bounds (`clipped`), or a plain one."""

    def __init__(self, n_in: int, n_out: int, clipped: bool) -> None:
        super().__init__()
        self.linear = EncoderLinear(n_in, n_out, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                setattr(self, name, nn.Parameter(torch.zeros(())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


def norm(dim: int, eps: float) -> RMSNorm:
    return RMSNorm(dim, eps, float32_scale=True)


class VisionAttention(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = ClippedLinear(cfg.width, q, cfg.clipped)
        self.k_proj = ClippedLinear(cfg.width, kv, cfg.clipped)
        self.v_proj = ClippedLinear(cfg.width, kv, cfg.clipped)
        self.o_proj = ClippedLinear(q, cfg.width, cfg.clipped)
        self.q_norm, self.k_norm = norm(cfg.head_dim, cfg.eps), norm(cfg.head_dim, cfg.eps)

    def forward(self, x: torch.Tensor, seg: Segments, rotary) -> torch.Tensor:
        n, c = x.shape[0], self.cfg
        q = _rotate_2d(self.q_norm(self.q_proj(x).view(n, c.num_heads, c.head_dim)), rotary)
        k = _rotate_2d(self.k_norm(self.k_proj(x).view(n, c.num_kv_heads, c.head_dim)), rotary)
        v = rms_norm_unscaled(self.v_proj(x).view(n, c.num_kv_heads, c.head_dim), c.eps)
        if c.num_kv_heads != c.num_heads:
            k = k.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
            v = v.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
        return self.o_proj(segment_attention(q, k, v, seg, scale=1.0).reshape(n, -1))


def _rotate_2d(x: torch.Tensor, rotary) -> torch.Tensor:
    """x [N, H, D]: the first D/2 rotated by the column angles, the rest by the row angles."""
    (cos_x, sin_x), (cos_y, sin_y) = rotary
    half = x.shape[-1] // 2
    return torch.cat([apply_rotary(x[..., :half], cos_x, sin_x),
                      apply_rotary(x[..., half:], cos_y, sin_y)], dim=-1)


class VisionMLP(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.gate_proj = ClippedLinear(cfg.width, cfg.mlp_hidden, cfg.clipped)
        self.up_proj = ClippedLinear(cfg.width, cfg.mlp_hidden, cfg.clipped)
        self.down_proj = ClippedLinear(cfg.mlp_hidden, cfg.width, cfg.clipped)
        self.act = ACTIVATIONS[cfg.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionLayer(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.self_attn, self.mlp = VisionAttention(cfg), VisionMLP(cfg)
        self.input_layernorm = norm(cfg.width, cfg.eps)
        self.post_attention_layernorm = norm(cfg.width, cfg.eps)
        self.pre_feedforward_layernorm = norm(cfg.width, cfg.eps)
        self.post_feedforward_layernorm = norm(cfg.width, cfg.eps)

    def forward(self, x: torch.Tensor, seg: Segments, rotary) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), seg, rotary))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.input_proj = EncoderLinear(3 * cfg.patch_size**2, cfg.width, bias=False)
        self.position_embedding_table = nn.Parameter(torch.empty(2, cfg.positions, cfg.width))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3 p^2] float32 in [0, 1], positions [N, 2] (column, row) -> [N, width]."""
        weight = self.input_proj.weight
        h = self.input_proj((2 * (pixels - 0.5)).to(weight.dtype))
        table = self.position_embedding_table
        return h + (F.embedding(positions[:, 0], table[0]) + F.embedding(positions[:, 1], table[1]))


class Encoder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.depth))


@dataclass
class VisionBatch:
    """A step's items packed: patches [N, 3 p^2], positions [N, 2], each item's patch grid
    (rows, columns) and its segment of the packed sequence."""

    pixels: torch.Tensor
    positions: torch.Tensor
    grids: list[tuple[int, int]]
    segments: Segments

    @property
    def sizes(self) -> list[int]:
        """Embeddings per item (after pooling)."""
        return self.segments.lengths


class Gemma4VisionTower(nn.Module):
    """Packed patches -> pooled, scaled (and standardized) states [sum of items' tokens, width]
    in float32."""

    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = Encoder(cfg)
        if cfg.standardize:
            self.std_bias = nn.Parameter(torch.zeros(cfg.width))
            self.std_scale = nn.Parameter(torch.ones(cfg.width))
        spatial = cfg.head_dim // 2
        # Explicitly on the CPU first: the tower is built on the meta device.
        steps = torch.arange(0, spatial, 2, dtype=torch.float32, device="cpu")
        self.inv_freq = 1.0 / cfg.rope_theta ** (steps / spatial)

    def batch(self, items: list[dict], device: torch.device) -> VisionBatch:
        """Items ({"pixel_values" [n, 3 p^2], "positions" [n, 2], "grid" (rows, cols)}) packed
        on the host."""
        pixels = torch.cat([d["pixel_values"] for d in items])
        positions = torch.cat([d["positions"] for d in items])
        grids = [tuple(d["grid"]) for d in items]
        lengths = [r * c for r, c in grids]
        return VisionBatch(to_device(pixels, device), to_device(positions, device), grids,
                           Segments.build(lengths, device, pad=False))

    def forward(self, batch: VisionBatch) -> torch.Tensor:
        x = self.patch_embedder(batch.pixels, batch.positions)
        angles = batch.positions.float()[:, :, None] * self.inv_freq.to(x.device)  # [N, 2, F]
        rotary = [(a.cos().to(x.dtype)[:, None], a.sin().to(x.dtype)[:, None])
                  for a in angles.unbind(1)]
        for layer in self.encoder.layers:
            x = layer(x, batch.segments, rotary)
        k = self.cfg.pooling
        pooled = []
        for states, (rows, cols) in zip(x.split(batch.segments.lengths), batch.grids,
                                        strict=True):
            if rows % k or cols % k:
                raise ValueError(f"a {rows} x {cols} patch grid does not pool by {k} x {k}")
            grid = states.float().view(rows // k, k, cols // k, k, -1)
            pooled.append(grid.mean(dim=(1, 3)).reshape(-1, states.shape[-1]))
        out = torch.cat(pooled) * math.sqrt(self.cfg.width)
        if self.cfg.standardize:
            out = (out - self.std_bias.float()) * self.std_scale.float()
        return out


class MultimodalEmbedder(nn.Module):
    """A tower's output [n, d] -> the decoder's width: RMS-normed without a weight, projected."""

    def __init__(self, dim: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.embedding_projection = EncoderLinear(dim, hidden, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms_norm_unscaled(x, self.eps))
