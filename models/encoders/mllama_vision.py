"""Llama 3.2 Vision's tiled vision tower (transformers' MllamaVisionModel).

An image arrives as up to `max_num_tiles` tiles of `image_size` pixels (models/mllama/
preprocess.py), always that many: tiles past the image's own are zeros. Each tile becomes patch
embeddings (a convolution without bias) plus a gated, aspect-ratio-dependent tile embedding, a
class token, and positions that blend a shared table and a per-aspect-ratio one by a tanh gate;
a LayerNorm; then padding to a multiple of 8 positions per tile. A local transformer runs over
all tiles of an image at once, keeping some layers' outputs (`intermediate_layers_indices`);
after a LayerNorm and a second gated tile embedding, a global transformer with tanh-gated
residuals runs over them again. The output per tile position is the global transformer's state
followed by the kept local states interleaved channel by channel (transformers stacks them on a
last axis and flattens it), `vision_output_dim` wide, padding removed.

Attention inside an image is masked only between two padding positions (padding tiles or the
padding after each tile's patches): a real position sees every position, padding sees the real
ones. That is transformers' mask, and what the checkpoints were run with; it is why padding
tiles are encoded at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels.linear import EncoderLinear
from models.layers.mlp import ACTIVATIONS
from models.layers.transfer import to_device


@dataclass(frozen=True)
class MllamaVisionConfig:
    """The tower's shape, read once from transformers' MllamaVisionConfig."""

    width: int
    num_heads: int
    mlp_hidden: int
    act: str
    norm_eps: float
    image_size: int
    patch_size: int
    channels: int
    max_num_tiles: int
    num_aspect_ratios: int  # len(supported_aspect_ratios); ids run from 1 (0: none)
    depth: int
    global_depth: int
    intermediate: tuple[int, ...]
    output_dim: int

    def __post_init__(self) -> None:
        if self.width % self.num_heads:
            raise ValueError(f"vision width {self.width} is not a multiple of {self.num_heads} "
                             "heads")
        if self.output_dim != self.width * (1 + len(self.intermediate)):
            raise ValueError(
                f"vision_output_dim={self.output_dim} is not hidden_size x (1 + "
                f"len(intermediate_layers_indices)) = {self.width * (1 + len(self.intermediate))}")
        if any(not 0 <= i < self.depth for i in self.intermediate):
            raise ValueError(f"intermediate_layers_indices {list(self.intermediate)} are not "
                             f"layers of the {self.depth}-layer transformer")
        if self.num_positions % 8 == 0:  # transformers then masks every position
            raise ValueError(
                f"image_size={self.image_size} / patch_size={self.patch_size} gives "
                f"{self.num_positions} positions per tile, a multiple of 8, which transformers' "
                "Mllama masks entirely; not supported")

    @property
    def num_positions(self) -> int:
        """Positions per tile: the patches and the class token."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def padded_positions(self) -> int:
        return -(-self.num_positions // 8) * 8

    @classmethod
    def from_hf(cls, vc) -> MllamaVisionConfig:
        return cls(
            width=vc.hidden_size, num_heads=vc.attention_heads, mlp_hidden=vc.intermediate_size,
            act=vc.hidden_act, norm_eps=vc.norm_eps, image_size=vc.image_size,
            patch_size=vc.patch_size, channels=vc.num_channels, max_num_tiles=vc.max_num_tiles,
            num_aspect_ratios=len(vc.supported_aspect_ratios), depth=vc.num_hidden_layers,
            global_depth=vc.num_global_layers,
            intermediate=tuple(vc.intermediate_layers_indices), output_dim=vc.vision_output_dim,
        )


class _Attention(nn.Module):
    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        w = cfg.width
        self.q_proj, self.k_proj = EncoderLinear(w, w, bias=False), EncoderLinear(w, w, bias=False)
        self.v_proj, self.o_proj = EncoderLinear(w, w, bias=False), EncoderLinear(w, w, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, w))


class _MLP(nn.Module):
    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.fc1 = EncoderLinear(cfg.width, cfg.mlp_hidden)
        self.fc2 = EncoderLinear(cfg.mlp_hidden, cfg.width)
        self.act = ACTIVATIONS[cfg.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Block(nn.Module):
    """Pre-norm attention and MLP; in the global transformer each residual is tanh-gated."""

    def __init__(self, cfg: MllamaVisionConfig, gated: bool) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
        self.mlp = _MLP(cfg)
        self.gated = gated
        if gated:
            self.gate_attn = nn.Parameter(torch.zeros(1))
            self.gate_ffn = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), mask)
        x = x + (self.gate_attn.tanh() * h if self.gated else h)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (self.gate_ffn.tanh() * h if self.gated else h)


