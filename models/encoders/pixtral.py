"""Pixtral's vision encoder (Pixtral-12B, Mistral Small 3.1), on the shared ViT blocks.

Each image keeps its own size (multiples of the patch size, see models/mistral3/preprocess.py).
All images of a step are cut into patches and packed into one sequence: one matmul embeds every
patch (the checkpoint's bias-free convolution), an RMSNorm (`ln_pre`) follows, and the blocks
(RMSNorm, no biases, gated MLP) attend block-diagonally, one `Segments` entry per image, with
2-D rotary angles over each patch's (row, column).

Patches are listed merge-block-major: each m x m block of patches (m = the projector's spatial
merge size, 1 when there is no merger) is contiguous and blocks go row by row, so a downstream
merger is a view. Attention, rotary and the norms do not depend on the order inside an image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.layers.norm import RMSNorm
from models.layers.transfer import to_device
from models.layers.vit import Segments, ViTConfig, vit_blocks
from models.loader import Shard

NORM_EPS = 1e-5  # Pixtral's norms; the config does not carry it


@dataclass(frozen=True)
class PixtralVisionConfig:
    """A Pixtral vision config, read once."""

    vit: ViTConfig
    patch_size: int
    channels: int
    rope_theta: float

    @classmethod
    def from_hf(cls, vc) -> PixtralVisionConfig:
        if vc.model_type != "pixtral":
            raise NotImplementedError(f"vision tower {vc.model_type!r} is not Pixtral")
        rope = getattr(vc, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise NotImplementedError(f"Pixtral rope_type {rope['rope_type']!r} (axial only)")
        vit = ViTConfig(
            width=vc.hidden_size, depth=vc.num_hidden_layers, num_heads=vc.num_attention_heads,
            mlp_hidden=vc.intermediate_size, act=vc.hidden_act, norm="rms", norm_eps=NORM_EPS,
            gated_mlp=True, bias=False, rotary=True,
        )
        if vit.width // vit.num_heads % 4:
            raise ValueError(f"Pixtral head dim {vit.width // vit.num_heads} is not a multiple "
                             "of 4 (rows and columns each rotate half of it)")
        return cls(vit, vc.patch_size, vc.num_channels, float(rope.get("rope_theta", 10000.0)))


@dataclass
class PixtralBatch:
    """One step's images, packed on the host."""

    patches: torch.Tensor  # [N, C * p * p], merge-block-major per image
    positions: torch.Tensor  # [N, 2] int64 (row, column) of each patch
    images: Segments  # one segment per image
    sizes: list[int]  # patches per image


def build_pixtral_batch(
    pixel_values: Sequence[torch.Tensor], patch: int, merge: int, device: torch.device,
    dtype: torch.dtype,
) -> PixtralBatch:
    """Images [C, H, W] (H and W multiples of patch * merge) -> one packed batch."""
    pieces, positions, sizes = [], [], []
    for pixels in pixel_values:
        c, height, width = pixels.shape
        rows, cols = height // patch, width // patch
        if rows % merge or cols % merge or rows * patch != height or cols * patch != width:
            raise ValueError(f"image of {height}x{width} pixels is not made of whole "
                             f"{merge}x{merge} blocks of {patch}-pixel patches")
        grid = pixels.view(c, rows // merge, merge, patch, cols // merge, merge, patch)
        pieces.append(grid.permute(1, 4, 2, 5, 0, 3, 6).reshape(rows * cols, c * patch * patch))
        r = torch.arange(rows).view(rows // merge, 1, merge, 1).expand(-1, cols // merge, -1, merge)
        k = torch.arange(cols).view(1, cols // merge, 1, merge).expand(rows // merge, -1, merge, -1)
        positions.append(torch.stack([r.reshape(-1), k.reshape(-1)], dim=1))
        sizes.append(rows * cols)
    patches = torch.cat(pieces).to(dtype)
    return PixtralBatch(
        patches=patches if device.type == "cpu" else to_device(patches, device),
        positions=to_device(torch.cat(positions), device),
        images=Segments.build(sizes, device),
        sizes=sizes,
    )


class PixtralVisionTower(nn.Module):
    """Patch embedding, `ln_pre`, rotary ViT blocks; returns the requested hidden states."""

    def __init__(self, cfg: PixtralVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w, p = cfg.vit.width, cfg.patch_size
        self.patch_conv = nn.Conv2d(cfg.channels, w, p, p, bias=False)
        self.ln_pre = RMSNorm(w, NORM_EPS)
        self.blocks = vit_blocks(cfg.vit)
        # Pixtral's layout: of the head dim's frequencies, the even ones rotate by the row and
        # the odd ones by the column; rows' angles come first.
        dim = w // cfg.vit.num_heads
        steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
        inv = 1.0 / cfg.rope_theta ** (steps / dim)  # [D/2]
        self.inv_freq = torch.stack([inv[0::2], inv[1::2]])  # [2, D/4], not a parameter

    def resolve_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """Hidden-state indices (0: after `ln_pre`, i: block i's output; negative from the
        end), checked."""
        count = self.cfg.vit.depth + 1
        out = tuple(i + count if i < 0 else i for i in layers)
        if not all(0 <= i < count for i in out):
            raise ValueError(f"feature layers {list(layers)} are outside 0..{count - 1}")
        return out

    def forward(self, batch: PixtralBatch, layers: tuple[int, ...]) -> torch.Tensor:
        """-> the requested hidden states concatenated on the feature axis:
        [N, width * len(layers)], in the batch's patch order."""
        weight = self.patch_conv.weight
        x = self.ln_pre(batch.patches @ weight.view(weight.shape[0], -1).t())  # [N, width]
        inv = self.inv_freq.to(x.device)
        freqs = batch.positions[..., None].float() * inv  # [N, 2, D/4]
        freqs = freqs.flatten(1)[:, None]  # [N, 1, D/2]: row angles, then column angles
        rotary = (freqs.cos(), freqs.sin())
        states = {0: x}
        for i, block in enumerate(self.blocks[: max(layers)], start=1):
            x = block(x, batch.images, rotary)
            states[i] = x
        return torch.cat([states[i] for i in layers], dim=-1)

    def checkpoint_name(self, name: str) -> tuple[str, Shard | None] | None:
        """A name inside the checkpoint's `vision_tower.` -> ours."""
        if name.startswith(("patch_conv.", "ln_pre.")):
            return name, None
        if not name.startswith("transformer.layers."):
            raise ValueError(f"unexpected vision tower tensor {name}")
        layer, rest = name[len("transformer.layers."):].split(".", 1)
        module, param = rest.rsplit(".", 1)
        block, width, hidden = f"blocks.{layer}.", self.cfg.vit.width, self.cfg.vit.mlp_hidden
        renames = {"attention_norm": "norm1", "ffn_norm": "norm2", "attention.o_proj": "attn.proj",
                   "feed_forward.down_proj": "mlp.down_proj"}
        fused = {"attention.q_proj": ("attn.qkv", Shard(0, width)),
                 "attention.k_proj": ("attn.qkv", Shard(width, width)),
                 "attention.v_proj": ("attn.qkv", Shard(2 * width, width)),
                 "feed_forward.gate_proj": ("mlp.gate_up_proj", Shard(0, hidden)),
                 "feed_forward.up_proj": ("mlp.gate_up_proj", Shard(hidden, hidden))}
        if module in renames:
            return block + renames[module] + "." + param, None
        if module in fused:
            target, shard = fused[module]
            return block + target + "." + param, shard
        raise ValueError(f"unexpected vision tower tensor {name}")
