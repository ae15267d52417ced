"""The InternViT tower of InternVL 2.5 / 3 / 3.5, as transformers' InternVLVisionModel computes
it: fixed-size tiles [B, 3, S, S] -> patch embeddings (a convolution with stride equal to its
kernel, with bias), a class token, learned absolute positions (optional), then pre-norm blocks
whose two branches are each scaled per channel by a learned vector (layer scale, `lambda_1` and
`lambda_2`), and an optional final LayerNorm (when the config does not mean-pool).

The variants the reference covers are options: LayerNorm or RMSNorm in the blocks (`norm_type`),
biases on q/k/v or not (`attention_bias`; the output projection always has one), and QK-norm,
an RMSNorm over the whole width of q and k before they are split into heads (InternViT-6B).
q, k and v run as one matmul. Every tile is one segment of the shared packed attention
(models/layers/vit.py): tiles never attend to each other, so a tile's output is the same
whatever else shares its forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.kernels.linear import EncoderLinear
from models.layers.mlp import ACTIVATIONS
from models.layers.norm import RMSNorm
from models.layers.vit import PlainMLP, Segments, segment_attention
from models.loader import Shard

QK_NORM_EPS = 1e-6  # the reference's q_norm / k_norm keep their class default, not the config's


@dataclass(frozen=True)
class InternViTConfig:
    """An InternVLVisionConfig, read once."""

    width: int
    depth: int
    num_heads: int
    mlp_hidden: int
    act: str
    norm: str  # "layer" or "rms" (the blocks' norms; the final norm is always a LayerNorm)
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    image_size: int
    patch_size: int
    channels: int
    positions: bool  # learned absolute position embeddings
    final_norm: bool  # a LayerNorm after the blocks (transformers: not use_mean_pooling)

    def __post_init__(self) -> None:
        if self.width % self.num_heads:
            raise ValueError(f"width {self.width} is not a multiple of {self.num_heads} heads")
        if self.act not in ACTIVATIONS:
            raise NotImplementedError(f"vision_config hidden_act {self.act!r} is not supported "
                                      f"({', '.join(ACTIVATIONS)})")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size "
                             f"{self.patch_size}")

    @property
    def side(self) -> int:
        """Patches per side of a tile."""
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, vc) -> InternViTConfig:
        """From transformers' InternVLVisionConfig (`image_size` and `patch_size` may be pairs:
        only square tiles and patches are supported, as every InternVL checkpoint has)."""
        if vc.model_type != "internvl_vision":
            raise NotImplementedError(f"vision tower {vc.model_type!r} is not InternViT")
        norms = {"layer_norm": "layer", "rms_norm": "rms"}
        if vc.norm_type not in norms:
            raise NotImplementedError(f"vision_config norm_type {vc.norm_type!r} is not "
                                      "supported (layer_norm, rms_norm)")
        return cls(
            width=vc.hidden_size, depth=vc.num_hidden_layers, num_heads=vc.num_attention_heads,
            mlp_hidden=vc.intermediate_size, act=vc.hidden_act, norm=norms[vc.norm_type],
            norm_eps=vc.layer_norm_eps, qkv_bias=bool(vc.attention_bias),
            qk_norm=bool(vc.use_qk_norm), image_size=_square(vc.image_size, "image_size"),
            patch_size=_square(vc.patch_size, "patch_size"), channels=vc.num_channels,
            positions=bool(vc.use_absolute_position_embeddings),
            final_norm=not vc.use_mean_pooling,
        )


def _square(value, name: str) -> int:
    if isinstance(value, int):
        return value
    height, width = value
    if height != width:
        raise NotImplementedError(f"vision_config {name} {list(value)}: only square "
                                  f"{name.split('_')[0]}s are supported")
    return int(height)


def _norm(cfg: InternViTConfig) -> nn.Module:
    if cfg.norm == "rms":
        return RMSNorm(cfg.width, cfg.norm_eps)
    return nn.LayerNorm(cfg.width, eps=cfg.norm_eps)


class InternAttention(nn.Module):
    """q, k, v in one matmul; optional QK-norm over the full width; the output projection."""

    def __init__(self, cfg: InternViTConfig) -> None:
        super().__init__()
        self.width, self.num_heads = cfg.width, cfg.num_heads
        self.qkv = EncoderLinear(cfg.width, 3 * cfg.width, bias=cfg.qkv_bias)
        self.proj = EncoderLinear(cfg.width, cfg.width)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.width, QK_NORM_EPS)
            self.k_norm = RMSNorm(cfg.width, QK_NORM_EPS)

    def forward(self, x: torch.Tensor, seg: Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).split(self.width, dim=-1)  # [N, width] each
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        shape = (n, self.num_heads, self.width // self.num_heads)
        out = segment_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape), seg)
        return self.proj(out.reshape(n, self.width))


class InternBlock(nn.Module):
    """x + lambda_1 * attn(norm1(x)), then x + lambda_2 * mlp(norm2(x))."""

    def __init__(self, cfg: InternViTConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(cfg), _norm(cfg)
        self.attn = InternAttention(cfg)
        self.mlp = PlainMLP(cfg.width, cfg.mlp_hidden, cfg.act)
        self.lambda_1 = nn.Parameter(torch.empty(cfg.width))
        self.lambda_2 = nn.Parameter(torch.empty(cfg.width))

    def forward(self, x: torch.Tensor, seg: Segments) -> torch.Tensor:
        x = x + self.lambda_1 * self.attn(self.norm1(x), seg)
        return x + self.lambda_2 * self.mlp(self.norm2(x))


class InternViT(nn.Module):
    """Tiles [B, C, S, S] -> hidden states [B, 1 + (S / patch)^2, width] (class token first)."""

    def __init__(self, cfg: InternViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.patch_embedding = nn.Conv2d(cfg.channels, w, cfg.patch_size, cfg.patch_size)
        self.cls_token = nn.Parameter(torch.empty(1, 1, w))
        if cfg.positions:
            self.position_embeddings = nn.Parameter(torch.empty(1, cfg.side**2 + 1, w))
        self.blocks = nn.ModuleList(InternBlock(cfg) for _ in range(cfg.depth))
        if cfg.final_norm:
            self.final_norm = nn.LayerNorm(w, eps=cfg.norm_eps)

    def resolve_layer(self, layer: int) -> int | None:
        """transformers' `vision_feature_layer`: -1 is the tower's output (after the final norm,
        if any); any other index selects from its hidden states (index 0 the embeddings, i the
        output of block i, negative counted from the end) before the final norm. -> None for
        the output, else the number of blocks to run."""
        if layer == -1:
            return None
        count = self.cfg.depth + 1
        index = layer + count if layer < 0 else layer
        if not 0 <= index < count:
            raise ValueError(f"vision_feature_layer {layer} is outside the tower's hidden states "
                             f"(-{count}..{count - 1})")
        return index

    def forward(self, pixel_values: torch.Tensor, blocks: int | None = None) -> torch.Tensor:
        """pixel_values [B, C, S, S] -> [B, 1 + P, width]: after `blocks` blocks (None: all of
        them and the final norm; see `resolve_layer`)."""
        b = pixel_values.shape[0]
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        x = torch.cat([self.cls_token.expand(b, 1, -1), x.flatten(2).transpose(1, 2)], dim=1)
        if self.cfg.positions:
            x = x + self.position_embeddings
        positions = x.shape[1]
        x = x.reshape(b * positions, -1)  # packed: every tile is one segment
        seg = Segments([positions] * b)
        for block in self.blocks[: self.cfg.depth if blocks is None else blocks]:
            x = block(x, seg)
        if blocks is None and self.cfg.final_norm:
            x = self.final_norm(x)
        return x.view(b, positions, -1)

    def checkpoint_name(self, name: str) -> tuple[str, Shard | None] | None:
        """A name inside the checkpoint's `vision_tower.` -> ours (None: a tensor not used)."""
        if name == "embeddings.mask_token":  # masked image modelling only
            return None
        if name == "embeddings.cls_token" or name == "embeddings.position_embeddings":
            return name.removeprefix("embeddings."), None
        if name.startswith("embeddings.patch_embeddings.projection."):
            return "patch_embedding." + name.rsplit(".", 1)[1], None
        if name.startswith("layernorm."):  # the reference ignores it when mean-pooling
            return ("final_norm." + name[len("layernorm."):], None) if self.cfg.final_norm \
                else None
        if not name.startswith("encoder.layer."):
            raise ValueError(f"unexpected vision tower tensor {name}")
        layer, rest = name[len("encoder.layer."):].split(".", 1)
        block = f"blocks.{layer}."
        if rest in ("lambda_1", "lambda_2"):
            return block + rest, None
        module, param = rest.rsplit(".", 1)
        renames = {"layernorm_before": "norm1", "layernorm_after": "norm2", "mlp.fc1": "mlp.fc1",
                   "mlp.fc2": "mlp.fc2", "attention.projection_layer": "attn.proj",
                   "attention.q_norm": "attn.q_norm", "attention.k_norm": "attn.k_norm"}
        if module in renames:
            return block + renames[module] + "." + param, None
        qkv = {"attention.q_proj": 0, "attention.k_proj": 1, "attention.v_proj": 2}
        if module in qkv:
            width = self.cfg.width
            return block + "attn.qkv." + param, Shard(qkv[module] * width, width)
        raise ValueError(f"unexpected vision tower tensor {name}")