class _Encoder(nn.Module):
    def __init__(self, cfg: MllamaVisionConfig, depth: int, gated: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(cfg, gated) for _ in range(depth))


class _TileEmbedding(nn.Module):
    """A gated embedding per aspect ratio, one vector per tile (transformers'
    MllamaPrecomputedAspectRatioEmbedding)."""

    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.tiles = cfg.max_num_tiles
        self.embedding = nn.Embedding(cfg.num_aspect_ratios + 1, cfg.max_num_tiles * cfg.width)
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        """x [N, T, P, W] + [N, T, 1, W]."""
        emb = self.embedding(aspect_ratio_ids).view(-1, self.tiles, 1, x.shape[-1])
        return x + emb * self.gate.tanh()


class _GatedPositions(nn.Module):
    """Positions: (1 - tanh(gate)) x a shared table + tanh(gate) x a per-aspect-ratio table
    for every tile position (transformers' MllamaPrecomputedPositionEmbedding)."""

    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.tiles, p, w = cfg.max_num_tiles, cfg.num_positions, cfg.width
        self.gate = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Parameter(torch.zeros(p, w))
        self.tile_embedding = nn.Embedding(cfg.num_aspect_ratios + 1, cfg.max_num_tiles * p * w)

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        """x [N, T, P, W] -> the same with positions added."""
        n, t, p, w = x.shape
        gate = self.gate.tanh()
        x = x + ((1 - gate) * self.embedding).view(1, 1, p, w)
        tiles = self.tile_embedding(aspect_ratio_ids).view(n, t, p, w)
        return x + gate * tiles


class MllamaVisionTower(nn.Module):
    """Pixel tiles -> per-tile-position features (see the module docstring)."""

    def __init__(self, cfg: MllamaVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.patch_embedding = nn.Conv2d(cfg.channels, w, cfg.patch_size, cfg.patch_size,
                                         bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(w))
        self.gated_positional_embedding = _GatedPositions(cfg)
        self.pre_tile_positional_embedding = _TileEmbedding(cfg)
        self.post_tile_positional_embedding = _TileEmbedding(cfg)
        # transformers builds these two with LayerNorm's default epsilon, not norm_eps.
        self.layernorm_pre, self.layernorm_post = nn.LayerNorm(w), nn.LayerNorm(w)
        self.transformer = _Encoder(cfg, cfg.depth, gated=False)
        self.global_transformer = _Encoder(cfg, cfg.global_depth, gated=True)

    def forward(self, pixels: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                num_tiles: list[int]) -> torch.Tensor:
        """pixels [N, T, C, S, S] (T = max_num_tiles), aspect_ratio_ids [N] int64, each image's
        own tile count -> [N, T, P, output_dim] (the padding tiles' rows are meaningless)."""
        cfg = self.cfg
        n, t = pixels.shape[:2]
        w, p, padded = cfg.width, cfg.num_positions, cfg.padded_positions
        x = self.patch_embedding(pixels.flatten(0, 1).to(self.patch_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2).reshape(n, t, p - 1, w)  # [N, T, patches, W]
        x = self.pre_tile_positional_embedding(x, aspect_ratio_ids)
        cls = self.class_embedding.expand(n, t, 1, w)
        x = self.gated_positional_embedding(torch.cat([cls, x], dim=2), aspect_ratio_ids)
        x = F.pad(self.layernorm_pre(x), (0, 0, 0, padded - p)).view(n, t * padded, w)
        mask = self._mask(num_tiles, t, x.dtype, x.device)
        kept = {}
        for i, layer in enumerate(self.transformer.layers):
            x = layer(x, mask)
            kept[i] = x
        x = self.layernorm_post(x).view(n, t, padded, w)
        x = self.post_tile_positional_embedding(x, aspect_ratio_ids).view(n, t * padded, w)
        for layer in self.global_transformer.layers:
            x = layer(x, mask)
        # The kept states interleave channel by channel: feature c * K + k is layer k's c.
        local = torch.stack([kept[i] for i in cfg.intermediate], dim=-1)
        local = local.reshape(n, t, padded, -1)
        out = torch.cat([x.view(n, t, padded, w), local], dim=-1)
        return out[:, :, :p]

    def _mask(self, num_tiles: list[int], t: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """Additive [N, 1, L, L]: -inf only where both the query and the key are padding."""
        padded, p = self.cfg.padded_positions, self.cfg.num_positions
        real_position = torch.arange(padded) < p
        masks = []
        for count in num_tiles:
            real = ((torch.arange(t) < count)[:, None] & real_position[None]).view(-1)
            hidden = ~real[:, None] & ~real[None, :]
            masks.append(torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden,
                                                                              float("-inf")))
        return to_device(torch.stack(masks)[:, None], device)
